"""The HTTP transport: 127.0.0.1 by default and a bearer token on every request; and path confinement."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from tools.mcp.paths import PathNotAllowed, Roots

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _initialize_body() -> dict:
    return {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "test", "version": "0"}}}


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    port = _free_port()
    token = "s3cret-" + os.urandom(8).hex()
    models = tmp_path_factory.mktemp("models")
    env = dict(os.environ, GEMMA4_T4_MCP_TOKEN=token)
    log = tmp_path_factory.mktemp("log") / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--http", "--port", str(port),
                                 "--models-root", str(models)],
                                env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, cwd="/")
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail(f"HTTP server did not listen: {log.read_text()}")
        yield f"http://127.0.0.1:{port}/mcp", token, port, models
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_http_refuses_without_or_with_a_wrong_token(http_server):
    url, token, _, _ = http_server
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    r = httpx.post(url, json=_initialize_body(), headers=headers, timeout=10)
    assert r.status_code == 401
    r = httpx.post(url, json=_initialize_body(), headers={**headers, "Authorization": "Bearer " + token + "x"},
                   timeout=10)
    assert r.status_code == 401
    r = httpx.post(url, json=_initialize_body(), headers={**headers, "Authorization": "Bearer " + token},
                   timeout=10)
    assert r.status_code == 200


def test_http_binds_loopback_only(http_server):
    _, _, port, _ = http_server
    import psutil

    listening = [c for c in psutil.net_connections("inet") if c.laddr and c.laddr.port == port
                 and c.status == psutil.CONN_LISTEN]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)


def test_http_client_with_token_lists_and_confines(http_server, tmp_path):
    asyncio.run(_client_session(http_server, tmp_path))


async def _client_session(http_server, tmp_path):
    url, token, _, models = http_server
    async with Client(url, auth=token) as client:
        names = {t.name for t in await client.list_tools()}
        assert {"vram_status", "probe_checkpoint", "repack_checkpoint"} <= names
        vram = await client.call_tool("vram_status", {})
        assert vram.structured_content["available"] in (True, False)
        with pytest.raises(ToolError, match="outside the models roots"):
            await client.call_tool("probe_checkpoint", {"path": str(tmp_path)})
        with pytest.raises(ToolError, match="outside the models roots"):
            await client.call_tool("probe_checkpoint", {"path": "../../etc"})


def test_generated_token_is_printed_when_none_is_configured(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "GEMMA4_T4_MCP_TOKEN"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--http", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        line = proc.stderr.readline()
        assert "bearer token for this run:" in line
        token = line.rsplit(":", 1)[1].strip()
        assert len(token) >= 32
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)


# ---------------------------------------------------------------------------------------- confinement unit tests


def test_roots_confine(tmp_path):
    models, evidence, outside = tmp_path / "models", tmp_path / "evidence", tmp_path / "outside"
    for d in (models, evidence, outside):
        d.mkdir()
    (models / "ckpt").mkdir()
    (models / "escape").symlink_to(outside)
    roots = Roots.from_env([str(models)], [str(evidence)], environ={})
    assert roots.confine("ckpt", "models", must_exist=True) == models / "ckpt"
    assert roots.confine(str(models / "new" / "out"), "models") == models / "new" / "out"
    assert roots.confine("run1", "evidence") == evidence / "run1"
    for bad in (str(outside), "../outside", str(models / ".." / "outside"), "escape", str(models / "escape" / "x")):
        with pytest.raises(PathNotAllowed, match="outside the models roots"):
            roots.confine(bad, "models")
    with pytest.raises(PathNotAllowed, match="outside the evidence roots"):
        roots.confine(str(models / "ckpt"), "evidence")
    with pytest.raises(PathNotAllowed, match="does not exist"):
        roots.confine("missing", "models", must_exist=True)
    with pytest.raises(PathNotAllowed, match="empty"):
        roots.confine("  ", "models")
    # A hub id is served by vLLM itself; an existing folder of that name under the root wins.
    assert roots.confine_model("google/gemma-4-E2B-it") == "google/gemma-4-E2B-it"
    assert roots.confine_model("ckpt") == str(models / "ckpt")
    with pytest.raises(PathNotAllowed):
        roots.confine_model(str(outside))


def test_roots_from_environment(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    roots = Roots.from_env(environ={"GEMMA4_T4_MODELS_ROOTS": f"{a}{os.pathsep}{b}"})
    assert roots.models == (a, b)
    assert roots.confine(str(b / "x"), "models") == b / "x"
    assert roots.evidence[0].name == "evidence"
