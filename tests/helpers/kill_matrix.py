"""What every kill-matrix test shares: the three signals and the exit status each must give, a stand-in HTTP
server in a thread (and the stand-in servers the matrices and the concurrent-runs test run commands against),
running a command until a phase and signalling it there, how a command signalled with SIGINT or SIGTERM must end,
and whether the processes it owned ended with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable, Iterator

import psutil

from tests.helpers.fixtures import ROOT, default_signals
from tools.measure import evidence

SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143), "SIGKILL": (signal.SIGKILL, -9)}


@contextmanager
def serve_in_thread(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` serving on a free port of 127.0.0.1 for the block; yields its base URL."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


# The stand-in servers of the kill matrices, shared with the concurrent-runs test (tests/measure/): each stands for
# what one family of commands asks of vLLM.


class DecodeStandIn(BaseHTTPRequestHandler):
    """`./vllm-t4 decode`'s server: lists a model, serves /metrics, streams a short answer slowly (the untimed
    first request more slowly still, a wide phase to signal in)."""
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


class MeasureStandIn(BaseHTTPRequestHandler):
    """What `./vllm-t4 sweep` and `capacity` ask the server itself (/v1/models, /metrics, /version, /health);
    their benchmark calls go to tests/helpers/stand_ins/bench.py."""
    protocol_version = "HTTP/1.1"

    def do_GET(self):  # noqa: N802
        body = {"/v1/models": json.dumps({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 4096}]}),
                "/metrics": "", "/health": "", "/version": json.dumps({"version": "stand-in"})}.get(self.path)
        data = (body or "").encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


WRITER_SLOW_S = 0.25  # each generation / scored window: the phase the writer tests signal in


class WriterStandIn(BaseHTTPRequestHandler):
    """`./vllm-t4 compare record` and `fidelity record`'s server: /v1/models, /tokenize, /detokenize, chat
    completions with token ids and logprobs, completions with prompt_logprobs, each generation slowly; subclass
    it with a Counter of its own as `counts` ("started /path", "answered /path")."""
    protocol_version = "HTTP/1.1"
    counts: Counter  # set per server: "started /path", "answered /path"

    def log_message(self, *a):
        pass

    def _send(self, obj, code=200):
        data = json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client was killed while this answer slept
            pass

    def do_GET(self):  # noqa: N802
        if self.path == "/v1/models":
            self._send({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 4096}]})
        else:
            self._send({"detail": "Not Found"}, 404)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.counts[f"started {self.path}"] += 1
        if self.path == "/tokenize":
            text = body.get("prompt")
            if text is None:
                text = "<chat>" + "".join(m["content"] for m in body["messages"])
            ids = ([2] if body.get("add_special_tokens") else []) + [4 + b % 60 for b in text.encode()]
            answer = {"tokens": ids, "count": len(ids)}
        elif self.path == "/detokenize":
            answer = {"prompt": "x" * len(body["tokens"])}
        elif self.path == "/v1/completions":  # fidelity: prompt logprobs, the actual token ranked first
            time.sleep(WRITER_SLOW_S)
            ids = body["prompt"]
            plp = [None] + [{str(t): {"logprob": -0.5, "rank": 1}, str(t + 1): {"logprob": -1.5, "rank": 2}}
                            for t in ids[1:]]
            answer = {"choices": [{"text": "x", "index": 0, "prompt_logprobs": plp}]}
        elif self.path == "/v1/chat/completions":  # compare record: token ids and top logprobs as ids
            time.sleep(WRITER_SLOW_S)
            n = body["max_tokens"]
            tops = [{"top_logprobs": [{"token": f"token_id:{10 + i}", "logprob": -0.1},
                                      {"token": f"token_id:{20 + i}", "logprob": -2.0}]} for i in range(n)]
            answer = {"choices": [{"message": {"content": "ab"[:n]}, "token_ids": [10 + i for i in range(n)],
                                   "finish_reason": "length", "logprobs": {"content": tops}}],
                      "usage": {"prompt_tokens": 7}}
        else:
            answer = None
        self.counts[f"answered {self.path}"] += 1  # before the answer: a count of 0 means none has left yet
        self._send(answer if answer is not None else {"detail": "Not Found"}, 200 if answer is not None else 404)


def all_gone(pids: list[int], wait_s: float = 20) -> bool:
    """Whether every process in `pids` ended (a zombie counts) within `wait_s`; those still running are killed, so
    that a failing test leaves none."""
    left = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.wait(wait_s)
        except psutil.NoSuchProcess:
            continue
        except psutil.TimeoutExpired:
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
                proc.kill()
    return not left


def cli(argv: list[str], env: dict[str, str] | None = None, *, driver: list[str] | None = None) -> subprocess.Popen:
    """`./vllm-t4 ARGV` started (or `python -c DRIVER... ARGV`), stderr captured as text."""
    head = driver or ["-m", "tools.cli"]
    return subprocess.Popen([sys.executable, *head, *argv], cwd=ROOT,
                            env=env or dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)


def signal_when(proc: subprocess.Popen, reached: Callable[[], bool], sig: str, what: str, *,
                timeout_s: float = 90, settle: Callable[[], None] | None = None) -> str:
    """Waits until `reached()` (the command still running), calls `settle`, sends `sig`; returns the command's
    stderr once it has ended. The command is killed if the test fails first."""
    try:
        deadline = time.monotonic() + timeout_s
        while not reached():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, f"the command never reached {what}"
            time.sleep(0.02)
        if settle is not None:
            settle()
        proc.send_signal(SIGNALS[sig][0])
        return proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_ended(sig: str, rc: int, err: str) -> None:
    """The exit status of `sig`, no traceback, and after SIGINT or SIGTERM one last line saying how it ended."""
    assert rc == SIGNALS[sig][1], err
    assert "Traceback" not in err, err
    if sig != "SIGKILL":
        last = err.strip().splitlines()[-1]  # after the progress lines
        assert last == f"vllm-t4: {'interrupted' if sig == 'SIGINT' else 'terminated'}", err


def assert_swept_by_the_next_write(out: Path) -> None:
    """A SIGKILL runs no clean-up: its `.partial` folder is in `out`, and the next write there sweeps it."""
    assert [p.name for p in out.iterdir() if ".partial" in p.name]
    evidence.write_json(out / "next.json", {"ok": True})
    assert os.listdir(out) == ["next.json"]
