"""The CPU walk over stdio with the default toolsets, from an empty models root and no step outside MCP: the
`deploy_cpu` prompt's tool calls (tools/mcp/resources.py) on real vLLM CPU servers of the tiny stand-in: make the
source, probe, repack both builds, start, record tokens, vram_status, stop, start the other, check, vram_status.
The memory figures are checked against the server's processes as psutil reads them from this test."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import psutil
import pytest
from fastmcp import Client
from fastmcp.client.transports import StdioTransport

from fixtures import free_port
from tools.mcp.resources import PROMPTS

ROOT = Path(__file__).resolve().parents[2]
TINY = {"compare_tokens": {"prompts": ["abcdefgh", "The quick brown fox"], "max_tokens": 12}}


def _group_rss_mib(pid: int) -> float:
    """RSS of the server's process group, read here: what the tools' figures must agree with."""
    pgid = os.getpgid(pid)
    total = 0
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                total += p.memory_info().rss
        except (OSError, psutil.Error):
            continue
    return total / 2**20


@pytest.mark.vllm
@pytest.mark.vllm_lane(0)  # evens out the two lanes (lane 1 holds the other long walks)
def test_stdio_cpu_walk_from_an_empty_models_root(tmp_path):
    models, evidence, state = tmp_path / "models", tmp_path / "evidence", tmp_path / "run"
    models.mkdir()
    evidence.mkdir()
    port = free_port()
    env = dict(os.environ, PORT=str(port), MAX_MODEL_LEN="512", MAX_NUM_SEQS="4", CPU_KVCACHE_SPACE_GIB="1",
               SPECULATIVE_CONFIG="", EXTRA_ARGS="", START_TIMEOUT_S="900")
    env.pop("GEMMA4_T4_TOOLSETS", None)  # the default set is enough
    transport = StdioTransport(command=sys.executable, cwd="/", env=env, keep_alive=False, args=[
        str(ROOT / "server.py"), "--models-root", str(models), "--evidence-root", str(evidence),
        "--state-dir", str(state)])
    spec = PROMPTS["deploy_cpu"]
    results: dict[int, dict] = {}
    measured: dict[int, float] = {}

    async def session() -> tuple[str, set[str]]:
        async with Client(transport, timeout=1200) as c:
            listed = {t.name for t in await c.list_tools()}
            text = (await c.get_prompt("deploy_cpu", {})).messages[0].content.text
            try:
                for i, step in enumerate(spec.bind(), 1):
                    if step.condition == "source_missing" and (models / step.args["out"]).exists():
                        continue
                    args = step.args if step.args.get("mode") == "check" else step.args | TINY.get(step.tool, {})
                    r = await c.call_tool(step.tool, args)
                    results[i] = r.structured_content
                    if step.tool == "vram_status":  # the server's group as this test reads it, at the same time
                        st = (await c.call_tool("server_status", {})).structured_content
                        measured[i] = _group_rss_mib(st["pid"])
            finally:
                await c.call_tool("stop_vllm_server", {"grace_s": 10})
        return text, listed

    text, listed = asyncio.run(session())
    assert text == spec.render()
    assert {s.tool for s in spec.steps} <= listed
    R = results
    assert R[1]["platform"] == "cpu"
    assert R[2]["path"] == str(models / "tiny-gemma4-qat") and R[3]["verdict"] == "qat"
    assert R[4]["output"] == str(models / "tiny-bf16-emb") and R[5]["output"] == str(models / "tiny-emb4")
    for i, build in ((6, "tiny-bf16-emb"), (10, "tiny-emb4")):
        start = R[i]
        assert start["platform"] == "cpu" and start["model"] == str(models / build)
        hm = start["host_memory"]
        assert hm["instance"] == "default" and start["pid"] in hm["pids"]
        assert hm["rss_mib"] > 0 and hm["weights_mib"] > 0 and "rss" in hm["method"]
        assert start["start_fields"].get("model_loading_gib") is None  # a GPU figure, not faked on CPU
    assert R[7]["summary"].startswith("recorded 2 prompts")
    assert R[11]["total"] == 2
    for i, build in ((8, "tiny-bf16-emb"), (12, "tiny-emb4")):
        vs = R[i]
        assert vs["available"] is False  # no NVIDIA GPU here: not an error
        [hm] = vs["host"]
        assert hm["instance"] == "default" and hm["rss_mib"] > 0 and hm["weights_mib"] > 0
        assert hm["weights_mib"] == pytest.approx(sum(f.stat().st_size for f in (models / build).glob(
            "*.safetensors")) / 2**20, abs=0.01)
        if hm["pss_mib"] is not None:  # smaps_rollup readable: our own processes on Linux
            assert 0 < hm["pss_mib"] <= hm["rss_mib"] * 1.01 and "smaps_rollup" in hm["method"]
        # true: the tool's RSS is the group's as read from here (the engine's resident set moves a little)
        assert hm["rss_mib"] == pytest.approx(measured[i], rel=0.25)
        assert "RSS" in vs["summary"] and "default" in vs["summary"]
    # the int4 embeddings make the all-4-bit build's weights smaller on disk
    assert R[12]["host"][0]["weights_mib"] < R[8]["host"][0]["weights_mib"]
