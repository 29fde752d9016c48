"""A stand-in for `vllm serve`, run as `python stand_in_vllm.py PORT MODEL`: prints the line every vLLM start
prints (the fd-limit warning), then does what MODEL/behaviour.json says ({"mode": ...}, default "serve"):

  serve        /health 200, completions and chat answer, naming the build
  exit         prints vLLM's kind of error and exits 1 (a build vLLM refuses to load)
  hang         never listens (a server that says nothing)
  refuse       /health 200, every completion refused with vLLM's HTTP 400 for a too-short max_model_len
  refuse_chat  completions answer, chat completions are refused (HTTP 400) as above
  load_s       (a number, with any mode that serves) seconds to wait before listening: a slow load

Used through `argv(port, model)` as ServeConfig.vllm_argv in the tests."""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ULIMIT_LINE = ("WARNING 12-05 10:00:01 [system_utils.py:256] Found ulimit of 20000 and failed to automatically "
               "increase with error current limit exceeds maximum limit. This can cause fd limit errors like "
               "`OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n")
CONTEXT_REFUSAL = {"error": {"message": "This model's maximum context length is 16 tokens. However, your prompt "
                                        "contains 45 input tokens, which exceeds this limit even without any output "
                                        "tokens. Please reduce the length of the input prompt.",
                             "type": "BadRequestError", "param": "input_tokens", "code": 400}}


def argv(port: int, model: str) -> list[str]:
    return [sys.executable, __file__, str(port), model]


def main() -> None:
    port, model = int(sys.argv[1]), Path(sys.argv[2])
    b = model / "behaviour.json"
    spec = json.loads(b.read_text()) if b.is_file() else {}
    mode = spec.get("mode", "serve")
    print(ULIMIT_LINE, flush=True)
    print("Starting to load model", model, flush=True)
    if mode == "exit":
        print("ValueError: the stand-in refuses this build", flush=True)
        sys.exit(1)
    if mode == "hang":
        time.sleep(600)
    time.sleep(float(spec.get("load_s", 0)))

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def send(self, code: int, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                self.send(200, json.dumps({"object": "list", "data": [{"id": model.name, "object": "model"}]}))
                return
            self.send(200 if self.path == "/health" else 404, "")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            chat = self.path.endswith("/chat/completions")
            if mode == "refuse" or (mode == "refuse_chat" and chat):
                self.send(400, json.dumps(CONTEXT_REFUSAL))
                return
            choice = ({"message": {"role": "assistant", "content": model.name}} if chat else {"text": model.name})
            self.send(200, json.dumps({"model": model.name, "choices": [{"index": 0, **choice,
                                                                          "finish_reason": "length"}]}))

    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()


if __name__ == "__main__":
    main()
