"""In-memory MCP client tests: every tool's schema and annotations, results, progress, jobs and errors."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

import server as mcp_server
from tools.paths import Roots

ROOT = Path(__file__).resolve().parents[1]

EXPECTED_TOOLS = {
    # name: (readOnly, destructive, idempotent)
    "vram_status": (True, False, True),
    "probe_checkpoint": (True, False, True),
    "server_status": (True, False, True),
    "server_logs": (True, False, True),
    "list_jobs": (True, False, True),
    "job_status": (True, False, True),
    "repack_checkpoint": (False, True, True),
    "start_vllm_server": (False, False, False),
    "stop_vllm_server": (False, True, True),
    "query_model": (True, False, False),
    "run_sweep": (False, False, False),
    "compare_tokens": (False, False, False),
    "compare_sweeps": (False, False, True),
    "patch_turing": (False, True, True),
    "start_job": (False, True, False),
    "cancel_job": (False, True, True),
}


def run(coro):
    return asyncio.run(coro)


@pytest.fixture()
def roots(tmp_path) -> Roots:
    (tmp_path / "models").mkdir()
    (tmp_path / "evidence").mkdir()
    return Roots.from_env([str(tmp_path / "models")], [str(tmp_path / "evidence")], environ={})


@pytest.fixture()
def mcp(roots, tmp_path):
    return mcp_server.create_server(mcp_server.Settings(roots=roots, config_overrides={
        "state_dir": str(tmp_path / "run")}))


def test_every_tool_is_listed_with_title_description_annotations_and_output_schema(mcp):
    async def go():
        async with Client(mcp) as c:
            return await c.list_tools()

    tools = {t.name: t for t in run(go())}
    assert set(tools) == set(EXPECTED_TOOLS)
    for name, (read_only, destructive, idempotent) in EXPECTED_TOOLS.items():
        t = tools[name]
        assert t.title and t.title != name, name
        assert t.description and len(t.description) > 60, name
        a = t.annotations
        assert (a.read_only_hint, a.destructive_hint, a.idempotent_hint, a.open_world_hint) == \
               (read_only, destructive, idempotent, False), name
        schema = t.output_schema
        assert schema and schema.get("type") == "object" and schema.get("properties"), name
        # every input parameter is described for the agent
        for pname, prop in (t.input_schema.get("properties") or {}).items():
            assert prop.get("description"), f"{name}.{pname} has no description"


def test_vram_status_without_gpu_is_a_result(mcp):
    async def go():
        async with Client(mcp) as c:
            return await c.call_tool("vram_status", {})

    r = run(go())
    assert r.is_error is False
    data = r.structured_content
    assert data["available"] is False and "NVML" in data["reason"]
    assert r.content[0].text == data["summary"]
    assert json.loads(r.content[1].text) == data  # clients that show only text still get the fields


def test_paths_outside_roots_are_refused(mcp, tmp_path):
    async def go():
        async with Client(mcp) as c:
            errors = []
            for tool, args in [
                ("probe_checkpoint", {"path": "/etc"}),
                ("repack_checkpoint", {"source": "/etc", "output": "x"}),
                ("repack_checkpoint", {"source": str(tmp_path / "models"), "output": "/tmp/evil"}),
                ("start_vllm_server", {"model": str(tmp_path)}),
            ]:
                with pytest.raises(ToolError) as ei:
                    await c.call_tool(tool, args)
                errors.append(str(ei.value))
            return errors

    errors = run(go())
    assert all("outside the models roots" in e for e in errors), errors


def test_jobs_unknown_and_bad_arguments(mcp):
    async def go():
        async with Client(mcp) as c:
            with pytest.raises(ToolError, match="no job 'job-99'"):
                await c.call_tool("job_status", {"job_id": "job-99"})
            with pytest.raises(ToolError, match="repack_checkpoint: argument output: Field required"):
                await c.call_tool("start_job", {"tool": "repack_checkpoint", "arguments": {"source": "x"}})
            with pytest.raises(ToolError, match="argument bogus: Extra inputs are not permitted"):
                await c.call_tool("start_job", {"tool": "repack_checkpoint",
                                                "arguments": {"source": "x", "output": "y", "bogus": 1}})
            r = await c.call_tool("list_jobs", {})
            return r.structured_content

    assert run(go())["jobs"] == []


def test_server_never_imports_vllm_or_torch():
    code = (
        "import asyncio, sys\n"
        "sys.path.insert(0, %r)\n"
        "import server\n"
        "from fastmcp import Client\n"
        "async def go():\n"
        "    async with Client(server.create_server()) as c:\n"
        "        await c.list_tools()\n"
        "        await c.call_tool('vram_status', {})\n"
        "        await c.call_tool('server_status', {}, raise_on_error=False)\n"
        "asyncio.run(go())\n"
        "heavy = sorted(m for m in ('vllm', 'torch', 'transformers', 'numpy', 'safetensors') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    ) % str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "HEAVY=\n" in out.stdout, out.stdout
