"""A log of every vLLM server start in a test run, for finding where the suite's time goes.

Enabled by GEMMA4_T4_START_LOG=<file> (conftest.py starts it): a thread notices each vLLM API server whose model
lies under this session's temporary folder (started by a fixture, a test, the command line or an MCP server
subprocess alike), and appends one JSON line per start to <file>: the test that was running (and whether in its
setup, call or teardown), the argv's mode (eager or compiled), seconds until the log said "Application startup
complete." (None if it never did) and seconds the process lived. Off by default: nothing runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import psutil

MODULE = "vllm.entrypoints.openai.api_server"
READY = b"Application startup complete."


class StartLog:
    def __init__(self, out: Path, under: str, interval_s: float = 0.5) -> None:
        self.out, self.under, self.interval_s = out, under, interval_s
        self.current = ("(collection)", "")
        self._seen: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-start-log", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for pid in list(self._seen):
            self._finish(pid, ended=time.time())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._poll()
            except Exception:  # a log for measuring must never fail a test run
                pass

    def _poll(self) -> None:
        now = time.time()
        alive = set()
        for p in psutil.process_iter(["pid", "cmdline", "create_time"]):
            cmd = p.info["cmdline"] or []
            if MODULE not in cmd or "--model" not in cmd:
                continue
            model = cmd[cmd.index("--model") + 1] if cmd.index("--model") + 1 < len(cmd) else ""
            if not model.startswith(self.under):
                continue
            pid = p.info["pid"]
            alive.add(pid)
            rec = self._seen.get(pid)
            if rec is None:
                try:
                    log = os.readlink(f"/proc/{pid}/fd/1")
                except OSError:
                    log = ""
                test, phase = self.current
                rec = self._seen[pid] = {
                    "test": test, "phase": phase, "pid": pid, "model": Path(model).name,
                    "mode": "eager" if "--enforce-eager" in cmd else "compiled",
                    "spec": "--speculative-config" in cmd, "created": p.info["create_time"], "log": log,
                    "ready_s": None}
            if rec["ready_s"] is None and rec["log"]:
                try:
                    if READY in Path(rec["log"]).read_bytes():
                        rec["ready_s"] = round(now - rec["created"], 1)
                except OSError:
                    pass
        for pid in [pid for pid in self._seen if pid not in alive]:
            self._finish(pid, ended=now)

    def _finish(self, pid: int, ended: float) -> None:
        rec = self._seen.pop(pid)
        rec["lived_s"] = round(ended - rec["created"], 1)
        rec["created"] = time.strftime("%H:%M:%S", time.gmtime(rec["created"]))
        with open(self.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
