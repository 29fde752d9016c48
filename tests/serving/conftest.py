"""Fixtures of the serving tests: a command line run in this process, and fake running instances."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest


@pytest.fixture
def cli_here(capsys, monkeypatch):
    """run(args, env): the command through tools.cli.main in this process, as a CompletedProcess (./vllm-t4 exits
    with main's return value; the script itself runs in the ../x, port-clash and router-lifecycle tests)."""
    from tools.cli import main

    def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        for k, v in env.items():
            if os.environ.get(k) != v:
                monkeypatch.setenv(k, v)
        capsys.readouterr()
        try:
            rc = main(args)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out, err)

    return run


# A stand-in for a vLLM server, for the router's process handling: /health, /v1/models, /v1/completions and the
# /metrics counter a sweep's per-backend counts are read from.
FAKE_WORKER = r"""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
done = [0]
class H(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def send(self, code, body, ctype="application/json"):
        data = body.encode()
        self.send_response(code); self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)
    def do_GET(self):
        if self.path == "/health": self.send(200, "")
        elif self.path == "/v1/models": self.send(200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "root": "m", "max_model_len": 512}]}))
        elif self.path == "/metrics": self.send(200, 'vllm:request_success_total{finished_reason="length",model_name="m"} %d.0\n' % done[0], "text/plain")
        else: self.send(404, "{}")
    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0); self.rfile.read(n); done[0] += 1
        self.send(200, json.dumps({"id": "x", "object": "text_completion", "model": "m", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}))
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture()
def fleet(tmp_path):
    """Fake running instances: make(name, port, platform, **state) starts a `sleep` in its own session and
    writes its state file; everything is killed at the end."""
    procs: list[subprocess.Popen] = []

    def make(name: str, port: int, platform: str = "cpu", serve: bool = False, **state):
        argv = [sys.executable, "-c", FAKE_WORKER, str(port)] if serve else ["sleep", "300"]
        p = subprocess.Popen(argv, start_new_session=True)
        procs.append(p)
        d = tmp_path / "run" / name if name != "default" else tmp_path / "run"
        d.mkdir(parents=True, exist_ok=True)
        st = dict(pid=p.pid, pgid=p.pid, create_time=psutil.Process(p.pid).create_time(), host="127.0.0.1",
                  port=port, base_url=f"http://127.0.0.1:{port}", model="m", served_name="m", argv=["x"],
                  platform=platform, started_at="2026-01-01T00:00:00+00:00", started_ts=time.time(),
                  log_path=str(d / "vllm.log"), instance="" if name == "default" else name, **state)
        (d / "vllm.json").write_text(json.dumps(st))
        return st

    yield make
    for p in procs:
        p.kill()
        p.wait()
