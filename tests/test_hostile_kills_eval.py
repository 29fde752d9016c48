"""The kill matrix for `./vllm-t4 eval`: SIGINT, SIGTERM or SIGKILL while lm-eval waits on its first request. A
stand-in server describes itself as vLLM does (/v1/models naming a real tokenizer folder, /version) and holds
every completion request unanswered, so lm-eval is inside its run when the command is signalled. Every case:
lm-eval (the command's child, under tools.measure.parent_watch) ends with the command; SIGINT and SIGTERM exit
130 / 143 with one last line, no traceback and nothing in --out; a SIGKILL leaves the run's temporary folder,
which the next write there, of any command, sweeps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest

from tests.fixtures import ROOT
from tools.measure import evidence

SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143), "SIGKILL": (signal.SIGKILL, -9)}


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """(base URL, a list that receives each completion request as it arrives)."""
    from repack.tiny_model import _write_tokenizer

    tok = tmp_path_factory.mktemp("tokenizer")
    _write_tokenizer(tok)
    models = json.dumps({"data": [{"id": "stub", "root": str(tok), "max_model_len": 512}]}).encode()
    arrived: list[str] = []
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            data = models if self.path == "/v1/models" else b'{"version": "stand-in"}'
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):  # noqa: N802
            arrived.append(self.path)
            release.wait(120)  # held: lm-eval waits inside its run

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", arrived
    release.set()
    srv.shutdown()
    srv.server_close()


def _lm_eval(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [c for c in proc.children(recursive=True) if "lm_eval" in " ".join(c.cmdline())]
    except psutil.Error:
        return []


@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_eval_ends_lm_eval_and_leaves_nothing_the_next_write_keeps(sig, held, tmp_path):
    base_url, arrived = held
    out = tmp_path / "ev"
    out.mkdir()
    n0 = len(arrived)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf"))
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "eval", "--tasks", "tiny_pattern_mc", "--base-url",
                             base_url, "--out", str(out), "--limit", "4"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while len(arrived) == n0:  # lm-eval is up and has sent its first request
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "lm-eval never sent a request"
            time.sleep(0.05)
        children = _lm_eval(psutil.Process(proc.pid))
        assert children
        proc.send_signal(SIGNALS[sig][0])
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _, alive = psutil.wait_procs(children, timeout=20)
    for c in alive:
        c.kill()
    assert not alive, "lm-eval outlived the eval command"
    assert proc.returncode == SIGNALS[sig][1], err
    assert "Traceback" not in err, err
    if sig != "SIGKILL":
        assert err.strip().splitlines()[-1] == f"vllm-t4: {'interrupted' if sig == 'SIGINT' else 'terminated'}"
        assert os.listdir(out) == []
    else:
        assert [p.name for p in out.iterdir() if ".partial" in p.name]  # a SIGKILL runs no clean-up ...
        evidence.write_json(out / "next.json", {"ok": True})  # ... the next write there sweeps it
        assert os.listdir(out) == ["next.json"]
