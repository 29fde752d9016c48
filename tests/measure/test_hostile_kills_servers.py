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
import subprocess
import time
from pathlib import Path

import pytest

from tests.fixtures import free_port
from tests.kill_matrix import SIGNALS, all_gone, assert_ended, assert_swept_by_the_next_write, cli, signal_when

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
    proc = cli(["decode-sweep", "--env-file", str(env_file), "--draft-tokens", "0", "--prompts", "4", "--max-tokens",
                "3", "--out", str(out), "--label", "k"],
               driver=["-c", DRIVER, str(tmp_path / "stand_in.py"), "1" if ready else "0", str(pids)])
    return proc, pids, out


def _servers(pids: Path) -> list[int]:
    return [int(p) for p in pids.read_text().split()] if pids.exists() else []


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
    assert all_gone([int(x) for x in pids2.read_text().split()[len(servers):]])
    assert again.returncode == 0, err2
    assert json.loads(next(out.glob("*/summary.json")).read_text())["runs"]


@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_demo_leaves_no_server_and_no_half_written_file(sig, tmp_path):
    """The demo, signalled while its first server starts (after its two real repacks of the tiny model): no
    server left, no state file, and what its evidence folder holds is whole files only."""
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    pids, work, ev = tmp_path / "pids", tmp_path / "work", tmp_path / "evidence"
    proc = cli(["demo", "--work", str(work), "--evidence", str(ev), "--platform", "cpu"],
               driver=["-c", DRIVER, str(tmp_path / "stand_in.py"), "0", str(pids)])
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
