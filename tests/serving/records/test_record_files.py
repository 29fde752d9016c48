"""The run folder's files as an attacker leaves them (records/files.py, records/state.py read_record): a lock
file that is a link is refused and its target never written; a record or lock that is a FIFO never hangs a
command; a record linked to /dev/zero, over a MiB or nested 100,000 deep is damaged, not read whole or recursed
into; a pid of 0 or past Linux's largest is no process. Each is one line naming the file."""

from __future__ import annotations

import json
import os
import time

import pytest

from tools.core.errors import ToolFailure
from tools.serving.config import load_config
from tools.serving.records import files, placement
from tools.serving.records.state import DamagedState, ProcessRecord, instance_lock, read_record


@pytest.fixture
def cfg(tmp_path, monkeypatch):
    monkeypatch.setenv("STATE_DIR", str(tmp_path / "run"))
    return load_config(None, instance="blue")


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious data\n")
    return victim


def test_a_lock_file_that_is_a_link_is_refused_and_what_it_names_is_not_written(cfg, tmp_path):
    victim = _victim(tmp_path)
    cfg.instance_dir.mkdir(parents=True)
    lock = cfg.instance_dir / "vllm.lock"
    lock.symlink_to(victim)
    with pytest.raises(ToolFailure) as e:
        with instance_lock(cfg, "stop"):
            pass
    assert str(lock) in str(e.value) and "not a regular file" in str(e.value) and "\n" not in str(e.value)
    assert victim.read_text() == "precious data\n" and lock.is_symlink()
    assert files.holder(lock) is None and files.holder_text(lock) == "another command"

    root_lock = cfg.state_dir / ".instances.lock"
    root_lock.symlink_to(victim)
    with pytest.raises(ToolFailure, match="not a regular file"):
        with placement.locked(cfg):
            pass
    assert victim.read_text() == "precious data\n"


def test_a_lock_or_a_record_that_is_a_fifo_never_hangs(tmp_path):
    fifo = tmp_path / "switch.lock"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(ToolFailure, match="not a regular file"):
        files.flocked(fifo)
    assert files.holder(fifo) is None and files.holder_text(fifo) == "another command"
    record = tmp_path / "vllm.json"
    os.mkfifo(record)
    with pytest.raises(DamagedState, match="not a regular file"):
        read_record(record, ProcessRecord)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("how", ["dev-zero", "huge", "nested", "pid-0", "pid-past-max", "pid-2**70", "nan-start",
                                 "inf-start"])
def test_a_record_no_process_record_can_be_is_damaged_in_one_line(tmp_path, how):
    path = tmp_path / "vllm.json"
    record = {"pid": os.getpid(), "pgid": os.getpid(), "create_time": 0.0}
    if how == "dev-zero":
        path.symlink_to("/dev/zero")
    elif how == "huge":
        path.write_text(json.dumps({**record, "pad": "x" * (files.RECORD_MAX_BYTES + 1)}))
    elif how == "nested":
        path.write_text("[" * 100_000)
    elif how.endswith("-start"):  # NaN matched any live pid's start time (no difference is > 1 s from NaN)
        path.write_text(json.dumps(record)[:-1] + f', "create_time": {"NaN" if how == "nan-start" else "Infinity"}}}')
    else:
        pid = {"pid-0": 0, "pid-past-max": (1 << 22) + 1, "pid-2**70": 2 ** 70}[how]
        path.write_text(json.dumps({**record, "pid": pid, "pgid": pid}))
    with pytest.raises(DamagedState) as e:
        read_record(path, ProcessRecord)
    line = str(e.value)
    assert str(path) in line and "is damaged" in line and "\n" not in line and len(line) < 400, line


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_records_that_are_no_files_are_listed_by_status_and_stop_all(cli_here, tmp_path, kind):
    """router.json and blue/vllm.json as FIFOs or folders: status said "not running (no server recorded)" and
    stop --all "no router recorded", exit 0, while router status and plain stop named them damaged. Listing and
    reading agree: each is named damaged, status exits 3 and stop --all 1."""
    from tests.helpers.fixtures import state_env

    run = tmp_path / "run"
    (run / "blue").mkdir(parents=True)
    for path in (run / "router.json", run / "blue" / "vllm.json"):
        os.mkfifo(path) if kind == "fifo" else path.mkdir()
    r = cli_here(["status"], state_env(run))
    assert r.returncode == 3 and "no server recorded" not in r.stdout, r.stdout
    assert "router.json is damaged" in r.stdout and "blue/vllm.json is damaged" in r.stdout, r.stdout
    r = cli_here(["stop", "--all", "--grace", "1"], state_env(run))
    assert r.returncode == 1 and "\n" not in r.stderr.strip(), r.stderr
    assert "router.json is damaged" in r.stderr and "blue/vllm.json is damaged" in r.stderr, r.stderr
