"""A stand-in vLLM server for `./vllm-t4 fidelity record|check`, in a thread: /v1/models, /tokenize, /detokenize
and /v1/completions with prompt_logprobs, over a bigram "model" whose logits a test can perturb."""

from __future__ import annotations

import json
import math
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import numpy as np

from tests.helpers.stand_ins.measure import serve_in_thread

VOCAB = 64
BOS = 2


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


class StandInVllm:
    """Bytes map to tokens 4 + byte % 60; token t is followed according to a fixed random bigram table."""

    def __init__(self, *, seed=0, noise=0.0, prompt_logprobs=True, max_model_len=256, token_offset=4,
                 root: Path | None = None):
        rng = np.random.default_rng(123)
        self.table = rng.normal(size=(VOCAB, VOCAB)) * 2.5
        if noise:
            self.table = self.table + np.random.default_rng(seed).normal(size=self.table.shape) * noise
        self.prompt_logprobs = prompt_logprobs
        self.max_model_len = max_model_len
        self.token_offset = token_offset
        self.root = root
        self.requests = 0
        self.url = ""  # set while served (inside `with`)
        self._served = ExitStack()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                if self.path == "/v1/models":
                    self._send(200, {"data": [{"id": "stand-in",
                                               "root": str(stand_in.root) if stand_in.root else "stand-in",
                                               "max_model_len": stand_in.max_model_len}]})
                else:
                    self._send(404, {"detail": "Not Found"})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    text = body.get("prompt")
                    if text is None:
                        text = "<chat>" + "".join(m["content"] for m in body["messages"])
                    ids = [stand_in.token_offset + b % 60 for b in text.encode()]
                    if body.get("add_special_tokens"):
                        ids = [BOS] + ids
                    self._send(200, {"tokens": ids, "count": len(ids), "max_model_len": stand_in.max_model_len})
                elif self.path == "/detokenize":
                    self._send(200, {"prompt": "".join(chr(32 + t % 90) for t in body["tokens"])})
                elif self.path == "/v1/completions":
                    stand_in.requests += 1
                    self._send(200, stand_in.complete(body))
                else:
                    self._send(404, {"detail": "Not Found"})

        return Handler

    def complete(self, body):
        ids, k = body["prompt"], body.get("prompt_logprobs")
        choice = {"text": "x", "index": 0}
        if self.prompt_logprobs and k is not None:
            plp = [None]
            for j in range(1, len(ids)):
                lp = log_softmax(self.table[ids[j - 1]]).astype(np.float32).astype(np.float64)
                order = np.argsort(-lp, kind="stable")
                ranks = {int(t): r + 1 for r, t in enumerate(order)}
                entry = {str(int(t)): {"logprob": float(lp[t]), "rank": ranks[int(t)], "decoded_token": "?"}
                         for t in order[:k]}
                entry[str(ids[j])] = {"logprob": float(lp[ids[j]]), "rank": ranks[ids[j]], "decoded_token": "?"}
                plp.append(entry)
            choice["prompt_logprobs"] = plp
        return {"choices": [choice]}

    def __enter__(self):
        self.url = self._served.enter_context(serve_in_thread(self.handler()))
        return self

    def __exit__(self, *a):
        self._served.close()
