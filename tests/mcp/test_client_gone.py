"""A client that goes away (its end of the pipes closed) while a call runs: server.py ends quietly, exit 0, without
the ExceptionGroup/BrokenPipeError traceback its stdio transport raised on writing the answer; and the call in
flight still ends as a cancelled one does (a start stops the server it started and records nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, free_port


def _message(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def _initialize(server: subprocess.Popen) -> None:
    """The MCP handshake over the server's pipes, as a client opens a session."""
    server.stdin.write(_message({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}))
    server.stdin.flush()
    assert json.loads(server.stdout.readline())["id"] == 1
    server.stdin.write(_message({"jsonrpc": "2.0", "method": "notifications/initialized"}))


@contextmanager
def _server(argv: list[str], env: dict[str, str], cwd) -> Iterator[subprocess.Popen]:
    """server.py on pipes, as a stdio client starts it; killed on the way out if it still runs."""
    server = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              cwd=cwd)
    try:
        yield server
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def _hang_up(server: subprocess.Popen, pause_s: float) -> tuple[int, str]:
    """The client goes away: its reading end first, then its writing end. The server's exit code and stderr."""
    server.stdout.close()
    time.sleep(pause_s)
    server.stdin.close()
    return server.wait(60), server.stderr.read().decode(errors="replace")


def test_a_client_that_goes_away_mid_call_leaves_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with _server([sys.executable, str(ROOT / "server.py"), "--state-dir", str(tmp_path / "run"), "--models-root",
                  str(tmp_path / "models"), "--evidence-root", str(tmp_path / "ev")], env, tmp_path) as server:
        _initialize(server)
        # calls whose answers come after the client is gone: every write of them meets a closed pipe
        for i in range(2, 6):
            server.stdin.write(_message({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                                         "params": {"name": "server_status", "arguments": {}}}))
        server.stdin.flush()
        rc, err = _hang_up(server, 0.5)
    assert "Traceback" not in err and "BrokenPipe" not in err and "ExceptionGroup" not in err, err
    assert rc == 0, (rc, err)


def test_a_client_that_goes_away_mid_start_cancels_the_start(tmp_path):
    """start_vllm_server on a stand-in build that never answers (START_TIMEOUT_S 300): the client goes away 2 s in;
    the server ends within a minute, quietly, the stand-in it started stopped and nothing recorded."""
    build = stand_in_vllm.build(tmp_path / "never", mode="hang")
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), STATE_DIR=str(run), FRONT_DOOR="0", START_TIMEOUT_S="300",
               HOST="127.0.0.1", SPECULATIVE_CONFIG="", EXTRA_ARGS="", CPU_KVCACHE_SPACE_GIB="1")
    with _server(stand_in_vllm.mcp_argv("--state-dir", str(run), "--models-root", str(tmp_path), "--evidence-root",
                                        str(tmp_path / "ev")), env, tmp_path) as server:
        _initialize(server)
        server.stdin.write(_message({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "start_vllm_server", "arguments": {"model": build, "port": free_port()},
            "_meta": {"progressToken": "p"}}}))
        server.stdin.flush()
        deadline = time.monotonic() + 60
        while not _stand_ins(build) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _stand_ins(build), "the stand-in never started"
        time.sleep(2)
        rc, err = _hang_up(server, 0)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert rc == 0, (rc, err)
    deadline = time.monotonic() + 10
    while _stand_ins(build) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _stand_ins(build) and not list(run.rglob("vllm.json"))


def _stand_ins(build: str) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline", "status"])
            if build in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
