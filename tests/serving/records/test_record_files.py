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


def test_a_log_that_is_a_link_or_a_fifo_is_refused_and_what_it_names_is_not_written(cfg, tmp_path, monkeypatch):
    """The router's log (STATE_DIR/router.log) was opened through a link and overwrote the file it named: the
    logs a command writes (router's, switch's, each start's) are opened as the lock files are, never followed."""
    import subprocess

    from tools.serving.frontdoor import router
    from tools.serving.records.router_state import log_file

    victim = _victim(tmp_path)
    cfg.state_dir.mkdir(parents=True)
    link = log_file(cfg)
    link.symlink_to(victim)
    launched = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: launched.append(a))
    with pytest.raises(ToolFailure) as e:
        router._launch(cfg, ["vllm-router"], "127.0.0.1", 9, "round_robin", [], 1.0)
    assert str(link) in str(e.value) and "not a regular file" in str(e.value) and "\n" not in str(e.value)
    assert victim.read_text() == "precious data\n" and link.is_symlink() and launched == []
    fifo = tmp_path / "switch.log"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    with pytest.raises(ToolFailure, match="not a regular file"):
        files.open_log(fifo, "ab")
    assert time.monotonic() - t0 < 5
    plain = tmp_path / "vllm.log"
    with files.open_log(plain) as fh:
        fh.write(b"a")
    with files.open_log(plain, "ab") as fh:
        fh.write(b"b")
    assert plain.read_bytes() == b"ab"


def test_failed_starts_logs_are_kept_in_state_dir_only_and_only_they_are_pruned(cfg, tmp_path):
    """A link at STATE_DIR[/NAME]/logs took a failed start's log out of STATE_DIR and pruned the files it found
    there by their suffix (-failed.log): the folder is not followed, and pruning removes the kept logs alone."""
    from tools.serving.server import switch_record

    log = tmp_path / "engine.log"
    log.write_text("ERROR boom\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    theirs = [elsewhere / f"important{i:02d}-failed.log" for i in range(12)]
    for i, f in enumerate(theirs):
        f.write_text("x")
        os.utime(f, (1e9 + i, 1e9 + i))
    cfg.instance_dir.mkdir(parents=True)
    switch_record.logs_dir(cfg).symlink_to(elsewhere)
    assert switch_record.keep_failed_log(cfg, log, "build2") is None
    assert sorted(elsewhere.iterdir()) == theirs
    switch_record.logs_dir(cfg).unlink()
    folder = switch_record.logs_dir(cfg)
    folder.mkdir()
    foreign = folder / "notes-failed.log"
    foreign.write_text("mine")
    os.utime(foreign, (1e9, 1e9))
    kept = [switch_record.keep_failed_log(cfg, log, "build2") for _ in range(switch_record.KEEP_FAILED + 2)]
    assert all(k is not None for k in kept) and foreign.read_text() == "mine"
    left = sorted(p for p in folder.iterdir() if p != foreign)
    assert left == sorted(kept[-switch_record.KEEP_FAILED:]), left


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


def test_a_lock_that_is_a_folder_is_no_holder_and_is_refused_naming_it(cfg, tmp_path):
    """A folder at switch.lock or an instance's vllm.lock: reading who held it said "3: it is a folder; give another
    path" (the descriptor's number for a path) in status, start and stop. It is held by no command, and taking it is
    refused in one line naming the file and what to do."""
    for lock in (cfg.state_dir / "switch.lock", cfg.instance_dir / "vllm.lock"):
        lock.mkdir(parents=True)
        assert files.holder(lock) is None and files.holder_text(lock) == "another command"
        with pytest.raises(ToolFailure) as e:
            files.flocked(lock)
        line = str(e.value)
        assert str(lock) in line and "not a regular file" in line and "delete it" in line and "\n" not in line


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
