"""In-memory MCP client tests: every tool's schema and annotations, results, progress, jobs and errors."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError

from tools.mcp.app import Settings, create_server
from tools.core.paths import Roots

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_TOOLS = {
    # name: (readOnly, destructive, idempotent, openWorld)
    "vram_status": (True, False, True, False),
    "probe_checkpoint": (True, False, True, False),
    "plan_fit": (True, False, True, False),
    "server_status": (True, False, True, False),
    "server_logs": (True, False, True, False),
    "list_jobs": (True, False, True, False),
    "job_status": (True, False, True, False),
    "repack_checkpoint": (False, True, True, False),
    "start_vllm_server": (False, False, False, True),   # may download a hub model
    "stop_vllm_server": (False, True, True, False),
    "query_model": (True, False, False, False),
    "run_sweep": (False, False, False, True),           # any base_url
    "run_decode_bench": (False, False, False, True),    # any base_url
    "compare_tokens": (False, True, False, True),       # record (force=true) replaces a file; any base_url
    "compare_sweeps": (False, True, False, False),      # output (force=true) replaces a file
    "patch_turing": (False, True, True, False),
    "start_job": (False, True, False, True),
    "cancel_job": (False, True, True, False),
    "compare_logprobs": (False, True, False, True),     # record (force=true) replaces a file; any base_url
    "run_eval": (False, False, False, True),            # any base_url
    "compare_evals": (True, False, True, False),
    "preflight": (True, False, True, True),            # step fetch asks the hub
    "fetch_checkpoint": (False, False, True, True),     # the hub; the same fetch again changes nothing
    "start_router": (False, False, False, True),        # routes to any instance URL
    "router_status": (True, False, True, False),
    "stop_router": (False, True, True, False),
    "switch_build": (False, True, False, True),         # stops the build it replaces; may download a hub model
    "make_tiny_model": (False, True, True, False),     # replaces a folder it wrote only with force=true
    "find_capacity": (False, False, False, True),       # any base_url
    "enable_toolset": (True, False, True, False),       # this session's tool list only
}
# The spec's defaults for a hint a tool leaves out; a read-only tool's destructive and idempotent hints mean nothing.
HINT_DEFAULTS = (False, True, False, True)


def run(coro):
    return asyncio.run(coro)


def test_every_tool_is_listed_with_title_description_annotations_and_output_schema(mcp):
    async def go():
        async with Client(mcp) as c:
            return await c.list_tools()

    tools = {t.name: t for t in run(go())}
    assert set(tools) == set(EXPECTED_TOOLS)
    for name, hints in EXPECTED_TOOLS.items():
        t = tools[name]
        assert t.title and t.title != name, name
        assert t.description and len(t.description) > 60, name
        a = t.annotations
        listed = [a.read_only_hint, a.destructive_hint, a.idempotent_hint, a.open_world_hint]
        seen = tuple(d if v is None else v for v, d in zip(listed, HINT_DEFAULTS))
        if hints[0]:
            assert (seen[0], seen[3]) == (hints[0], hints[3]) and listed[1:3] == [None, None], name
        else:
            assert seen == hints, name
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
    assert not any("/etc" in e and "evil" in e for e in errors)


def test_jobs_unknown_and_bad_arguments(mcp):
    async def go():
        async with Client(mcp) as c:
            with pytest.raises(ToolError, match="no job 'job-99'"):
                await c.call_tool("job_status", {"job_id": "job-99"})
            with pytest.raises(ToolError, match="lost: the server restarted"):
                await c.call_tool("job_status", {"job_id": "job-000000-1"})
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
        "    async with Client(server.create_server(toolsets='all')) as c:\n"
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
    return create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}),
                         toolsets="all"), tmp_path / "models"


def test_probe_and_repack_with_progress(tiny_mcp, tiny_qat, tiny_base):
    mcp, models = tiny_mcp
    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress, total, message):
        seen.append((progress, total, message))

    async def go():
        async with Client(mcp) as c:
            probe = await c.call_tool("probe_checkpoint", {"path": str(tiny_qat)})
            base = await c.call_tool("probe_checkpoint", {"path": str(tiny_base)})
            full = await c.call_tool("probe_checkpoint", {"path": str(tiny_qat), "detail": True})
            answers = [full]
            while "for the next)" in answers[-1].structured_content["summary"]:
                answers.append(await c.call_tool("probe_checkpoint", {"path": str(tiny_qat), "detail": True,
                                                                      "page": len(answers) + 1}))
            with pytest.raises(ToolError, match="page"):
                await c.call_tool("probe_checkpoint", {"path": str(tiny_qat), "detail": True,
                                                       "page": len(answers) + 1})
            rep = await c.call_tool("repack_checkpoint", {"source": str(tiny_qat), "output": "emb4"},
                                    progress_handler=on_progress)
            with pytest.raises(ToolError, match="exists") as again:
                await c.call_tool("repack_checkpoint", {"source": str(tiny_qat), "output": "emb4"})
            # worded for MCP: the argument, not the command-line flag
            assert "force=true" in str(again.value) and "--force" not in str(again.value)
            assert "output: " in str(again.value) and "source: " not in str(again.value)  # the output's refusal
            with pytest.raises(ToolError, match="off the 4-bit grid"):
                await c.call_tool("repack_checkpoint", {"source": str(tiny_base), "output": "base-emb4"})
            return (probe.structured_content, base.structured_content, rep.structured_content,
                    [a.structured_content for a in answers], [sum(len(t.text) for t in a.content) for a in answers])

    probe, base, rep, paged, sizes = run(go())
    assert probe["verdict"] == "qat" and probe["text_off_grid"] == 0
    # the towers are off the grid (not QAT-trained) but never packed: counted, not listed, and the result is small
    assert probe["blockers"] == [] and probe["towers_off_grid"] > 0 and "tensors" not in probe
    assert len(json.dumps(probe)) < 1000, len(json.dumps(probe))
    assert base["verdict"] in ("base", "mixed") and base["blockers"]
    assert not [t for t in base["blockers"] if t["name"].startswith("model.audio_tower.")]
    assert 0 < len(base["blockers"]) <= 10 <= base["text_off_grid"] and len(json.dumps(base)) < 4000
    # every tensor on request, in pages within 4,000 characters each (once one answer of 36-58K on E2B)
    tensors = [t for page in paged for t in page["tensors"]]
    assert len(paged) > 1 and max(sizes) <= 4000
    assert [p["summary"].rsplit("(", 1)[1] for p in paged] == [
        f"page {n} of {len(paged)}: page={n + 1} for the next)" for n in range(1, len(paged))] + [
        f"page {len(paged)} of {len(paged)}, the last)"]
    assert len(tensors) == paged[0]["tensor_count"] and len({t["name"] for t in tensors}) == len(tensors)
    assert any(t["tower"] and t["on_grid"] is False for t in tensors) and "clipped" not in paged[0]
    assert "tensors 1-" in paged[0]["summary"]
    assert rep["output"] == str(models / "emb4")
    tables = {t["name"]: t for t in rep["tables"]}
    assert tables["embed_tokens"]["groups"] > 0 and tables["lm_head"]["groups"] > 0
    assert all(t["offgrid_groups"] == 0 for t in rep["tables"])
    assert all(t["nonfinite_values"] == 0 for t in rep["tables"])  # the library's field reaches MCP clients
    assert rep["total_bytes_after"] < rep["total_bytes_before"]
    cfg = json.loads((models / "emb4" / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized" and cfg["tie_word_embeddings"] is False
    # progress was streamed, reached its total and counted up
    assert len(seen) >= 2 and seen[-1][0] == seen[-1][1]
    assert [p for p, _, _ in seen] == sorted(p for p, _, _ in seen)
    # the off-grid source left nothing behind
    assert not (models / "base-emb4").exists()


def test_repack_as_job_then_busy_rule(tiny_mcp, tiny_qat, monkeypatch):
    import threading

    from repack.build import build

    mcp, models = tiny_mcp
    checked, real = threading.Event(), build.build_checkpoint

    def held(*args, **kwargs):  # the job is still running when the second call comes, however fast the build
        checked.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "build_checkpoint", held)

    async def go():
        async with Client(mcp) as c:
            job = (await c.call_tool("start_job", {"tool": "repack_checkpoint", "arguments": {
                "source": str(tiny_qat), "output": "text", "embed_int4": False}})).structured_content
            assert job["state"] == "running" and job["tool"] == "repack_checkpoint"
            # one long operation at a time, foreground or background
            try:
                with pytest.raises(ToolError, match=f"repack_checkpoint \\({job['job_id']}\\) is running"):
                    await c.call_tool("repack_checkpoint", {"source": str(tiny_qat), "output": "other"})
            finally:
                checked.set()
            done = (await c.call_tool("job_status", {"job_id": job["job_id"], "wait_s": 120})).structured_content
            listing = (await c.call_tool("list_jobs", {})).structured_content
            # an output that exists is refused before any job starts: the repack's own output check, in its
            # preflight
            with pytest.raises(ToolError) as bad:
                await c.call_tool("start_job", {"tool": "repack_checkpoint", "arguments": {
                    "source": str(tiny_qat), "output": "text"}})
            return done, listing, str(bad.value)

    done, listing, bad = run(go())
    assert done["state"] == "succeeded", done
    assert done["result"]["output"] == str(models / "text")
    assert {t["name"]: t["groups"] for t in done["result"]["tables"]}.get("embed_tokens", 0) == 0
    assert done["progress"] == done["total"] and done["elapsed_s"] > 0
    assert [j["job_id"] for j in listing["jobs"]] == [done["job_id"]]
    assert "exists" in bad and "force=true" in bad, bad
    assert len(listing["jobs"]) == 1
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
    # a tiny repack may finish before the cancel lands: then the job is still cancelled (never succeeded after a
    # cancel), says so, and keeps the result of the finished build; otherwise nothing is left
    assert info["state"] in ("cancelled", "succeeded")  # succeeded: it ended before cancel_job was called
    if info["state"] == "succeeded" or info["message"] == "cancelled after the work had ended: see result":
        assert info["result"] and (models / "cancelled" / "config.json").exists()
    else:
        assert not (models / "cancelled").exists()


def test_serving_tools_without_a_server(mcp):
    async def go():
        async with Client(mcp) as c:
            status = (await c.call_tool("server_status", {})).structured_content
            stop = (await c.call_tool("stop_vllm_server", {})).structured_content
            patch = (await c.call_tool("patch_turing", {"action": "check"})).structured_content
            with pytest.raises(ToolError, match="no vLLM server is running"):
                await c.call_tool("run_sweep", {"out": "sweeps"})
            with pytest.raises(ToolError, match="no server log"):
                await c.call_tool("server_logs", {})
            with pytest.raises(ToolError, match="outside the evidence roots"):
                await c.call_tool("compare_tokens", {"mode": "record", "reference": "/tmp/x.json",
                                                     "base_url": "http://127.0.0.1:9"})
            with pytest.raises(ToolError, match="no vLLM server is running; start one with start_vllm_server"):
                await c.call_tool("query_model", {"prompt": "hi"})
            with pytest.raises(ToolError, match="mode check needs reference"):
                await c.call_tool("compare_tokens", {"mode": "check"})
            return status, stop, patch

    status, stop, patch = run(go())
    assert status["alive"] is False and status["roots"]["models"]
    assert stop["was_running"] is False
    assert patch["target"].endswith("triton_unified_attention.py") and patch["applied"] in (True, False)


@pytest.mark.parametrize("how", ["direct", "start_job"])
@pytest.mark.parametrize("tool", ["run_sweep", "run_decode_bench"])
def test_a_measurement_resolves_the_endpoint_and_reads_the_config_once(mcp, monkeypatch, tool, how):
    """One run_sweep (or run_decode_bench) call shapes its request once, called directly or through start_job
    (whose check's result is the job's input): one endpoint resolution and one read of tpu.env, which the
    measurement itself does not repeat (here it fails fast after them: nothing answers at the URL)."""
    import tools.measure.decode.run as decode_mod
    import tools.measure.sweep.run as sweep_mod
    import tools.mcp.app as app_mod
    import tools.mcp.measure_tools as measure_tools
    import tools.measure.endpoint as endpoint_mod

    calls = {"resolve": 0, "config": 0}

    def counting_resolve(*a, **kw):
        calls["resolve"] += 1
        return endpoint_mod.resolve_endpoint(*a, **kw)

    def counting_config(*a, **kw):
        calls["config"] += 1
        return load_config(*a, **kw)

    load_config = app_mod.load_config
    for mod in (measure_tools, sweep_mod, decode_mod):
        monkeypatch.setattr(mod, "resolve_endpoint", counting_resolve)
    monkeypatch.setattr(app_mod, "load_config", counting_config)
    args = {"out": "sweeps" if tool == "run_sweep" else "decode", "base_url": "http://127.0.0.1:9"}

    async def go():
        async with Client(mcp) as c:
            if how == "direct":
                with pytest.raises(ToolError):
                    await c.call_tool(tool, args)
                return
            job = (await c.call_tool("start_job", {"tool": tool, "arguments": args})).structured_content
            done = (await c.call_tool("job_status", {"job_id": job["job_id"], "wait_s": 60})).structured_content
            assert done["state"] == "failed" and done["error"]

    run(go())
    assert calls == {"resolve": 1, "config": 1}


# ------------------------------------------------------------------------------ toolsets, schemas, registry


def _names(mcp) -> set[str]:
    async def go():
        async with Client(mcp) as c:
            return {t.name: t for t in await c.list_tools()}

    return run(go())


def test_toolsets_filter_what_is_listed(roots, tmp_path, monkeypatch):
    settings = Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")})
    only_repack = _names(create_server(settings, toolsets="repack"))
    assert set(only_repack) == {"make_tiny_model", "probe_checkpoint", "repack_checkpoint", "enable_toolset"}
    # "default" names the default set among others
    assert set(_names(create_server(settings, toolsets="default,gpu"))) == (
        set(_names(create_server(settings))) | {"patch_turing"})
    monkeypatch.setenv("GEMMA4_T4_TOOLSETS", "serve,jobs")
    from_env = _names(create_server(settings))
    assert "start_vllm_server" in from_env and "list_jobs" in from_env and "repack_checkpoint" not in from_env
    # start_job offers exactly the long tools of the listed toolsets
    prop = from_env["start_job"].input_schema["properties"]["tool"]
    assert prop.get("enum", [prop.get("const")]) == ["start_vllm_server"]
    with pytest.raises(ValueError, match="unknown toolset nope"):
        create_server(settings, toolsets="repack,nope")


def test_a_tool_of_a_toolset_not_listed_is_one_call_away(roots, tmp_path):
    """From the default set: calling find_capacity names its toolset and enable_toolset; enable_toolset lists it in
    this session (tools/list_changed sent) and the call then reaches the tool; the instructions say where to start
    and how to reach other toolsets."""
    settings = Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")})
    seen: list[str] = []

    async def on_message(msg):
        seen.append(type(msg).__name__)

    async def go():
        async with Client(create_server(settings), message_handler=on_message) as c:
            before = {t.name for t in await c.list_tools()}
            refused = await c.call_tool("find_capacity", {}, raise_on_error=False)
            enabled = await c.call_tool("enable_toolset", {"toolset": "capacity"})
            after = {t.name for t in await c.list_tools()}
            reached = await c.call_tool("find_capacity", {}, raise_on_error=False)
            return c.instructions, before, refused, enabled, after, reached

    text, before, refused, enabled, after, reached = run(go())
    assert "find_capacity" not in before and "enable_toolset" in before
    assert refused.is_error and "toolset capacity" in refused.content[0].text
    assert "enable_toolset" in refused.content[0].text
    assert refused.structured_content["detail"]["enable"] == {"tool": "enable_toolset",
                                                             "arguments": {"toolset": "capacity"}}
    assert enabled.structured_content["tools"] == ["find_capacity"]
    assert after - before == {"find_capacity"} and "ToolListChangedNotification" in seen
    assert reached.is_error and "not listed" not in reached.content[0].text  # the tool ran: no server to measure
    assert "deploy_cpu" in text and "enable_toolset" in text and "capacity" in text
    # a name no toolset declares is still answered as unknown
    async def unknown():
        async with Client(create_server(settings)) as c:
            return await c.call_tool("no_such_tool", {}, raise_on_error=False)

    assert "Unknown tool" in run(unknown()).content[0].text


def test_prompt_arguments_carry_no_generated_schema_note(mcp):
    async def go():
        async with Client(mcp) as c:
            return await c.list_prompts()

    for p in run(go()):
        for a in p.arguments or []:
            assert a.description and "JSON schema" not in a.description, (p.name, a.name)


def test_library_fields_reach_mcp_clients(mcp, tmp_path):
    """No mirrored result models: a field the library adds (here the engine's compile-cache note) is in the
    structured content without any MCP-side edit."""
    import time as _time

    from tools.serving.records.state import ServerState, write_state

    cfg = mcp.gemma.config()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    log = tmp_path / "vllm.log"
    log.write_text("INFO 11-29 10:00:00 [backends.py:1] Compiling model again due to a load failure from "
                   "/cache/x, reason: hash mismatch\n")
    write_state(cfg, ServerState(pid=dead.pid, pgid=dead.pid, create_time=_time.time() - 10, host=cfg.host,
                                  port=cfg.port, base_url=cfg.base_url, model="m", served_name="m", argv=["x"],
                                  platform="cpu", started_at="2026-01-01T00:00:00+00:00",
                                  started_ts=_time.time() - 10, log_path=str(log)))

    async def go():
        async with Client(mcp) as c:
            return (await c.call_tool("server_status", {})).structured_content

    st = run(go())
    assert st["died"] is True
    assert st["start_fields"]["compile_cache_note"].endswith("hash mismatch")


def test_readme_tool_table_matches_the_registry():
    from tools.mcp.catalog import load_all
    from tools.mcp.readme import tool_table

    doc = (ROOT / "docs" / "mcp.md").read_text()
    assert tool_table(load_all()) in doc, "docs/mcp.md's tool table is stale: run python -m tools.mcp.readme"


def test_default_toolsets_list_stays_lean(roots, tmp_path):
    """Every agent that connects pays for tools/list: the default set holds the walk (the five named tools,
    preflight and the CPU stand-in) within 20,000 characters, measured as bench/bench_tools_list.py measures."""
    from tools.mcp.app import create_server as make

    async def go():
        async with Client(make(Settings(roots=roots))) as c:
            res = await c.session.list_tools()
            return res.model_dump(by_alias=True, exclude_none=True)

    listed = run(go())
    assert len(json.dumps(listed, separators=(",", ":"))) <= 20_000
    names = {t["name"] for t in listed["tools"]}
    assert {"repack_checkpoint", "start_vllm_server", "vram_status", "run_sweep", "compare_tokens", "preflight",
            "probe_checkpoint", "make_tiny_model", "stop_vllm_server"} <= names
    for t in listed["tools"]:  # nothing repeated in every tool: `summary` is said once, in the instructions
        assert "required" not in t["outputSchema"] and "_meta" not in t, t["name"]


def test_argument_descriptions_are_worded_for_mcp(mcp):
    """An argument's description names tools and arguments, never a command line or its flags: a client cannot run
    `./vllm-t4 router`, and `--source` is `source` here."""
    async def go():
        async with Client(mcp) as c:
            return await c.list_tools()

    for t in run(go()):
        for name, prop in t.input_schema.get("properties", {}).items():
            text = prop.get("description", "")
            assert "./vllm-t4" not in text and not re.search(r"(^|[\s(])--[a-z]", text), (t.name, name, text)


# ------------------------------------------------------------------------------ jobs


def test_many_waiting_clients_hold_no_worker_thread(mcp):
    """45 job_status waits on a running job, then a quick tool: it answers while every wait is still pending."""
    import threading

    app = mcp.gemma
    release = threading.Event()
    job = app.jobs.submit("demo", {}, lambda progress: (release.wait(60), {"ok": True})[1])

    async def go():
        async with Client(mcp) as c:
            waits = [asyncio.create_task(c.call_tool("job_status", {"job_id": job.job_id, "wait_s": 60}))
                     for _ in range(45)]
            await asyncio.sleep(0.5)  # let every wait reach the server
            vram = await asyncio.wait_for(c.call_tool("vram_status", {}), 30)
            pending = sum(not w.done() for w in waits)
            release.set()
            done = await asyncio.gather(*waits)
            return vram, pending, done

    vram, pending, done = run(go())
    assert vram.structured_content["summary"]
    assert pending == 45  # the quick call did not wait for the waits to time out or end
    assert all(d.structured_content["state"] == "succeeded" for d in done)


def test_start_job_says_jobs_die_with_the_server(mcp):
    tools = _names(mcp)
    assert "die with it" in tools["start_job"].description


# ------------------------------------------------------------------------------ paths and destructive outputs


def test_model_is_a_folder_under_the_roots_or_a_hub_id(mcp, tmp_path, monkeypatch):
    work = tmp_path / "workspace"
    (work / "evidence" / "article-t4").mkdir(parents=True)
    monkeypatch.chdir(work)  # the MCP client started the server from its own workspace

    async def go():
        async with Client(mcp) as c:
            errors = []
            for model in ("evidence/article-t4", "tools/..", "../workspace/evidence/article-t4"):
                with pytest.raises(ToolError) as ei:
                    await c.call_tool("start_vllm_server", {"model": model})
                errors.append(str(ei.value))
            return errors

    errors = run(go())
    assert "names a local folder outside the models roots" in errors[0]
    assert "not a checkpoint folder" in errors[1]  # resolved against the root: the root itself
    assert "outside the models roots" in errors[2]


def test_errors_echo_little_of_an_input_and_hide_symlink_targets(mcp, roots, tmp_path):
    secret = tmp_path / "very-secret-place"
    secret.mkdir()
    (roots.models[0] / "escape").symlink_to(secret)

    async def go():
        async with Client(mcp) as c:
            with pytest.raises(ToolError) as long_err:
                await c.call_tool("probe_checkpoint", {"path": "/x" + "a" * 5000})
            with pytest.raises(ToolError) as link_err:
                await c.call_tool("probe_checkpoint", {"path": "escape"})
            return str(long_err.value), str(link_err.value)

    long_msg, link_msg = run(go())
    assert long_msg.count("a") < 260 and len(long_msg) < 600
    assert "outside the models roots" in link_msg and "very-secret-place" not in link_msg


def _stand_in_run(folder: Path, label: str, tok_s: float) -> Path:
    from tools.measure.sweep.params import CellResult, SweepResult
    from tools.measure.sweep.report import write_run

    res = SweepResult(run_id=folder.name, run_dir=str(folder), label=label, params={}, started="2026-01-01",
                      finished="2026-01-01",
                      cells=[CellResult(input_len=32, output_len=8, concurrency=1, num_prompts=2, status="ok",
                                        median={"output_throughput": tok_s})])
    folder.mkdir(parents=True)
    write_run(res, folder, plot=False)
    return folder


def test_compare_sweeps_never_overwrites_unless_forced_and_never_an_input(mcp, roots):
    ev = roots.evidence[0]
    a, b = _stand_in_run(ev / "run-a", "a", 10.0), _stand_in_run(ev / "run-b", "b", 20.0)
    summary_before = (a / "summary.json").read_text()

    async def go():
        async with Client(mcp) as c:
            args = {"run_dirs": [str(a), str(b)], "output": "cmp.md"}
            first = (await c.call_tool("compare_sweeps", args)).structured_content
            with pytest.raises(ToolError, match="exists; pass force=true") as again:
                await c.call_tool("compare_sweeps", args)
            forced = (await c.call_tool("compare_sweeps", {**args, "force": True})).structured_content
            with pytest.raises(ToolError, match="inside the input run folder"):
                await c.call_tool("compare_sweeps", {**args, "output": str(a / "summary.md"), "force": True})
            return first, str(again.value), forced

    first, again, forced = run(go())
    assert first["report_path"] == str(ev / "cmp.md") and forced["report_path"] == first["report_path"]
    assert "--force" not in again
    assert (a / "summary.json").read_text() == summary_before


def test_compare_sweeps_says_where_each_run_was_measured_and_how_cost_was_priced(mcp, roots):
    ev = roots.evidence[0]
    a, b = _stand_in_run(ev / "run-a", "a", 10.0), _stand_in_run(ev / "run-b", "b", 20.0)
    for folder, root in ((a, "/m/tiny-bf16-emb"), (b, "/m/tiny-emb4")):  # both measured on a CPU
        data = json.loads((folder / "summary.json").read_text())
        data["provenance"] = {"gpu_count": 0, "cpu_model": "Intel Xeon", "server": {"model_root": root}}
        (folder / "summary.json").write_text(json.dumps(data))

    async def go():
        async with Client(mcp) as c:
            default = (await c.call_tool("compare_sweeps", {"run_dirs": [str(a), str(b)]})).structured_content
            priced = (await c.call_tool("compare_sweeps", {"run_dirs": [str(a), str(b)],
                                                           "price_per_hour": 0.1})).structured_content
            return default, priced

    default, priced = run(go())
    assert default["measured_on"] == {"a": "CPU stand-in (vLLM CPU backend, Intel Xeon), build tiny-bf16-emb",
                                      "b": "CPU stand-in (vLLM CPU backend, Intel Xeon), build tiny-emb4"}
    assert "a: CPU stand-in (vLLM CPU backend, Intel Xeon), build tiny-bf16-emb" in default["summary"]
    assert "applied to this CPU's throughput, not a T4 cost" in default["summary"]
    assert priced["cost_basis"] == "$0.1/h" and "cost at $0.1/h" in priced["summary"]


def test_compare_sweeps_refuses_a_summary_linked_out_of_the_roots(mcp, roots, tmp_path):
    ev = roots.evidence[0]
    a = _stand_in_run(ev / "run-a", "a", 10.0)
    outside = _stand_in_run(tmp_path / "outside-run", "secret-label", 99.0)
    (ev / "run-link").mkdir()  # a real folder inside the root, its summary a link out of it
    (ev / "run-link" / "summary.json").symlink_to(outside / "summary.json")

    (err,) = _refusals(mcp, [("compare_sweeps", {"run_dirs": [str(a), "run-link"]})])
    assert "run_dir run-link" in err and "outside the evidence roots" in err
    assert "secret-label" not in err and "outside-run" not in err


def test_compare_tokens_record_refuses_an_existing_file(mcp, roots):
    ref = roots.evidence[0] / "tokens.json"
    ref.write_text("keep me\n")

    async def go():
        async with Client(mcp) as c:
            with pytest.raises(ToolError, match="exists; pass force=true"):
                await c.call_tool("compare_tokens", {"mode": "record", "reference": "tokens.json",
                                                     "base_url": "http://127.0.0.1:9"})

    run(go())
    assert ref.read_text() == "keep me\n"


# ------------------------------------------------------------------------------ fidelity, eval, deploy


def _refusals(mcp, calls):
    async def go():
        out = []
        async with Client(mcp) as c:
            for tool, args in calls:
                with pytest.raises(ToolError) as ei:
                    await c.call_tool(tool, args)
                out.append(str(ei.value))
        return out

    return run(go())


def test_compare_logprobs_confines_its_paths_and_refuses_an_existing_record(mcp, roots, tmp_path):
    ev = roots.evidence[0]
    ref = ev / "REF.json"
    ref.write_text("keep me\n")
    outside = tmp_path / "corpus.txt"
    outside.write_text("text outside the roots " * 50)
    dead = "http://127.0.0.1:9"
    errors = _refusals(mcp, [
        ("compare_logprobs", {"mode": "record", "reference": "/tmp/evil.json", "base_url": dead}),
        ("compare_logprobs", {"mode": "record", "reference": "new.json", "corpus": str(outside), "base_url": dead}),
        ("compare_logprobs", {"mode": "check", "reference": "missing.json", "base_url": dead}),
        ("compare_logprobs", {"mode": "record", "reference": "REF.json", "base_url": dead}),
    ])
    assert "reference" in errors[0] and "outside the evidence roots" in errors[0]
    assert "corpus" in errors[1] and "outside the evidence roots" in errors[1]
    assert "does not exist under the evidence roots" in errors[2]
    assert "exists; pass force=true" in errors[3] and "--force" not in errors[3]
    assert ref.read_text() == "keep me\n" and not (ev / "new.json").exists()
    # The shipped corpus is allowed by its path; the server refusal then comes from the library.
    from tools.measure.fidelity.files import DEFAULT_CORPUS

    (err,) = _refusals(mcp, [("compare_logprobs", {"mode": "record", "reference": "new.json",
                                                   "corpus": str(DEFAULT_CORPUS), "base_url": dead})])
    assert "outside" not in err and dead in err
    assert not (ev / "new.json").exists()


def test_run_eval_confines_its_paths_and_refuses_without_a_server(mcp, roots, tmp_path):
    from tests.helpers.fixtures import free_port

    url = f"http://127.0.0.1:{free_port()}"
    (tmp_path / "tasks").mkdir()
    errors = _refusals(mcp, [
        ("run_eval", {"tasks": ["tiny_pattern_mc"], "out": "/tmp/evil", "base_url": url}),
        ("run_eval", {"tasks": ["tiny_pattern_mc"], "include_path": str(tmp_path / "tasks"), "base_url": url}),
        ("run_eval", {"tasks": ["tiny_pattern_mc"], "tokenizer": "/etc", "base_url": url}),
        ("run_eval", {"tasks": ["tiny_pattern_mc"], "base_url": url}),
    ])
    assert "out" in errors[0] and "outside the evidence roots" in errors[0]
    assert "include_path" in errors[1] and "outside the evidence roots" in errors[1]
    assert "tokenizer" in errors[2] and "Extra inputs are not permitted" in errors[2]
    assert url in errors[3] and "start_vllm_server" in errors[3] and "--base-url" not in errors[3]
    assert list(roots.evidence[0].iterdir()) == []  # no run folder left behind


def test_compare_evals_reads_runs_under_the_evidence_roots_only(mcp, roots, tmp_path):
    from tests.helpers.fixtures import stand_in_eval_run

    ev = roots.evidence[0]
    a = stand_in_eval_run(ev / "a", "ref", {i: float(i % 2) for i in range(20)})
    stand_in_eval_run(ev / "b", "cand", {i: 1.0 for i in range(20)})
    outside = stand_in_eval_run(tmp_path / "outside", "x", {i: 1.0 for i in range(20)})

    async def go():
        async with Client(mcp) as c:
            return (await c.call_tool("compare_evals", {"runs": [str(a), "b"]})).structured_content

    data = run(go())
    assert [r["label"] for r in data["runs"]] == ["ref", "cand"]
    (row,) = data["rows"]
    assert row["candidate"] == "cand" and row["paired"] is True and abs(row["diff"] - 0.5) < 1e-9
    assert data["summary"].startswith("compared 2 eval runs over 1 rows")
    (err,) = _refusals(mcp, [("compare_evals", {"runs": [str(a), str(outside)]})])
    assert "outside the evidence roots" in err


def test_compare_evals_refuses_run_files_linked_out_of_the_roots(mcp, roots, tmp_path):
    import json

    from tests.helpers.fixtures import stand_in_eval_run

    ev = roots.evidence[0]
    stand_in_eval_run(ev / "a", "ref", {i: float(i % 2) for i in range(20)})
    outside = stand_in_eval_run(tmp_path / "outside", "secret-label", {i: 1.0 for i in range(20)})
    (ev / "linked").mkdir()  # a real folder inside the root whose files link to a run outside
    for f in outside.iterdir():
        (ev / "linked" / f.name).symlink_to(f)
    # summary.json itself inside, its samples entry a link (in a subfolder) out of the roots
    inner = stand_in_eval_run(ev / "inner", "inner", {i: 1.0 for i in range(20)})
    samples = next((inner / "lm_eval" / "m").iterdir())
    samples.unlink()
    samples.symlink_to(next((outside / "lm_eval" / "m").iterdir()))
    # an entry naming a file outside the run folder
    dotdot = stand_in_eval_run(ev / "dotdot", "dotdot", {i: 1.0 for i in range(20)})
    s = json.loads((dotdot / "summary.json").read_text())
    s["files"]["samples:t"] = str(dotdot) + "/../../outside/lm_eval/m/" + samples.name
    (dotdot / "summary.json").write_text(json.dumps(s))

    errors = _refusals(mcp, [("compare_evals", {"runs": ["a", name]}) for name in ("linked", "inner", "dotdot")])
    assert "run " in errors[0] and "outside the evidence roots" in errors[0]
    assert "run " in errors[1] and "outside the evidence roots" in errors[1]
    assert "not a file inside the run folder" in errors[2]
    assert not any("secret-label" in e for e in errors)


def test_preflight_on_this_machine_is_a_result(mcp, tmp_path):
    async def go():
        async with Client(mcp) as c:
            return await c.call_tool("preflight", {"step": "repack", "source": "qat", "out": "build"})

    r = run(go())
    assert r.is_error is False
    data = r.structured_content
    names = [c["name"] for c in data["checks"]]
    assert names == ["source", "disk"]
    source = data["checks"][0]
    assert source["status"] == "fail" and str(tmp_path / "models" / "qat") in source["value"]
    assert data["ready"] is False and data["failed"] == ["source"] and data["summary"] == r.content[0].text
    errors = _refusals(mcp, [("preflight", {"step": "repack", "source": "/etc"}),
                             ("preflight", {"step": "repack", "out": "/tmp/evil"}),
                             ("preflight", {"env_file": "/etc/passwd"})])
    assert "outside the models roots" in errors[0] and "outside the models roots" in errors[1]
    assert "env_file" in errors[2] and "Extra inputs are not permitted" in errors[2]


def test_preflight_start_checks_the_model_about_to_start(mcp, tmp_path):
    """preflight(step=start, model=X) checks X, resolved as start_vllm_server resolves it, not MODEL_NAME."""
    (tmp_path / "models" / "emb4").mkdir()
    (tmp_path / "models" / "emb4" / "config.json").write_text("{}")

    async def go():
        async with Client(mcp) as c:
            return [(await c.call_tool("preflight", {"step": "start", "model": m})).structured_content
                    for m in ("emb4", "missing")]

    given, missing = (next(c for c in r["checks"] if c["name"] == "checkpoints") for r in run(go()))
    assert given["status"] == "ok" and given["detail"]["model"] == str(tmp_path / "models" / "emb4")
    # the builds listed are the models root's (the server's --models-root), not the project's models/ folder
    assert f"builds in {tmp_path / 'models'}: emb4;" in given["value"], given["value"]
    assert given["detail"]["builds"] == [str(tmp_path / "models" / "emb4")]
    assert missing["status"] == "fail" and "make_tiny_model" in missing["fix"]  # named with the tool that makes it
    errors = _refusals(mcp, [("preflight", {"step": "start", "model": "/etc"})])
    assert "outside the models roots" in errors[0]


def test_fetch_checkpoint_publishes_under_the_models_root(mcp, roots, tmp_path, monkeypatch):
    from tests.helpers.stand_ins.hub import COMMIT, REPO, StandInHub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    files = {"config.json": b'{"model_type": "gemma4"}', "model.safetensors": bytes(range(256)) * 64,
             "tokenizer.json": b"{}", "README.md": b"# not a build file"}
    seen = []

    async def on_progress(done, total, message):
        seen.append((done, total, message))

    async def go():
        async with Client(mcp, progress_handler=on_progress) as c:
            return (await c.call_tool("fetch_checkpoint", {"repo_id": REPO})).structured_content

    with StandInHub(files) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        data = run(go())
        errors = _refusals(mcp, [("fetch_checkpoint", {"repo_id": REPO, "out": "/tmp/evil"}),
                                 ("fetch_checkpoint", {"repo_id": "../etc/passwd"}),
                                 ("fetch_checkpoint", {"repo_id": REPO, "roots": ["/"]})])
    out = roots.models[0] / "gemma-4-tiny-qat"
    assert data["out"] == str(out) and data["commit"] == COMMIT and not data["already_present"]
    assert sorted(f["path"] for f in data["files"]) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert seen and seen[-1][0] == seen[-1][1]  # progress in bytes, to the end
    assert "outside the models roots" in errors[0] and not Path("/tmp/evil").exists()
    assert "not owner/name" in errors[1]
    assert "roots" in errors[2] and "Extra inputs are not permitted" in errors[2]


@pytest.mark.vllm
def test_run_eval_through_mcp_scores_the_served_tiny_model(mcp, roots, emb4_server, monkeypatch):
    """One MCP call runs lm-eval against the live server and returns lm-eval's own scores with stderr; the run
    folder (lm-eval's results JSON, samples, summary, provenance) lands under the evidence root."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    async def go():
        async with Client(mcp) as c:
            return (await c.call_tool("run_eval", {"tasks": ["tiny_pattern_mc"], "label": "mcp-emb4",
                                                   "base_url": emb4_server.base_url})).structured_content

    data = run(go())
    (score,) = [s for s in data["scores"] if s["metric"] == "acc"]
    assert score["task"] == "tiny_pattern_mc" and score["n"] == 17 and score["stderr"] is not None
    assert score["value"] > 0.25 + 3 * score["stderr"]  # four choices: measurably above chance
    run_dir = Path(data["run_dir"])
    assert run_dir.parent == roots.evidence[0]
    results = json.loads(Path(data["files"]["lm_eval_results"]).read_text())
    assert results["results"]["tiny_pattern_mc"]["acc,none"] == score["value"]
    assert (run_dir / "summary.md").is_file() and (run_dir / "provenance.json").is_file()


def test_a_refusal_while_busy_names_the_way_to_wait_for_what_holds_the_slot():
    """job_status and cancel_job follow jobs only: a long direct call holding the slot is not pointed at them."""
    import threading

    from tools.mcp.jobs import Busy, JobRegistry

    jobs = JobRegistry()
    with jobs.exclusive("run_sweep"):
        with pytest.raises(Busy) as direct:
            jobs.submit("switch_build", {}, lambda progress: {})
    assert "run_sweep is running (a direct call, not a job); call again once it has returned" in str(direct.value)
    assert "job_status job_id" not in str(direct.value)
    release = threading.Event()
    job = jobs.submit("run_sweep", {}, lambda progress: release.wait(30) and {})
    try:
        with pytest.raises(Busy) as queued, jobs.exclusive("switch_build"):
            pass
    finally:
        release.set()
    assert f"run_sweep ({job.job_id}) is running; wait for it (job_status job_id={job.job_id})" in str(queued.value)
    assert jobs.wait(job.job_id, 30).state == "succeeded"


@pytest.mark.parametrize("record", ["vllm.json", "router.json"])
def test_query_model_names_a_damaged_record_as_the_command_line_does(mcp, tmp_path, record):
    """With the default or the router record damaged, query_model said "no vLLM server is running" where the
    command line's query names the damaged file: both say it now, and nothing is sent anywhere."""
    state_dir = tmp_path / "run"
    state_dir.mkdir()
    (state_dir / record).write_text("garbage\n")

    async def go():
        async with Client(mcp) as c:
            return await c.call_tool("query_model", {"prompt": "hi"}, raise_on_error=False)

    res = run(go())
    text = res.content[0].text
    assert res.is_error and str(state_dir / record) in text and "damaged" in text, text
    assert "no vLLM server is running" not in text
