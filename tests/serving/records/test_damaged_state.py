"""A state file that is damaged (not JSON, a field missing, a list instead of an object) is reported in one line
naming the file and the field; it blocks neither `stop --all` nor `status` for the servers whose readable records
prove they are theirs, and no process of it is signalled. "Servers" here are stand-in processes with state files,
as start would write them (tests/serving/conftest.py's fleet)."""

from __future__ import annotations

import json
import subprocess
import sys

import psutil
import pytest

from tests.helpers.fixtures import free_port, state_env
from tools.serving.config import load_config
from tools.serving.records.state import DamagedState, ServerState, read_record

DAMAGE = {
    "garbage": "garbage\n",
    "missing-field": None,  # a real record without its pid
    "list": "[1, 2, 3]\n",
}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _damage(path, how: str, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "missing-field":
        path.write_text(json.dumps({k: v for k, v in record.items() if k != "pid"}))
    else:
        path.write_text(DAMAGE[how])


@pytest.mark.parametrize("how", list(DAMAGE))
@pytest.mark.parametrize("where", ["router", "default", "instance"])
def test_stop_all_stops_every_readable_server_past_a_damaged_file(cli_here, tmp_path, fleet, stranger, where, how):
    a = fleet("a", free_port())
    b = fleet("b", free_port())
    run = tmp_path / "run"
    damaged = {"router": run / "router.json", "default": run / "vllm.json", "instance": run / "c" / "vllm.json"}[where]
    _damage(damaged, how, {**a, "pid": stranger.pid, "pgid": stranger.pid})
    r = cli_here(["stop", "--all", "--grace", "2"], state_env(run))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(damaged) in lines[0] and "Traceback" not in r.stderr, r.stderr
    if how == "missing-field":
        assert "'pid'" in lines[0]
    assert _gone(a["pid"]) and _gone(b["pid"])
    assert not (run / "a" / "vllm.json").exists() and not (run / "b" / "vllm.json").exists()
    assert stranger.poll() is None and damaged.exists()  # reported, never signalled, nor deleted


@pytest.mark.parametrize("how", list(DAMAGE))
@pytest.mark.parametrize("where", ["router", "default", "instance"])
def test_status_reports_a_damaged_file_and_every_readable_server(cli_here, tmp_path, fleet, where, how):
    a = fleet("a", free_port())
    run = tmp_path / "run"
    damaged = {"router": run / "router.json", "default": run / "vllm.json", "instance": run / "c" / "vllm.json"}[where]
    _damage(damaged, how, a)
    r = cli_here(["status"], state_env(run))
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert any(f"pid {a['pid']}" in ln for ln in r.stdout.splitlines()), r.stdout
    [line] = [ln for ln in r.stdout.splitlines() if str(damaged) in ln]
    assert "damaged" in line
    assert not _gone(a["pid"])


def test_one_reader_names_the_field(tmp_path):
    f = tmp_path / "vllm.json"
    cfg = load_config(None, state_dir=str(tmp_path))
    assert cfg.state_file == f
    f.write_text(json.dumps({"pid": "not a number"}))
    with pytest.raises(DamagedState, match=r"field 'pid'") as e:
        read_record(f, ServerState)
    assert e.value.detail["field"] == "pid" and str(f) in str(e.value) and "\n" not in str(e.value)
    assert read_record(tmp_path / "none.json", ServerState) is None


def test_a_record_naming_another_group_than_its_own_signals_nothing(cli_here, tmp_path, fleet, stranger):
    """A server leads its own group (pgid == pid). A record whose pid is gone but whose pgid names another live
    group (the stranger's) is damaged: stop reports it in one line and the stranger lives."""
    a = fleet("a", free_port())
    run = tmp_path / "run"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run / "vllm.json").write_text(json.dumps({**a, "pid": gone.pid, "pgid": stranger.pid}))
    r = cli_here(["stop", "--grace", "2"], state_env(run))
    assert r.returncode != 0 and "vllm.json is damaged" in r.stderr and "pgid" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not _gone(stranger.pid)


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_front_door_start_refuses_a_damaged_router_record_before_launching_anything(cli_here, tmp_path, monkeypatch,
                                                                                      how):
    """A damaged run/router.json is the one-line refusal at once, not after a build was launched and loaded (the
    router's own write would refuse then): nothing is started, no build record written."""
    from tests.helpers.stand_ins import vllm_server as stand_in_vllm
    from tools.serving.config import ServeConfig

    launched: list[int] = []
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: (
        launched.append(self.port), stand_in_vllm.argv(self.port, self.model))[1])
    run = tmp_path / "run"
    _damage(run / "router.json", how, {"pid": 1, "pgid": 1})
    model = stand_in_vllm.build(tmp_path / "m")
    r = cli_here(["start", "--model", model], state_env(run, PORT=str(free_port()), FRONT_DOOR="1"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]  # after the line that says what starts
    assert f"{run / 'router.json'}" in line and "damaged" in line, line
    assert launched == [] and not any(run.glob("*/vllm.json"))


@pytest.mark.parametrize("command", [["stop"], ["stop", "--all"]])
def test_a_damaged_replace_record_alone_is_said_by_stop(cli_here, tmp_path, command):
    """Only run/replace.json, damaged: status named it (exit 3) while stop and stop --all said "no server
    recorded", exit 0. Each names it in one line, exit 1."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "replace.json").write_text("garbage\n")
    r = cli_here([*command, "--grace", "1"], state_env(run))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert f"{run / 'replace.json'} is damaged" in line, line
