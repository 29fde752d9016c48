"""decode-sweep's server is the sweep's own: a SIGKILL of the sweep while that server starts ends it (a stand-in
that binds the port, answers /health, never becomes ready and ignores SIGTERM, instead of vLLM), removes its state
file, and the next sweep is not refused; its leftover .partial folder is removed by that next sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.fixtures import ROOT, free_port

STAND_IN = r"""
import os, signal, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
signal.signal(signal.SIGTERM, signal.SIG_IGN)
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.send_header("Content-Length", "0")
        self.end_headers()
    def do_POST(self):
        self.send_response(503); self.send_header("Content-Length", "0"); self.end_headers()
server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H)
with open(sys.argv[2], "a") as f:
    f.write(f"{os.getpid()}\n")
server.serve_forever()
"""

DRIVER = r"""
import sys
from pathlib import Path
from tools.serving.config import ServeConfig
stand_in, pids, model, state, port, out = sys.argv[1:]
ServeConfig.vllm_argv = lambda self, platform: [sys.executable, "-c", Path(stand_in).read_text(), port, pids]
from tools.measure.decode.sweep import DecodeSweepParams, run_decode_sweep
run_decode_sweep(DecodeSweepParams(draft_tokens=[0], out=Path(out), label="owned"), model=model, state_dir=state,
                 host="127.0.0.1", port=int(port), start_timeout_s=300.0)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _sweep_then_kill(tmp_path: Path, port: int) -> tuple[int, subprocess.Popen]:
    """Starts a sweep; once its stand-in server answers /health, SIGKILLs the sweep. Returns the server's pid."""
    pids = tmp_path / "pids"
    before = pids.read_text().split() if pids.exists() else []
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    sweep = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "stand_in.py"), str(pids),
                              str(tmp_path / "model"), str(tmp_path / "state"), str(port), str(tmp_path / "ev")],
                             cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (pids.exists() and len(pids.read_text().split()) > len(before)):
        assert sweep.poll() is None, sweep.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    server = int(pids.read_text().split()[-1])
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
from tools.serving.server_guard import owned_server
with owned_server(sys.argv[1]):
    print("guarded", flush=True)
    time.sleep(600)
"""


def test_the_guard_never_ends_a_server_its_command_did_not_start(tmp_path):
    """A server recorded in the state file that another command started (`start` leaves it serving on purpose)
    outlives a guarded command killed with SIGKILL."""
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        state = tmp_path / "vllm.json"
        state.write_text(json.dumps(dict(
            pid=other.pid, pgid=other.pid, create_time=psutil.Process(other.pid).create_time(), host="127.0.0.1",
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
