"""What the serving tests share: a two-core CPU (Hardware), clients sending chat completions through a port while
a test changes what serves it, and a bench of stand-in builds driven by `./vllm-t4` commands in processes of
their own (tests/helpers/stand_ins/vllm_server.py where vLLM would be)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import httpx

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, default_signals, free_port
from tests.helpers.kill_matrix import all_gone
from tools.serving.records import state
from tools.serving.config import load_config
from tools.serving.preflight.hardware import Hardware
from tools.serving.server.server import server_status, stop_server


class TwoCores(Hardware):
    def platform(self):
        return "cpu"

    def cpu_cores(self):
        return [0, 1]


class Clients:
    """Chat completions through the front door from two threads until stopped: what each got."""

    def __init__(self, url: str, model: str | None = None, key: str | None = None):
        self.url, self.results, self._stop = url, [], threading.Event()
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                     **({"model": model} if model else {})}
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self):
        with httpx.Client(timeout=120.0, headers=self.headers) as c:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    r = c.post(f"{self.url}/v1/chat/completions", json=self.body)
                    # which build answered: its served name
                    got = (r.status_code, r.json()["model"] if r.status_code == 200 else r.text[:200])
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    got = (0, repr(exc))
                self.results.append((*got, time.monotonic() - t))
                time.sleep(0.05)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self.threads:
            t.join(timeout=150)

    def flowing(self, timeout: float = 120.0) -> "Clients":
        """Wait for a first answer, so an operation that ends quickly (a refused switch) happens with traffic
        flowing rather than before the first request returns."""
        deadline = time.monotonic() + timeout
        while not self.results and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.results, f"no answer from {self.url} in {timeout:.0f} s"
        return self

    def failed(self):
        return [r for r in self.results if r[0] != 200]

    def served(self):
        return [r[1] for r in self.results if r[0] == 200]


class Bench:
    """Stand-in builds, one port and state dir, and `./vllm-t4` commands run against them. Each build's behaviour
    is tests/helpers/stand_ins/vllm_server.py's (a build given `until` loads until that file exists); its answers
    are "ok"."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.log = tmp_path / "starts.jsonl"
        self.port = free_port()
        self.env = dict(os.environ, PYTHONPATH=str(ROOT), STATE_DIR=str(tmp_path / "run"), PORT=str(self.port),
                        HOST="127.0.0.1", SPECULATIVE_CONFIG="", EXTRA_ARGS="", START_TIMEOUT_S="30",
                        VLLM_STAND_IN_LOG=str(self.log))
        self.env.pop("VLLM_API_KEY", None)

    def build(self, name: str, **behaviour) -> str:
        model = self.tmp / name
        model.mkdir(exist_ok=True)
        (model / "behaviour.json").write_text(json.dumps({"answer": "ok", **behaviour}))
        (model / "config.json").write_text("{}")  # a checkpoint folder, as the start checks want
        return str(model)

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        # default SIGINT/SIGTERM whatever the runner inherited (a runner started in the background ignores SIGINT)
        return subprocess.Popen(stand_in_vllm.cli_argv(*args), cwd=ROOT, env=env or self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)

    def run(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        p = self.popen(*args, env=env)
        out, err = p.communicate(timeout=120)
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    def starts(self) -> list[dict]:
        return [json.loads(ln) for ln in self.log.read_text().splitlines()] if self.log.exists() else []

    def started(self, name: str) -> bool:
        return any(Path(s["model"]).name == name for s in self.starts())

    def cfg(self):
        return load_config(ROOT / "tpu.env", state_dir=str(self.tmp / "run"), port=self.port, model="x",
                           speculative_config="", extra_args="")

    def check_true_and_nothing_orphaned(self, serving: str | None) -> None:
        """The state names `serving` (alive, answering) or nothing; no replace record; every other stand-in is
        gone."""
        cfg = self.cfg()
        rec = state.load_state(cfg)
        assert not state.replace_file(cfg).exists()
        if serving is None:
            assert rec is None
        else:
            assert rec is not None and rec.served_name == serving, rec
            st = server_status(cfg)
            assert st.alive and st.healthy, st.message
        others = [s["pid"] for s in self.starts() if rec is None or s["pid"] != rec.pid]
        assert all_gone(others)

    def stop(self) -> None:
        try:
            stop_server(self.cfg(), grace_s=2)
        finally:
            assert all_gone([s["pid"] for s in self.starts()])


def until(what: str, reached, proc: subprocess.Popen | None = None, timeout_s: float = 60) -> None:
    """Waits until `reached()`; fails if `timeout_s` passes first, or `proc` (when given) ends first."""
    deadline = time.monotonic() + timeout_s
    while not reached():
        assert proc is None or proc.poll() is None, f"the first command ended before {what}: {proc.communicate()[1]}"
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(0.05)
