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
from tools.mcp.paths import Roots

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


# ------------------------------------------------------------------------------ on the tiny model (real library)


@pytest.fixture()
def tiny_mcp(tiny_qat, tiny_base, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(tmp_path / "models"), str(tiny_qat.parent), str(tiny_base.parent)],
                           [str(tmp_path / "evidence")], environ={})
    return mcp_server.create_server(mcp_server.Settings(roots=roots, config_overrides={
        "state_dir": str(tmp_path / "run")})), tmp_path / "models"


def test_probe_and_repack_with_progress(tiny_mcp, tiny_qat, tiny_base):
    mcp, models = tiny_mcp
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress, total, message):
        seen.append((progress, total, message))

    async def go():
        async with Client(mcp) as c:
            probe = await c.call_tool("probe_checkpoint", {"path": str(tiny_qat)})
            base = await c.call_tool("probe_checkpoint", {"path": str(tiny_base)})
            rep = await c.call_tool("repack_checkpoint", {"source": str(tiny_qat), "output": "emb4"},
                                    progress_handler=on_progress)
            with pytest.raises(ToolError, match="exists"):
                await c.call_tool("repack_checkpoint", {"source": str(tiny_qat), "output": "emb4"})
            with pytest.raises(ToolError, match="off the 4-bit grid"):
                await c.call_tool("repack_checkpoint", {"source": str(tiny_base), "output": "base-emb4"})
            return probe.structured_content, base.structured_content, rep.structured_content

    probe, base, rep = run(go())
    assert probe["verdict"] == "qat" and probe["text_off_grid"] == 0
    assert not [t for t in probe["off_grid_tensors"] if not t["tower"]]  # towers are not QAT-trained
    assert base["verdict"] in ("base", "mixed") and [t for t in base["off_grid_tensors"] if not t["tower"]]
    assert rep["output"] == str(models / "emb4")
    tables = {t["name"]: t for t in rep["tables"]}
    assert tables["embed_tokens"]["groups"] > 0 and tables["lm_head"]["groups"] > 0
    assert all(t["offgrid_groups"] == 0 for t in rep["tables"])
    assert rep["total_bytes_after"] < rep["total_bytes_before"]
    cfg = json.loads((models / "emb4" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized" and cfg["tie_word_embeddings"] is False
    # progress was streamed, reached its total and counted up
    assert len(seen) >= 2 and seen[-1][0] == seen[-1][1]
    assert [p for p, _, _ in seen] == sorted(p for p, _, _ in seen)
    # the off-grid source left nothing behind
    assert not (models / "base-emb4").exists()


def test_repack_as_job_then_busy_rule(tiny_mcp, tiny_qat):
    mcp, models = tiny_mcp

    async def go():
        async with Client(mcp) as c:
            job = (await c.call_tool("start_job", {"tool": "repack_checkpoint", "arguments": {
                "source": str(tiny_qat), "output": "text", "embed_int4": False}})).structured_content
            assert job["state"] == "running" and job["tool"] == "repack_checkpoint"
            # one long operation at a time, foreground or background
            with pytest.raises(ToolError, match=f"repack_checkpoint \\({job['job_id']}\\) is running"):
                await c.call_tool("repack_checkpoint", {"source": str(tiny_qat), "output": "other"})
            done = (await c.call_tool("job_status", {"job_id": job["job_id"], "wait_s": 120})).structured_content
            listing = (await c.call_tool("list_jobs", {})).structured_content
            bad = (await c.call_tool("start_job", {"tool": "repack_checkpoint", "arguments": {
                "source": str(tiny_qat), "output": "text"}})).structured_content
            bad = (await c.call_tool("job_status", {"job_id": bad["job_id"], "wait_s": 60})).structured_content
            return done, listing, bad

    done, listing, bad = run(go())
    assert done["state"] == "succeeded", done
    assert done["result"]["output"] == str(models / "text")
    assert {t["name"]: t["groups"] for t in done["result"]["tables"]}.get("embed_tokens", 0) == 0
    assert done["progress"] == done["total"] and done["elapsed_s"] > 0
    assert [j["job_id"] for j in listing["jobs"]] == [done["job_id"]]
    assert bad["state"] == "failed" and "exists" in bad["error"]
    assert not (models / "other").exists()


def test_cancel_a_job(tiny_mcp, tiny_qat):
    mcp, models = tiny_mcp

    async def go():
        async with Client(mcp) as c:
            job = (await c.call_tool("start_job", {"tool": "repack_checkpoint", "arguments": {
                "source": str(tiny_qat), "output": "cancelled"}})).structured_content
            await c.call_tool("cancel_job", {"job_id": job["job_id"]})
            return (await c.call_tool("job_status", {"job_id": job["job_id"], "wait_s": 120})).structured_content

    info = run(go())
    # a tiny repack may finish before the cancel lands; either way the state is final and consistent
    assert info["state"] in ("cancelled", "succeeded")
    if info["state"] == "cancelled":
        assert not (models / "cancelled").exists()
    else:
        assert (models / "cancelled" / "config.json").exists()


def test_serving_tools_without_a_server(mcp):
    async def go():
        async with Client(mcp) as c:
            status = (await c.call_tool("server_status", {})).structured_content
            stop = (await c.call_tool("stop_vllm_server", {})).structured_content
            patch = (await c.call_tool("patch_turing", {"action": "check"})).structured_content
            with pytest.raises(ToolError, match="no vLLM server is running"):
                await c.call_tool("run_sweep", {"output_dir": "sweeps"})
            with pytest.raises(ToolError, match="no server log"):
                await c.call_tool("server_logs", {})
            with pytest.raises(ToolError, match="outside the evidence roots"):
                await c.call_tool("compare_tokens", {"mode": "record", "reference": "/tmp/x.json",
                                                     "base_url": "http://127.0.0.1:9"})
            with pytest.raises(ToolError, match="no answer from|connect"):
                await c.call_tool("query_model", {"prompt": "hi"})
            return status, stop, patch

    status, stop, patch = run(go())
    assert status["alive"] is False and status["roots"]["models"]
    assert stop["was_running"] is False
    assert patch["target"].endswith("triton_unified_attention.py") and patch["applied"] in (True, False)
