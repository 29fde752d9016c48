"""A stand-in for `vllm serve`, so that the serving lifecycle runs in seconds without vLLM.

As a server, `python stand_in_vllm.py PORT MODEL` (`argv(port, model)`, used as ServeConfig.vllm_argv): prints
the line every vLLM start prints (the fd-limit warning), then does what MODEL/behaviour.json says, each key
optional:

  mode     "serve" (default): /health 200, /v1/models lists the build, completions and chat answer
           "exit": prints vLLM's kind of error and exits 1 (a build vLLM refuses to load)
           "hang": never listens (a server that says nothing)
           "refuse": /health 200, every completion refused with vLLM's HTTP 400 for a too-short max_model_len
           "refuse_chat": completions answer, chat completions are refused (HTTP 400) as above
           "loading": /health 200, every POST answered HTTP 503 (a server that never becomes ready)
  until    a path: it loads until that file exists (the test says when)
  load_s   seconds to wait before listening (with a mode that serves): a slow load
  term_s   seconds it takes to end after SIGTERM
  ignore_term  true: SIGTERM does nothing (only SIGKILL ends it)
  answer   the text of every completion and chat answer (default: the build's folder name)
  decode   true: the decode benchmark's server (HTTP/1.1): /v1/models lists "m" with its max_model_len,
           /metrics and /version answer, and a chat completion streams three tokens, 0.3 s apart

VLLM_STAND_IN_BEHAVIOUR (JSON) in its environment is read over behaviour.json: for builds a command makes itself.

With VLLM_API_KEY in its environment it answers /v1 only to that bearer key, as vLLM does (HTTP 401 otherwise).
With VLLM_STAND_IN_LOG set, each start appends {pid, model, key, mark} to that file: key, whether it got an API
key; mark, the VLLM_STAND_IN_MARK of its environment (which environment a start was given).

As a driver, `python stand_in_vllm.py --cli ARGS` (`cli_argv(*args)`) runs `./vllm-t4 ARGS`, and `--mcp ARGS`
(`mcp_argv(*args)`) runs server.py, each in a process of its own with this stand-in where vLLM would be."""

from __future__ import annotations

import json
import os
import signal
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


DECODE_GETS = {"/health": "", "/metrics": "", "/version": '{"version": "stand-in"}',
               "/v1/models": json.dumps({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 4096}]})}


def argv(port: int, model: str, names: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The stand-in server's command line (ServeConfig.vllm_argv). `names`: its served model names, as vLLM's
    --served-model-name takes them: a request naming another model is answered 404, as vLLM answers it."""
    return [sys.executable, __file__, str(port), model, *names]


def build(folder: Path, **behaviour) -> str:
    """A stand-in build at `folder`: its behaviour.json (the keys above), an empty config.json and a chat template
    (what readiness sends a chat completion through); its path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "behaviour.json").write_text(json.dumps(behaviour))
    (folder / "config.json").write_text("{}")
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    return str(folder)


def cli_argv(*args: str) -> list[str]:
    """`./vllm-t4 ARGS` with the stand-in as vLLM, in a process of its own (the instance lock is taken by two
    processes as it is in use)."""
    return [sys.executable, __file__, "--cli", *args]


def mcp_argv(*args: str) -> list[str]:
    """server.py ARGS (the MCP server on stdio) with the stand-in as vLLM."""
    return [sys.executable, __file__, "--mcp", *args]


def _drive(front: str, args: list[str]) -> int:
    # Run as a script, this folder is first on sys.path: the project's root takes its place, whatever the cwd.
    sys.path[0] = str(Path(__file__).resolve().parents[3])
    from tools.serving.config import ServeConfig

    ServeConfig.vllm_argv = lambda self, platform: argv(self.port, self.model)
    if front == "--cli" and args[:1] == ["demo"]:  # ./vllm-t4 demo runs the demo in its place: here, with the patch
        from tools.core.commands import PROG_VARIABLE
        from tools.demo.demo import main

        os.environ[PROG_VARIABLE] = "vllm-t4 demo"

        return main(args[1:])
    if front == "--cli":
        from tools import cli

        return cli.main(args)
    import server

    return server.main(args)


