"""One stdio session, as an MCP client launches the server, doing the whole article on the tiny model with the
real vLLM server (CPU backend here): probe -> repack -> start -> status -> query -> compare_tokens (record, check)
-> short run_sweep -> compare_sweeps -> logs -> stop. Shares nothing with other tests' servers."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.client.transports import StdioTransport

from fixtures import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.vllm
def test_stdio_session_runs_the_article_on_the_tiny_model(tiny_qat, tmp_path):
    models, evidence, state = tmp_path / "models", tmp_path / "evidence", tmp_path / "run"
    models.mkdir()
    evidence.mkdir()
    # Serving settings for the tiny model, the way a user overrides tpu.env: environment variables.
    env = dict(os.environ, PORT=str(free_port()), MAX_MODEL_LEN="512", MAX_NUM_SEQS="4", CPU_KVCACHE_SPACE_GIB="1",
               SPECULATIVE_CONFIG="", EXTRA_ARGS="", START_TIMEOUT_S="900")
    transport = StdioTransport(command=sys.executable, cwd="/", env=env, keep_alive=False, args=[
        str(ROOT / "server.py"), "--toolsets", "all", "--models-root", str(models), "--models-root", str(tiny_qat.parent),
        "--evidence-root", str(evidence), "--state-dir", str(state)])
    progress: dict[str, list[float]] = {}

    def recorder(name):
        async def on_progress(p, total, message):
            progress.setdefault(name, []).append(p)
        return on_progress

    async def session() -> dict:
        out: dict = {}
        async with Client(transport, timeout=1200) as c:
            try:
                out["tools"] = {t.name for t in await c.list_tools()}
                out["probe"] = (await c.call_tool("probe_checkpoint", {"path": str(tiny_qat)})).structured_content
                out["repack"] = (await c.call_tool("repack_checkpoint", {"source": str(tiny_qat), "output": "emb4"},
                                                   progress_handler=recorder("repack"))).structured_content
                out["start"] = (await c.call_tool("start_vllm_server", {"model": "emb4", "served_name": "tiny-emb4"},
                                                  progress_handler=recorder("start"))).structured_content
                out["status"] = (await c.call_tool("server_status", {})).structured_content
                out["vram"] = (await c.call_tool("vram_status", {})).structured_content
                out["query"] = (await c.call_tool("query_model", {"prompt": "abcdef", "max_tokens": 8})
                                ).structured_content
                prompts = ["abcdefgh", "The quick brown fox"]
                out["record"] = (await c.call_tool("compare_tokens", {
                    "mode": "record", "reference": "tokens/emb4.json", "prompts": prompts, "max_tokens": 12},
                    progress_handler=recorder("record"))).structured_content
                out["check"] = (await c.call_tool("compare_tokens", {"mode": "check",
                                                                     "reference": "tokens/emb4.json"})
                                ).structured_content
                sweep_args = {"out": "sweeps", "input_lens": [32], "output_len": 8, "concurrencies": [1, 2],
                              "repeats": 1, "warmup": False, "min_prompts": 2, "prompts_per_concurrency": 1}
                out["sweep"] = (await c.call_tool("run_sweep", {**sweep_args, "label": "first"},
                                                  progress_handler=recorder("sweep"))).structured_content
                out["sweep2"] = (await c.call_tool("run_sweep", {**sweep_args, "label": "second"})).structured_content
                out["cmp"] = (await c.call_tool("compare_sweeps", {
                    "run_dirs": [out["sweep"]["run_dir"], out["sweep2"]["run_dir"]],
                    "output": "sweeps/compare.md"})).structured_content
                out["logs"] = (await c.call_tool("server_logs", {"lines": 20})).structured_content
            finally:
                out["stop"] = (await c.call_tool("stop_vllm_server", {"grace_s": 10})).structured_content
            out["after"] = (await c.call_tool("server_status", {})).structured_content
        return out

    r = asyncio.run(session())

    assert {"repack_checkpoint", "start_vllm_server", "vram_status", "run_sweep", "compare_tokens"} <= r["tools"]
    assert r["probe"]["verdict"] == "qat"
    assert r["repack"]["output"] == str(models / "emb4")
    assert progress["repack"][-1] == max(progress["repack"]) and len(progress["repack"]) >= 2

    start = r["start"]
    assert start["platform"] in ("cpu", "cuda") and start["served_name"] == "tiny-emb4"
    assert start["model"] == str(models / "emb4") and start["first_completion"] is not None
    assert start["base_url"].endswith(":" + os.environ.get("PORT", start["base_url"].rsplit(":", 1)[1]))
    assert progress["start"], "start streamed no progress"

    assert r["status"]["alive"] and r["status"]["healthy"] and r["status"]["pid"] == start["pid"]
    if not r["vram"]["available"]:
        assert r["vram"]["reason"]
    assert r["query"]["token_ids"] and r["query"]["usage"]["completion_tokens"] == len(r["query"]["token_ids"])

    assert r["record"]["summary"].startswith("recorded 2 prompts") and "generations" not in r["record"]
    assert r["record"]["path"] == str(evidence / "tokens" / "emb4.json") and Path(r["record"]["path"]).is_file()
    assert r["check"]["identical"] == r["check"]["total"] == 2
    assert all(p["verdict"] == "identical" for p in r["check"]["prompts"])

    sweep = r["sweep"]
    assert Path(sweep["run_dir"]).is_relative_to(evidence / "sweeps")
    assert sweep["counts"]["ok"] == 2 and sweep["counts"]["failed"] == 0
    assert all(c["median"]["output_throughput"] > 0 for c in sweep["cells"])
    assert progress["sweep"] and max(progress["sweep"]) == 2
    assert Path(sweep["files"]["summary_json"]).is_file()
    assert r["cmp"]["labels"] == ["first", "second"] and len(r["cmp"]["cells"]) == 2
    assert Path(r["cmp"]["report_path"]).read_text().strip()

    assert r["logs"]["lines"]
    assert r["stop"]["was_running"] and r["stop"]["stopped_pids"]
    assert r["after"]["alive"] is False
