"""The kill matrix for a command that starts a server of its own: `./vllm-t4 decode-sweep`, signalled with SIGINT,
SIGTERM or SIGKILL while its server starts and between two records of its first decode run. The server is a
stand-in process launched where vLLM would be (ServeConfig.vllm_argv, in a small driver that then runs the
command line's main()): it binds the port, answers /health, and, once told it is ready, the readiness completion
and the decode benchmark's streamed chat completions (slowly, so that the test can signal between records).

Every case: no server left (the stand-in's pid is gone), no state file naming it, the next decode-sweep is not
refused. SIGINT and SIGTERM exit 130 / 143 with one last line, no traceback, and nothing in --out (no run had
finished); a SIGKILL leaves the sweep's `.partial` folder, which the next write there sweeps. One real-vLLM case
is tests/measure/test_decode_vllm.py's drafter table; a SIGKILL of the sweep against a stand-in that ignores
SIGTERM is tests/measure/test_decode_owned_server.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.fixtures import ROOT, free_port
from tools.measure import evidence

SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143), "SIGKILL": (signal.SIGKILL, -9)}
PHASES = ["server-starting", "between-records"]

STAND_IN = r"""
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, ready, pids = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
MODELS = json.dumps({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 4096}]})
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, code, body=b"", ctype="application/json"):
        self.send_response(code); self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body))); self.end_headers(); self.wfile.write(body)
    def do_GET(self):
        body = {"/health": "", "/metrics": "", "/v1/models": MODELS, "/version": '{"version": "stand-in"}'}.get(self.path)
        self._send(404 if body is None else 200, (body or "").encode())
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if not ready:
            return self._send(503, b'{"error": "loading"}')
        if self.path == "/v1/completions":
            return self._send(200, json.dumps({"choices": [{"text": "ok"}]}).encode())
        self.send_response(200); self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close"); self.end_headers()
        try:
            for i in range(3):
                time.sleep(0.3)
                chunk = {"choices": [{"delta": {"content": "ab"[i % 2]}, "token_ids": [10 + i]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode()); self.wfile.flush()
            self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n')
            self.wfile.flush()
        except OSError:
            pass
        self.close_connection = True
server = ThreadingHTTPServer(("127.0.0.1", port), H)
server.daemon_threads = True
with open(pids, "a") as f:
    f.write(f"{os.getpid()}\n")
server.serve_forever()
"""

DRIVER = r"""
import sys
from pathlib import Path
from tools.serving.config import ServeConfig
stand_in, ready, pids = sys.argv[1:4]
ServeConfig.vllm_argv = lambda self, platform: [sys.executable, "-c", Path(stand_in).read_text(), str(self.port),
                                                ready, pids]
from tools import cli
raise SystemExit(cli.main(sys.argv[4:]))
"""


def _gone(pid: int, wait_s: float = 20) -> bool:
    try:
        proc = psutil.Process(pid)
        proc.wait(wait_s)
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        return proc.status() == psutil.STATUS_ZOMBIE
    return True


def _records(out: Path) -> list[Path]:
    return list(out.rglob("raw/*.json")) if out.is_dir() else []


def _sweep(tmp_path: Path, ready: bool) -> tuple[subprocess.Popen, Path, Path]:
    (tmp_path / "model").mkdir(exist_ok=True)
    env_file = tmp_path / "test.env"
    env_file.write_text(f"MODEL_NAME={tmp_path / 'model'}\nSERVED_MODEL_NAME=m\nHOST=127.0.0.1\nPORT={free_port()}\n"
                        f"STATE_DIR={tmp_path / 'state'}\nSTART_TIMEOUT_S=120\nMAX_MODEL_LEN=4096\n")
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    pids, out = tmp_path / "pids", tmp_path / "ev"
    out.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "stand_in.py"), "1" if ready else "0",
                             str(pids), "decode-sweep", "--env-file", str(env_file), "--draft-tokens", "0",
                             "--prompts", "4", "--max-tokens", "3", "--out", str(out), "--label", "k"],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    return proc, pids, out


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_decode_sweep_leaves_no_server_and_nothing_the_next_run_keeps(sig, phase, tmp_path):
    proc, pids, out = _sweep(tmp_path, ready=phase == "between-records")
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, f"decode-sweep never reached {phase}"
            servers = [int(p) for p in pids.read_text().split()] if pids.exists() else []
            state = tmp_path / "state" / "vllm.json"
            if servers and state.exists() and (phase == "server-starting" or _records(out)):
                break
            time.sleep(0.02)
        if phase == "server-starting":
            time.sleep(0.5)  # answering /health, refusing the readiness completion
            assert not _records(out)
        proc.send_signal(SIGNALS[sig][0])
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = [p for p in servers if not _gone(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
    assert not left, "the sweep's server outlived the sweep"
    assert proc.returncode == SIGNALS[sig][1], err
    assert "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while (tmp_path / "state" / "vllm.json").exists():  # after a SIGKILL the guard removes it
        assert time.monotonic() < deadline, "the state file of a server that is gone stayed"
        time.sleep(0.1)
    if sig != "SIGKILL":
        assert err.strip().splitlines()[-1] == f"vllm-t4: {'interrupted' if sig == 'SIGINT' else 'terminated'}"
        assert os.listdir(out) == []
    else:
        assert [p.name for p in out.iterdir() if ".partial-" in p.name]  # a SIGKILL runs no clean-up ...
        evidence.write_json(out / "next.json", {"ok": True})  # ... the next write there sweeps it
        assert [p.name for p in out.iterdir() if not p.name.startswith(".lock")] == ["next.json"]
    # The next sweep is not refused (no state file, no server holding the port): it runs to its end.
    again, pids2, _ = _sweep(tmp_path, ready=True)
    err2 = again.communicate(timeout=120)[1]
    for p in (int(x) for x in pids2.read_text().split()[len(servers):]):
        assert _gone(p)
    assert again.returncode == 0, err2
    assert json.loads(next(out.glob("*/summary.json")).read_text())["runs"]


@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_demo_leaves_no_server_and_no_half_written_file(sig, tmp_path):
    """The demo, signalled while its first server starts (after its two real repacks of the tiny model): no
    server left, no state file, and what its evidence folder holds is whole files only."""
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    pids, work, ev = tmp_path / "pids", tmp_path / "work", tmp_path / "evidence"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "stand_in.py"), "0", str(pids), "demo",
                             "--work", str(work), "--evidence", str(ev), "--platform", "cpu"],
                            cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    servers: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not (pids.exists() and (work / "run" / "vllm.json").exists()):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the demo never started its server"
            time.sleep(0.05)
        servers = [int(p) for p in pids.read_text().split()]
        time.sleep(0.5)  # answering /health, refusing the readiness completion
        proc.send_signal(SIGNALS[sig][0])
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        left = [p for p in servers if not _gone(p)]
        for p in left:
            os.kill(p, signal.SIGKILL)
    assert not left, "the demo's server outlived the demo"
    assert proc.returncode == SIGNALS[sig][1], err
    assert "Traceback" not in err, err
    deadline = time.monotonic() + 10
    while list((work / "run").glob("*.json")):
        assert time.monotonic() < deadline, "a state file of a server that is gone stayed"
        time.sleep(0.1)
    if sig != "SIGKILL":
        assert err.strip().splitlines()[-1] == f"vllm-t4: {'interrupted' if sig == 'SIGINT' else 'terminated'}"
    files = [p for p in ev.rglob("*") if p.is_file()]
    assert files and not [p.name for p in files if ".tmp" in p.name or ".partial" in p.name]
    for p in files:
        json.loads(p.read_text())  # whole: each parses
