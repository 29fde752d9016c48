"""A client that goes away (its end of the pipes closed) while a call runs: server.py ends quietly, without the
ExceptionGroup/BrokenPipeError traceback its stdio transport raised on writing the answer, and still runs its
clean-up (the jobs' and a replace's rollback: app.shutdown, run in either case)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _message(obj: dict) -> bytes:
    return (json.dumps(obj) + "\n").encode()


def test_a_client_that_goes_away_mid_call_leaves_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    server = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--state-dir", str(tmp_path / "run"),
                               "--models-root", str(tmp_path / "models"), "--evidence-root", str(tmp_path / "ev")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              cwd=tmp_path)
    try:
        server.stdin.write(_message({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}))
        server.stdin.flush()
        assert json.loads(server.stdout.readline())["id"] == 1
        server.stdin.write(_message({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        # calls whose answers come after the client is gone: every write of them meets a closed pipe
        for i in range(2, 6):
            server.stdin.write(_message({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                                         "params": {"name": "server_status", "arguments": {}}}))
        server.stdin.flush()
        server.stdout.close()  # the client goes away: first its reading end, then its writing end
        time.sleep(0.5)
        server.stdin.close()
        rc = server.wait(60)
        err = server.stderr.read().decode(errors="replace")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert "Traceback" not in err and "BrokenPipe" not in err and "ExceptionGroup" not in err, err
    assert rc == 0, (rc, err)
