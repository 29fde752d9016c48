"""Fixtures of the serving tests: a command line run in this process, and stand-in running instances."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.stand_ins.router_worker import STAND_IN_WORKER
from tests.helpers.fixtures import launched


@pytest.fixture
def cli_here(capsys, monkeypatch):
    """run(args, env): the command through tools.cli.main in this process, as a CompletedProcess (./vllm-t4 exits
    with main's return value; the script itself runs in the ../x, port-clash and router-lifecycle tests)."""
    from tools.cli import main

    def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        for k, v in env.items():
            if os.environ.get(k) != v:
                monkeypatch.setenv(k, v)
        capsys.readouterr()
        try:
            rc = main(args)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, rc, out, err)

    return run


def _listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture()
def fleet(tmp_path):
    """Stand-in running instances: make(name, port, platform, **state) starts a `sleep` (serve=True: a server on
    port) as a launch starts it (its own session, a launch token, fixtures.launched), from the instance's folder,
    and writes its state file; name "router" writes run/router.json for it instead (its backends: the instances
    named in `backends`). Everything is killed at the end."""
    procs: list[subprocess.Popen] = []

    def make(name: str, port: int, platform: str = "cpu", serve: bool = False, backends: tuple = (), **state):
        argv = [sys.executable, "-c", STAND_IN_WORKER, str(port)] if serve else ["sleep", "300"]
        d = tmp_path / "run" / name if name not in ("default", "router") else tmp_path / "run"
        d.mkdir(parents=True, exist_ok=True)
        p, token = launched(argv, cwd=d)
        procs.append(p)
        deadline = time.monotonic() + 30
        while serve and time.monotonic() < deadline and not _listens(port):
            time.sleep(0.05)
        common = dict(pid=p.pid, pgid=p.pid, create_time=psutil.Process(p.pid).create_time(), launch=token,
                      host="127.0.0.1",
                      port=port, base_url=f"http://127.0.0.1:{port}", argv=["x"],
                      started_at="2026-01-01T00:00:00+00:00", started_ts=time.time())
        if name == "router":
            st = dict(common, policy="round_robin", log_path=str(d / "router.log"), names=["m"],
                      backends=[{"instance": b, "base_url": json.loads((d / b / "vllm.json").read_text())["base_url"]}
                                for b in backends], **state)
            (d / "router.json").write_text(json.dumps(st))
            return st
        st = dict(common, model="m", served_name="m", platform=platform, log_path=str(d / "vllm.log"),
                  instance="" if name == "default" else name, **state)
        (d / "vllm.json").write_text(json.dumps(st))
        return st

    yield make
    for p in procs:
        p.kill()
        p.wait()
