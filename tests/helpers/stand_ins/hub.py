"""A stand-in Hugging Face hub on loopback for the fetch tests (HF_ENDPOINT points at it).

It implements only what huggingface_hub 2.4 calls for model_info / snapshot_download / hf_hub_download:
GET /api/models/{repo}/revision/{rev}, GET /api/models/{repo}/tree/{rev}, HEAD and GET (with Range)
/{repo}/resolve/{rev}/{file}.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler
from urllib.parse import unquote, urlparse

from tests.helpers.stand_ins.measure import serve_in_thread

REPO = "acme/gemma-4-tiny-qat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class StandInHub:
    def __init__(self, files: dict[str, bytes]):
        self.files = files
        self.sha = {n: hashlib.sha256(b).hexdigest() for n, b in files.items()}
        self.mode = "ok"          # ok | gated401 | gated403
        self.cut: str | None = None  # a file whose body stops at half its size, every time (a dropped connection)
        self.requests: list[str] = []
        self.ranges: list[tuple[str, int]] = []  # (file, first byte asked for) of each ranged GET
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head):
                path = unquote(urlparse(self.path).path)
                hub.requests.append(f"{self.command} {path}")
                if hub.mode != "ok":
                    code = 401 if hub.mode == "gated401" else 403
                    return self._send(code, b'{"error":"gated"}', {"X-Error-Code": "GatedRepo"}, head)
                if path.startswith("/api/models/"):
                    rest = path[len("/api/models/"):]
                    repo, _, tail = rest.partition("/revision/") if "/revision/" in rest else rest.partition("/tree/")
                    if repo != REPO:
                        return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, head)
                    rev = tail.split("/")[0]
                    if rev not in ("main", COMMIT):
                        return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, head)
                    if "/revision/" in rest:
                        body = {"id": REPO, "sha": COMMIT, "siblings": [
                            {"rfilename": n, "size": len(b), "blobId": hub.sha[n][:40],
                             "lfs": {"size": len(b), "sha256": hub.sha[n], "pointerSize": 130}}
                            for n, b in hub.files.items()]}
                    else:
                        body = [{"type": "file", "path": n, "size": len(b), "oid": hub.sha[n][:40],
                                 "lfs": {"oid": hub.sha[n], "size": len(b), "pointerSize": 130}}
                                for n, b in hub.files.items()]
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                prefix = f"/{REPO}/resolve/"
                if path.startswith(prefix):
                    rev, _, name = path[len(prefix):].partition("/")
                    if name not in hub.files:
                        return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                    data = hub.files[name]
                    headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hub.sha[name]}"'}
                    rng = self.headers.get("Range")
                    if rng and not head:
                        hub.ranges.append((name, int(rng.split("=")[1].split("-")[0])))
                    if name == hub.cut and not head:
                        start = int(rng.split("=")[1].split("-")[0]) if rng else 0
                        self.send_response(206 if rng else 200)
                        for k, v in headers.items():
                            self.send_header(k, v)
                        self.send_header("Content-Length", str(len(data) - start))
                        self.end_headers()
                        self.wfile.write(data[start:max(start, len(data) // 2)])
                        self.wfile.flush()
                        self.close_connection = True
                        return None
                    if rng and not head:
                        start = int(rng.split("=")[1].split("-")[0])
                        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                        return self._send(206, data[start:], headers)
                    if head:
                        self.send_response(200)
                        for k, v in headers.items():
                            self.send_header(k, v)
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        return None
                    return self._send(200, data, headers)
                return self._send(404, b"")

            def do_GET(self):
                self._route(False)

            def do_HEAD(self):
                self._route(True)

        self.handler = Handler
        self.url = ""  # set while served (inside `with`)
        self._served = ExitStack()

    def __enter__(self):
        self.url = self._served.enter_context(serve_in_thread(self.handler))
        return self

    def __exit__(self, *exc):
        self._served.close()
