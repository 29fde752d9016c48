"""decode-sweep's server is the sweep's own: a SIGKILL of the sweep while that server starts ends it (a stand-in
that binds the port, answers /health, never becomes ready and ignores SIGTERM, instead of vLLM), removes its state
file, and the next sweep is not refused; its leftover .partial folder is removed by that next sweep. The stand-in is
tests/helpers/stand_ins/vllm_server.py (mode "loading", SIGTERM ignored), the sweep `./vllm-t4 decode-sweep` through its
driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, free_port, launched


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _answers_health(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _sweep_then_kill(tmp_path: Path, port: int) -> tuple[int, subprocess.Popen]:
    """Starts a sweep; once its stand-in server answers /health, SIGKILLs the sweep. Returns the server's pid."""
    starts = tmp_path / "starts.jsonl"

    def servers() -> list[int]:
        return [json.loads(ln)["pid"] for ln in starts.read_text().splitlines()] if starts.exists() else []

    before = servers()
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "behaviour.json").write_text(json.dumps({"mode": "loading", "ignore_term": True}))
    sweep = subprocess.Popen(stand_in_vllm.cli_argv("decode-sweep", "--draft-tokens", "0", "--out",
                                                    str(tmp_path / "ev"), "--label", "owned"),
                             cwd=ROOT, stderr=subprocess.PIPE,
                             env=dict(os.environ, PYTHONPATH=str(ROOT), VLLM_STAND_IN_LOG=str(starts),
                                      MODEL_NAME=str(tmp_path / "model"), STATE_DIR=str(tmp_path / "state"),
                                      HOST="127.0.0.1", PORT=str(port), START_TIMEOUT_S="300"))
    deadline = time.monotonic() + 120
    while not (len(servers()) > len(before) and (tmp_path / "state" / "vllm.json").exists()
               and _answers_health(port)):
        assert sweep.poll() is None, sweep.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server = servers()[-1]
    assert json.loads((tmp_path / "state" / "vllm.json").read_text())["pid"] == server
    time.sleep(0.5)  # starting: answering /health, not ready
    assert sweep.poll() is None
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    return server, sweep


def test_a_killed_decode_sweep_leaves_no_server_and_the_next_is_not_refused(tmp_path):
    port = free_port()
    servers = []
    try:
        first, _ = _sweep_then_kill(tmp_path, port)
        servers.append(first)
        deadline = time.monotonic() + 15
        while not _gone(first):
            assert time.monotonic() < deadline, "the sweep's server outlived the sweep"
            time.sleep(0.1)
        deadline = time.monotonic() + 5
        while (tmp_path / "state" / "vllm.json").exists():
            assert time.monotonic() < deadline, "the dead sweep's state file stayed"
            time.sleep(0.1)
        left = {p.name for p in (tmp_path / "ev").iterdir()}
        assert left and all(".partial-" in n or ".lock-" in n for n in left)  # what the kill left
        second, sweep = _sweep_then_kill(tmp_path, port)  # started: not refused
        servers.append(second)
        assert second != first
        assert not left & {p.name for p in (tmp_path / "ev").iterdir()}  # removed by the next sweep
        deadline = time.monotonic() + 15
        while not _gone(second):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        for pid in servers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


OWNER = r"""
import sys, time
from tools.serving.server.guard import owned_server
with owned_server(sys.argv[1]):
    print("guarded", flush=True)
    time.sleep(600)
"""


def test_the_guard_never_ends_a_server_its_command_did_not_start(tmp_path):
    """A server recorded in the state file that another command started (`start` leaves it serving on purpose)
    outlives a guarded command killed with SIGKILL."""
    other, token = launched(["sleep", "300"])
    try:
        state = tmp_path / "vllm.json"
        state.write_text(json.dumps(dict(
            pid=other.pid, pgid=other.pid, create_time=psutil.Process(other.pid).create_time(), launch=token,
            host="127.0.0.1",
            port=1, base_url="http://127.0.0.1:1", model="m", served_name="m", argv=["x"], platform="cpu",
            started_at="2026-01-01T00:00:00+00:00", started_ts=time.time(), log_path=str(tmp_path / "log"))))
        owner = subprocess.Popen([sys.executable, "-c", OWNER, str(state)], cwd=ROOT, stdout=subprocess.PIPE,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert owner.stdout.readline() == b"guarded\n"
        time.sleep(0.5)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        time.sleep(1.0)
        assert other.poll() is None and state.exists()
    finally:
        other.kill()
        other.wait()
