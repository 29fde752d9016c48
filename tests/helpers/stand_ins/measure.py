"""Stand-in HTTP servers in a thread for the measuring commands: each answers what one family of commands asks
of vLLM (decode; sweep and capacity; compare record and fidelity record; the sweep's prefix-cache counters; the
token check's greedy chat; lm-eval's view of a server), a server too slow to answer a chat, one whose model list is
whatever body it is given, and one that checks the bearer key of every request. A handler that needs a test's
state is made by a function taking it."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

from repack.stand_ins.tiny_model import _write_tokenizer


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


# The stand-in servers of the kill matrices and the concurrent-runs test (tests/measure/): each stands for what
# one family of commands asks of vLLM.


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
    completions with token ids and logprobs, completions with prompt_logprobs, each generation slowly; made with
    a Counter of its own by writer_stand_in."""
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


def writer_stand_in(counts: Counter) -> type[WriterStandIn]:
    """WriterStandIn counting into `counts`: "started /path", "answered /path"."""
    return type("Writer", (WriterStandIn,), {"counts": counts})


class SlowChatStandIn(BaseHTTPRequestHandler):
    """Lists a model, answers every GET, and answers a chat request only after a second."""

    def do_GET(self):  # noqa: N802
        body = json.dumps({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 64}]}).encode() \
            if self.path == "/v1/models" else b""
        self.send_response(200 if self.path in ("/v1/models", "/metrics") else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        time.sleep(1.0)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


class ModelsBodyStandIn(BaseHTTPRequestHandler):
    """Answers every GET with `body` (made by models_body_stand_in with the body a test wants: a model list of the
    wrong shape)."""
    body = b"[]"

    def do_GET(self):  # noqa: N802
        self.send_response(200)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


def models_body_stand_in(body: bytes) -> type[ModelsBodyStandIn]:
    """ModelsBodyStandIn answering every GET with `body`."""
    return type("ModelsBody", (ModelsBodyStandIn,), {"body": body})


def _send(handler: BaseHTTPRequestHandler, code: int, data: bytes, content_type: str | None = None) -> None:
    handler.send_response(code)
    if content_type:
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def prefix_cache_stand_in(state: dict) -> type[BaseHTTPRequestHandler]:
    """The server's /metrics for the sweep: prefix-cache counters that GET /add?N raises by N queries (and N//4
    hits); `state` holds them ("queries", "hits") and counts the /metrics reads ("reads")."""

    class PrefixCache(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            if self.path.startswith("/add?"):
                n = int(self.path.split("?", 1)[1])
                state["queries"] += n
                state["hits"] += n // 4
                body = b"ok"
            elif self.path == "/metrics":
                state["reads"] += 1
                body = (f'vllm:prefix_cache_queries_total{{engine="0"}} {state["queries"]}.0\n'
                        f'vllm:prefix_cache_hits_total{{engine="0"}} {state["hits"]}.0\n').encode()
            else:
                self.send_error(404)
                return
            _send(self, 200, body)

        def log_message(self, *args):
            pass

    return PrefixCache


def lm_eval_stand_in(folder: Path, arrived: list[str] | None = None,
                     release: threading.Event | None = None) -> type[BaseHTTPRequestHandler]:
    """A server that describes itself to lm-eval as vLLM does: /v1/models names a tokenizer this writes into
    `folder`, /version answers. With `release`, each completion request is appended to `arrived` and held
    unanswered until `release` is set (lm-eval waits inside its run); without, one is refused (HTTP 501)."""
    _write_tokenizer(folder)
    models = json.dumps({"data": [{"id": "stub", "root": str(folder), "max_model_len": 512}]}).encode()

    class LmEval(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            _send(self, 200, models if self.path == "/v1/models" else b'{"version": "stand-in"}', "application/json")

        def do_POST(self):  # noqa: N802
            if release is None:
                self.send_error(501)
                return
            if arrived is not None:
                arrived.append(self.path)
            release.wait(120)

        def log_message(self, *a):
            pass

    return LmEval


def greedy_chat_stand_in(diverge_on: str | None = None) -> type[BaseHTTPRequestHandler]:
    """An OpenAI-style server answering greedy chat completions with token ids and top logprobs (a model list of
    max_model_len 32768 on GET); given `diverge_on`, its answer to that prompt differs at token 3, by a near-tie."""

    class GreedyChat(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, obj):
            _send(self, 200, json.dumps(obj).encode(), "application/json")

        def do_GET(self):  # noqa: N802
            self._send({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 32768}]})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            n = body["max_tokens"]
            prompt = body["messages"][0]["content"]
            ids = [10 + i for i in range(n)]
            if diverge_on is not None and prompt == diverge_on:
                ids[3] = 20 + 3
            tops = [{"top_logprobs": [{"token": f"token_id:{10 + i}", "logprob": -0.1},
                                      {"token": f"token_id:{20 + i}", "logprob": -0.15}]} for i in range(n)]
            self._send({"choices": [{"message": {"content": "x" * n}, "token_ids": ids, "finish_reason": "length",
                                     "logprobs": {"content": tops}}],
                        "usage": {"prompt_tokens": len(prompt) // 4}})

    return GreedyChat


def keyed_stand_in(key: str, seen: list[str | None]) -> type[BaseHTTPRequestHandler]:
    """A server that answers only the bearer key `key` (HTTP 401 otherwise) and appends every request's
    Authorization header to `seen`: a model list on /v1/models, a one-token chat answer with logprobs to a POST."""
    models = json.dumps({"data": [{"id": "m", "root": "/m", "max_model_len": 64}]})

    class Keyed(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body: str) -> None:
            seen.append(self.headers.get("Authorization"))
            _send(self, 200 if self.headers.get("Authorization") == f"Bearer {key}" else 401, body.encode())

        def do_GET(self):  # noqa: N802
            self._send(models if self.path == "/v1/models" else "")

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(json.dumps({"choices": [{"message": {"content": "ok"}, "finish_reason": "stop",
                                                "logprobs": {"content": []}, "token_ids": [1]}],
                                   "usage": {"completion_tokens": 1}}))

    return Keyed