def serve(port: int, model: Path, names: list[str]) -> None:
    b = model / "behaviour.json"
    spec = {**(json.loads(b.read_text()) if b.is_file() else {}),
            **json.loads(os.environ.get("VLLM_STAND_IN_BEHAVIOUR") or "{}")}
    mode = spec.get("mode", "serve")
    key = os.environ.get("VLLM_API_KEY")
    if os.environ.get("VLLM_STAND_IN_LOG"):
        with open(os.environ["VLLM_STAND_IN_LOG"], "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "model": str(model), "key": bool(key),
                                "mark": os.environ.get("VLLM_STAND_IN_MARK")}) + "\n")
    if spec.get("ignore_term"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif spec.get("term_s"):
        signal.signal(signal.SIGTERM, lambda *a: (time.sleep(spec["term_s"]), os._exit(0)))
    print(ULIMIT_LINE, flush=True)
    print("Starting to load model", model, flush=True)
    while spec.get("until") and not os.path.exists(spec["until"]):
        time.sleep(0.05)
    if mode == "exit":
        print("ValueError: the stand-in refuses this build", flush=True)
        sys.exit(1)
    if mode == "hang":
        time.sleep(600)
    time.sleep(float(spec.get("load_s", 0)))
    server = ThreadingHTTPServer(("127.0.0.1", port), handler(model, names, spec, key))
    server.daemon_threads = True
    server.serve_forever()


def handler(model: Path, names: list[str], spec: dict, key: str | None = None) -> type[BaseHTTPRequestHandler]:
    """The server's HTTP side, for a build at `model` behaving as `spec` says (behaviour.json's keys): also served
    in a thread by tests that need only that (tests.helpers.stand_ins.measure.serve_in_thread)."""
    mode = spec.get("mode", "serve")
    answer = spec.get("answer", model.name)

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1" if spec.get("decode") else "HTTP/1.0"

        def log_message(self, *a):
            pass

        def send(self, code: int, body: str) -> None:
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def refused_without_key(self) -> bool:
            if key and self.path.startswith("/v1/") and self.headers.get("Authorization") != "Bearer " + key:
                self.send(401, '{"error": "Unauthorized"}')
                return True
            return False

        def do_GET(self):
            if self.refused_without_key():
                return
            if spec.get("decode") and self.path in DECODE_GETS:
                self.send(200, DECODE_GETS[self.path])
                return
            if self.path == "/v1/models":
                self.send(200, json.dumps({"object": "list", "data": [{"id": model.name, "object": "model"}]}))
                return
            self.send(200 if self.path == "/health" else 404, "")

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.refused_without_key():
                return
            try:
                asked = json.loads(raw or b"{}").get("model")
            except (ValueError, AttributeError):
                asked = None
            if names and asked and asked not in names:
                self.send(404, json.dumps({"error": {"message": f"The model `{asked}` does not exist.",
                                                     "type": "NotFoundError", "code": 404}}))
                return
            if mode == "loading":
                self.send(503, '{"error": "loading"}')
                return
            chat = self.path.endswith("/chat/completions")
            if spec.get("decode") and chat:
                self.stream()
                return
            if mode == "refuse" or (mode == "refuse_chat" and chat):
                self.send(400, json.dumps(CONTEXT_REFUSAL))
                return
            choice = {"message": {"role": "assistant", "content": answer}} if chat else {"text": answer}
            body = {"model": model.name, "choices": [{"index": 0, **choice, "finish_reason": "length"}]}
            self.send(200, json.dumps({**body, "usage": {"completion_tokens": 1}} if chat else body))

        def stream(self) -> None:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            try:
                for i in range(3):
                    time.sleep(0.3)
                    chunk = {"choices": [{"delta": {"content": "ab"[i % 2]}, "token_ids": [10 + i]}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n')
                self.wfile.flush()
            except OSError:  # the client was killed mid-answer
                pass
            self.close_connection = True

    return H


if __name__ == "__main__":
    if sys.argv[1] in ("--cli", "--mcp"):
        raise SystemExit(_drive(sys.argv[1], sys.argv[2:]))
    serve(int(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
