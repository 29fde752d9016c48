"""The kill matrix for a command that starts a server of its own: `./vllm-t4 decode-sweep`, signalled with SIGINT,
SIGTERM or SIGKILL while its server starts and between two records of its first decode run. The server is
tests/helpers/stand_ins/vllm_server.py launched where vLLM would be (ServeConfig.vllm_argv, by its driver that then runs the
command line's main()): it binds the port, answers /health, and, once told it is ready, the readiness completion
and the decode benchmark's streamed chat completions (slowly, so that the test can signal between records).

Every case: no server left (the stand-in's pid is gone), no state file naming it, the next decode-sweep is not
refused. SIGINT and SIGTERM exit 130 / 143 with one last line, no traceback, and nothing in --out (no run had
finished); a SIGKILL leaves the sweep's `.partial` folder, which the next write there sweeps. One real-vLLM case
is tests/measure/decode/test_decode_vllm.py's drafter table; a SIGKILL of the sweep against a stand-in that ignores
SIGTERM is tests/measure/decode/test_decode_owned_server.py's."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, free_port
from tests.helpers.kill_matrix import SIGNALS, all_gone, assert_ended, assert_swept_by_the_next_write, cli, signal_when

PHASES = ["server-starting", "between-records"]

DRIVER = stand_in_vllm.cli_argv()[1:]  # after the interpreter: the stand-in's `./vllm-t4` driver


def _stand_in_env(starts: Path, ready: bool) -> dict[str, str]:
    """The command's environment: its stand-in logs each start to `starts` and, until `ready`, answers /health
    and refuses every request as loading (the behaviour is the environment's: the demo makes its builds itself)."""
    behaviour = {"decode": True, "answer": "ok", **({} if ready else {"mode": "loading"})}
    return dict(os.environ, PYTHONPATH=str(ROOT), VLLM_STAND_IN_LOG=str(starts),
                VLLM_STAND_IN_BEHAVIOUR=json.dumps(behaviour))


def _records(out: Path) -> list[Path]:
    return list(out.rglob("raw/*.json")) if out.is_dir() else []


def _sweep(tmp_path: Path, ready: bool) -> tuple[subprocess.Popen, Path, Path]:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    env_file = tmp_path / "test.env"
    env_file.write_text(f"MODEL_NAME={tmp_path / 'model'}\nSERVED_MODEL_NAME=m\nHOST=127.0.0.1\nPORT={free_port()}\n"
                        f"STATE_DIR={tmp_path / 'state'}\nSTART_TIMEOUT_S=120\nMAX_MODEL_LEN=4096\n")
    pids, out = tmp_path / "starts.jsonl", tmp_path / "ev"
    out.mkdir(exist_ok=True)
    proc = cli(["decode-sweep", "--env-file", str(env_file), "--draft-tokens", "0", "--prompts", "4", "--max-tokens",
                "3", "--out", str(out), "--label", "k"], _stand_in_env(pids, ready), driver=DRIVER)
    return proc, pids, out


def _servers(pids: Path) -> list[int]:
    return [json.loads(ln)["pid"] for ln in pids.read_text().splitlines()] if pids.exists() else []


def _state_files_go(folder: Path) -> None:
    deadline = time.monotonic() + 10
    while list(folder.glob("*.json")):  # after a SIGKILL the guard removes them
        assert time.monotonic() < deadline, "the state file of a server that is gone stayed"
        time.sleep(0.1)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_decode_sweep_leaves_no_server_and_nothing_the_next_run_keeps(sig, phase, tmp_path):
    proc, pids, out = _sweep(tmp_path, ready=phase == "between-records")
    state = tmp_path / "state" / "vllm.json"

    def settle() -> None:
        if phase == "server-starting":
            time.sleep(0.5)  # answering /health, refusing the readiness completion
            assert not _records(out)

    try:
        err = signal_when(proc, lambda: bool(_servers(pids)) and state.exists()
                          and (phase == "server-starting" or bool(_records(out))), sig, phase, settle=settle)
    finally:
        servers = _servers(pids)
        assert all_gone(servers), "the sweep's server outlived the sweep"
    assert_ended(sig, proc.returncode, err)
    _state_files_go(state.parent)
    if sig != "SIGKILL":
        assert os.listdir(out) == []
    else:
        assert_swept_by_the_next_write(out)
    # The next sweep is not refused (no state file, no server holding the port): it runs to its end.
    again, pids2, _ = _sweep(tmp_path, ready=True)
    err2 = again.communicate(timeout=120)[1]
    assert all_gone(_servers(pids2)[len(servers):])
    assert again.returncode == 0, err2
    assert json.loads(next(out.glob("*/summary.json")).read_text())["runs"]


@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_demo_leaves_no_server_and_no_half_written_file(sig, tmp_path):
    """The demo, signalled while its first server starts (after its two real repacks of the tiny model): no
    server left, no state file, and what its evidence folder holds is whole files only."""
    pids, work, ev = tmp_path / "starts.jsonl", tmp_path / "work", tmp_path / "evidence"
    proc = cli(["demo", "--work", str(work), "--evidence", str(ev), "--platform", "cpu"], _stand_in_env(pids, False),
               driver=DRIVER)
    try:
        err = signal_when(proc, lambda: bool(_servers(pids)) and (work / "run" / "vllm.json").exists(), sig,
                          "its server's start", timeout_s=300, settle=lambda: time.sleep(0.5))
    finally:
        assert all_gone(_servers(pids)), "the demo's server outlived the demo"
    assert_ended(sig, proc.returncode, err)
    _state_files_go(work / "run")
    files = [p for p in ev.rglob("*") if p.is_file()]
    assert files and not [p.name for p in files if ".tmp" in p.name or ".partial" in p.name]
    for p in files:
        json.loads(p.read_text())  # whole: each parses
