"""The kill matrix for a command that writes evidence: `./vllm-t4 decode` against a stand-in server (lists a
model, serves /metrics, streams a short answer slowly) gets SIGINT, SIGTERM or SIGKILL while its run folder is
being filled: before its first record (the untimed first request) and between records. SIGINT and SIGTERM end it
with 130 / 143, one line after its progress lines, no traceback and nothing left in --out; SIGKILL leaves its `.partial` folder, which the
next run there sweeps. The stand-in stands for vLLM: the lifecycle under test (the run folder, the signals) is the
command's own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.fixtures import ROOT
from tools.measure import evidence


class _Streaming(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        body = {"/v1/models": json.dumps({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 4096}]}),
                "/metrics": "", "/version": json.dumps({"version": "stand-in"})}.get(self.path)
        data = (body or "").encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["content-length"])))
        first = req["messages"][0]["content"] == "Hello."  # the untimed first request: slow, a wide phase
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        for i in range(3):
            time.sleep(0.4 if first else 0.15)
            chunk = {"choices": [{"delta": {"content": "ab"[i % 2]}, "token_ids": [10 + i]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n')
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Streaming)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _partial(out: Path) -> Path | None:
    found = [p for p in out.iterdir() if ".partial-" in p.name and p.is_dir()] if out.is_dir() else []
    return found[0] if found else None


def _reached(out: Path, phase: str) -> bool:
    part = _partial(out)
    if part is None or not (part / "provenance.json").exists():
        return False
    records = list((part / "raw").glob("*.json")) if (part / "raw").is_dir() else []
    return not records if phase == "before-first-record" else len(records) >= 1


PHASES = ["before-first-record", "between-records"]
SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143), "SIGKILL": (signal.SIGKILL, -9)}


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", list(SIGNALS))
def test_decode_killed_at_each_phase_leaves_nothing_the_next_write_keeps(sig, phase, server, tmp_path):
    out = tmp_path / "ev"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "decode", "--base-url", server, "--out", str(out),
                             "--prompts", "4", "--max-tokens", "3"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + 60
        while not _reached(out, phase):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, f"decode never reached {phase}"
            time.sleep(0.02)
        signum, status = SIGNALS[sig]
        proc.send_signal(signum)
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == status, err
    assert "Traceback" not in err, err
    if sig != "SIGKILL":
        last = err.strip().splitlines()[-1]  # after the progress lines: one line saying how it ended
        assert last == f"vllm-t4: {'interrupted' if sig == 'SIGINT' else 'terminated'}", err
        assert os.listdir(out) == []
    else:
        assert _partial(out) is not None  # a SIGKILL runs no clean-up ...
        evidence.write_json(out / "next.json", {"ok": True})  # ... the next write there sweeps it
        assert os.listdir(out) == ["next.json"]
