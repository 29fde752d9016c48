"""A vLLM worker behind the router, as a script: `python -c STAND_IN_WORKER PORT` (tests/serving/conftest.py's
`fleet` starts it as a running instance's server)."""

# A stand-in for a vLLM server, for the router's process handling: /health, /v1/models, /v1/completions and the
# /metrics counter a sweep's per-backend counts are read from.
STAND_IN_WORKER = r"""
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
