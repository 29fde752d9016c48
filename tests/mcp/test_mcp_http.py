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

from tools.core.paths import PathNotAllowed, Roots

from tests.helpers.fixtures import free_port

ROOT = Path(__file__).resolve().parents[2]
# The tests of the module's one HTTP server run on one xdist worker: one server start per run, not one per worker.
ON_THE_SHARED_SERVER = pytest.mark.xdist_group("mcp-http")


def _initialize_body() -> dict:
    return {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "test", "version": "0"}}}


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    port = free_port()
    token = "s3cret-" + os.urandom(16).hex()
    models = tmp_path_factory.mktemp("models")
    env = dict(os.environ, GEMMA4_T4_MCP_TOKEN=token)
    log = tmp_path_factory.mktemp("log") / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--http", "--port", str(port),
                                 "--models-root", str(models), "--allowed-host", "mcp.example.test",
                                 "--toolsets", "all"],
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


@ON_THE_SHARED_SERVER
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


@ON_THE_SHARED_SERVER
def test_http_binds_loopback_only(http_server):
    _, _, port, _ = http_server
    import psutil

    listening = [c for c in psutil.net_connections("inet") if c.laddr and c.laddr.port == port
                 and c.status == psutil.CONN_LISTEN]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)


@ON_THE_SHARED_SERVER
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
    port = free_port()
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


@ON_THE_SHARED_SERVER
def test_http_checks_host_and_origin(http_server):
    """DNS-rebinding protection: loopback names and --allowed-host pass; another Host gets 421 (fastmcp's
    answer), another Origin 403."""
    url, token, port, _ = http_server
    headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
               "Authorization": "Bearer " + token}

    def post(**extra) -> int:
        return httpx.post(url, json=_initialize_body(), headers={**headers, **extra}, timeout=10).status_code

    assert post(Host=f"localhost:{port}") == 200
    assert post(Host="mcp.example.test") == 200
    assert post(Host="attacker.example") == 421
    assert post(Origin="http://attacker.example") == 403
    assert post(Origin=f"http://127.0.0.1:{port}") == 200


def _server_exit(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "server.py"), *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_bad_port_short_token_and_plaintext_warning(tmp_path):
    bad = _server_exit(["--http", "--port", "70000"])
    assert bad.returncode == 2 and "70000 is not a port" in bad.stderr and "Traceback" not in bad.stderr
    short = _server_exit(["--http", "--port", str(free_port())], env=dict(os.environ, GEMMA4_T4_MCP_TOKEN="x" * 31))
    assert short.returncode == 2 and "at least 32" in short.stderr
    # Refused before the app (fastmcp) is loaded.
    probe = ("import os, sys\nimport server\ntry:\n    server.main(['--http', '--port', '70000'])\n"
             "except SystemExit:\n    pass\nos.environ['GEMMA4_T4_MCP_TOKEN'] = 'x' * 31\n"
             "assert server.main(['--http']) == 2\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastmcp', 'mcp')))\n")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)
    port = free_port()
    env = dict(os.environ, GEMMA4_T4_MCP_TOKEN="t" * 40)
    proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--http", "--host", "0.0.0.0", "--port",
                             str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stderr.readline()
        assert "not loopback" in line and "plaintext" in line
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def test_sigterm_cancels_a_running_job_and_exits_143(tmp_path, tiny_qat):
    """A job running in a worker thread is cancelled on SIGTERM; its library clean-up runs before the exit."""
    import json as _json

    models = tmp_path / "models"
    models.mkdir()
    proc = subprocess.Popen([sys.executable, str(ROOT / "server.py"), "--models-root", str(models),
                             "--models-root", str(tiny_qat.parent), "--toolsets", "jobs,repack"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)

    def send(obj) -> None:
        proc.stdin.write(_json.dumps(obj) + "\n")
        proc.stdin.flush()

    def answer(rid: int) -> dict:
        while True:
            msg = _json.loads(proc.stdout.readline())
            if msg.get("id") == rid:
                return msg

    try:
        send(_initialize_body())
        answer(1)
        send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "start_job", "arguments": {
            "tool": "repack_checkpoint", "arguments": {"source": str(tiny_qat), "output": "out"}}}})
        job = answer(2)["result"]["structuredContent"]
        assert job["state"] == "running"
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 143
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # cancelled (nothing published, no partial left) or, on a fast machine, finished before the signal
    leftovers = [p.name for p in models.iterdir() if p.name.startswith(".")]
    assert leftovers == [], leftovers
    assert not (models / "out").exists() or (models / "out" / "repack-report.json").is_file()


# ---------------------------------------------------------------------------------------- confinement unit tests


def test_roots_confine(tmp_path):
    models, evidence, outside = tmp_path / "models", tmp_path / "evidence", tmp_path / "outside"
    for d in (models, evidence, outside):
        d.mkdir()
    (models / "ckpt").mkdir()
    (models / "ckpt" / "config.json").write_text("{}")
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


@pytest.mark.parametrize("linked", ["model.safetensors", "config.json", "tokenizer.json"])
def test_confine_model_refuses_a_checkpoint_file_linked_out_as_probe_does(tmp_path, linked):
    from repack.errors import RepackError
    from repack.build.probe import probe_checkpoint
    from repack.stand_ins.synthetic import write_small_checkpoint

    models, outside = tmp_path / "models", tmp_path / "outside"
    models.mkdir()
    src = write_small_checkpoint(outside / "ckpt")
    ckpt = models / "linked"
    ckpt.mkdir()
    for f in src.iterdir():  # a real folder inside the root; one of its files a link out of it
        (ckpt / f.name).symlink_to(f) if f.name == linked else (ckpt / f.name).write_bytes(f.read_bytes())
    roots = Roots.from_env([str(models)], [str(tmp_path / "evidence")], environ={})
    with pytest.raises(PathNotAllowed) as served:
        roots.confine_model("linked")
    msg = str(served.value)
    assert msg.startswith("model linked: ") and "a link to a file outside the checkpoint folder" in msg
    assert str(outside) not in msg
    if linked != "tokenizer.json":  # probe reads config and weights; the build (and the start) every file
        with pytest.raises(RepackError, match="a link to a file outside the checkpoint folder"):
            probe_checkpoint(ckpt, roots=[models])


def test_confine_model_accepts_links_that_stay_in_the_checkpoint(tmp_path):
    """A hub cache snapshot under a models root (files linking to ../../blobs) and a link between a folder's own
    files are what probe and repack read too: served alike."""
    from repack.build.probe import probe_checkpoint
    from repack.stand_ins.synthetic import write_small_checkpoint

    models = tmp_path / "models"
    src = write_small_checkpoint(tmp_path / "src")
    repo = models / "hub" / "models--google--tiny"
    snap, blobs = repo / "snapshots" / ("a" * 40), repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(src.iterdir())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / f"blob{i}")
    own = models / "own"
    own.mkdir()
    for f in src.iterdir():
        (own / f.name).write_bytes(f.read_bytes())
    (own / "tokenizer.model").symlink_to("tokenizer.json")
    roots = Roots.from_env([str(models)], [str(tmp_path / "evidence")], environ={})
    for folder in (snap, own):
        assert roots.confine_model(str(folder)) == str(folder)
        probe_checkpoint(folder, roots=[models])


def test_roots_from_environment(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    roots = Roots.from_env(environ={"GEMMA4_T4_MODELS_ROOTS": f"{a}{os.pathsep}{b}"})
    assert roots.models == (a, b)
    assert roots.confine(str(b / "x"), "models") == b / "x"
    assert roots.evidence[0].name == "evidence"
