"""The fresh-VM walk-through, over stdio as an MCP client launches the server, on the tiny model with real vLLM
servers (CPU backend here): the `deploy_t4` prompt's tool calls, then `compare_builds`' (tools/mcp/resources.py
declares them; the README shows the same steps), each condition decided as an agent would, then the resources.
preflight -> probe -> preflight (repack) -> repack -> start -> query -> repack B -> record -> sweep -> stop ->
start B -> check -> sweep -> compare_sweeps -> stop. Shares nothing with other tests' servers."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.client.transports import StdioTransport

from fixtures import free_port
from tools.mcp.resources import PROMPTS, SCHEME, Ref

ROOT = Path(__file__).resolve().parents[2]

# What the tiny CPU run changes in the documented calls: a short sweep grid and short token records (the check
# reads its prompts from the record).
TINY_SWEEP = {"input_lens": [32], "output_len": 8, "concurrencies": [1, 2], "repeats": 1, "warmup": False,
              "min_prompts": 2, "prompts_per_concurrency": 1}
TINY = {"run_sweep": TINY_SWEEP, "query_model": {"max_tokens": 8},
        "compare_tokens": {"prompts": ["abcdefgh", "The quick brown fox"], "max_tokens": 12}}


@pytest.mark.vllm
def test_stdio_walkthrough_from_preflight_to_compare_sweeps(tiny_qat, tmp_path):
    models, evidence, state = tmp_path / "models", tmp_path / "evidence", tmp_path / "run"
    models.mkdir()
    evidence.mkdir()
    port = free_port()
    # Serving settings for the tiny model, the way a user overrides tpu.env: environment variables.
    env = dict(os.environ, PORT=str(port), MAX_MODEL_LEN="512", MAX_NUM_SEQS="4", CPU_KVCACHE_SPACE_GIB="1",
               SPECULATIVE_CONFIG="", EXTRA_ARGS="", START_TIMEOUT_S="900")
    transport = StdioTransport(command=sys.executable, cwd="/", env=env, keep_alive=False, args=[
        str(ROOT / "server.py"), "--toolsets", "all", "--models-root", str(models), "--models-root", str(tiny_qat.parent),
        "--evidence-root", str(evidence), "--state-dir", str(state)])
    values = {"deploy_t4": {"source": str(tiny_qat), "output": "emb4"},
              "compare_builds": {"build_a": "emb4", "build_b": "text", "source": str(tiny_qat)}}
    progress: dict[tuple[str, int], list[float]] = {}
    results: dict[tuple[str, int], dict] = {}
    skipped: list[tuple[str, int]] = []

    def recorder(key):
        async def on_progress(p, total, message):
            progress.setdefault(key, []).append(p)
        return on_progress

    async def applies(c: Client, name: str, step) -> bool:
        """Each conditional step's condition, decided from the machine and the earlier results."""
        if step.condition == "source_missing":
            return not Path(step.args["out"]).exists()
        if step.condition == "turing":
            checks = {ch["name"]: ch for ch in results[("deploy_t4", 1)]["checks"]}
            return checks["turing_clamp"]["status"] == "fail"
        if step.condition == "build_b_missing":
            return not (models / step.args["output"]).exists()
        if step.condition == "a_not_served":
            st = (await c.call_tool("server_status", {})).structured_content
            return not (st["alive"] and st["model"] == str(models / values[name]["build_a"]))
        raise AssertionError(f"unknown condition {step.condition}")

    def resolve(name: str, v):
        if isinstance(v, Ref):
            return results[(name, v.step)][v.field]
        if isinstance(v, list):
            return [resolve(name, x) for x in v]
        return v

    async def session() -> dict:
        out: dict = {}
        async with Client(transport, timeout=1200) as c:
            try:
                for name in ("deploy_t4", "compare_builds"):
                    spec = PROMPTS[name]
                    # what the agent is told is what this test runs
                    out[f"prompt:{name}"] = (await c.get_prompt(name, values[name])).messages[0].content.text
                    for i, step in enumerate(spec.bind(values[name]), 1):
                        if step.condition and not await applies(c, name, step):
                            skipped.append((name, i))
                            continue
                        tiny = {} if step.args.get("mode") == "check" else TINY.get(step.tool, {})
                        args = {k: resolve(name, v) for k, v in step.args.items()} | tiny
                        r = await c.call_tool(step.tool, args, progress_handler=recorder((name, i)))
                        results[(name, i)] = r.structured_content
                out["after"] = (await c.call_tool("server_status", {})).structured_content
                out["config"] = json.loads((await c.read_resource(f"{SCHEME}://config"))[0].text)
                out["runs"] = json.loads((await c.read_resource(f"{SCHEME}://evidence/runs"))[0].text)
                out["summary"] = (await c.read_resource(out["runs"]["runs"][0]["uris"][0]))[0].text
                out["log"] = (await c.read_resource(f"{SCHEME}://server/log"))[0].text
                try:
                    await c.read_resource(f"{SCHEME}://demo/latest")
                except Exception as exc:  # no demo ran here: a one-line answer, over the real transport too
                    out["demo"] = str(exc)
            finally:
                await c.call_tool("stop_vllm_server", {"grace_s": 10})
        return out

    r = asyncio.run(session())
    D = {i: results.get(("deploy_t4", i)) for i in range(1, 9)}
    C = {i: results.get(("compare_builds", i)) for i in range(1, 10)}

    for name in ("deploy_t4", "compare_builds"):
        assert r[f"prompt:{name}"] == PROMPTS[name].render(values[name])
    # on this CPU machine: the source is there, no T4 clamp, and A is still served after deploy_t4
    assert skipped == [("deploy_t4", 2), ("deploy_t4", 6), ("compare_builds", 2)]

    assert D[1]["ready"] and D[1]["platform"] in ("cpu", "cuda")
    assert D[4]["ready"] and {c["name"]: c["status"] for c in D[4]["checks"]} == {"source": "ok", "disk": "ok"}
    assert D[3]["verdict"] == "qat"
    assert D[5]["output"] == str(models / "emb4")
    key = ("deploy_t4", 5)
    assert progress[key][-1] == max(progress[key]) and len(progress[key]) >= 2
    start = D[7]
    assert start["platform"] in ("cpu", "cuda") and start["model"] == str(models / "emb4")
    assert start["first_completion"] is not None and start["base_url"].endswith(f":{port}")
    assert progress[("deploy_t4", 7)], "start streamed no progress"
    assert D[8]["token_ids"] and D[8]["usage"]["completion_tokens"] == len(D[8]["token_ids"])

    assert C[1]["output"] == str(models / "text")
    assert {t["name"]: t["groups"] for t in C[1]["tables"]}.get("embed_tokens", 0) == 0  # bf16 embeddings
    assert C[3]["summary"].startswith("recorded 2 prompts") and "generations" not in C[3]
    assert C[3]["path"] == str(evidence / "tokens" / "int4-emb.json") and Path(C[3]["path"]).is_file()
    assert C[5]["model"] == str(models / "text") and C[5]["pid"] != start["pid"]
    assert C[5]["outcome"] == "serving B" and C[5]["replaced"]["pid"] == start["pid"]
    # the tiny model is trained to be confident: int4 embeddings change no greedy token
    assert C[6]["identical"] == C[6]["total"] == 2
    assert all(p["verdict"] == "identical" for p in C[6]["prompts"])
    for i, label in ((4, "int4-emb"), (7, "bf16-emb")):
        sweep = C[i]
        assert sweep["label"] == label and Path(sweep["run_dir"]).is_relative_to(evidence / "sweeps")
        assert sweep["counts"]["ok"] == 2 and sweep["counts"]["failed"] == 0
        assert all(c["median"]["output_throughput"] > 0 for c in sweep["cells"])
        assert Path(sweep["files"]["summary_json"]).is_file()
    assert progress[("compare_builds", 4)] and max(progress[("compare_builds", 4)]) == 2
    assert C[8]["labels"] == ["bf16-emb", "int4-emb"] and len(C[8]["cells"]) == 2
    assert Path(C[8]["report_path"]).read_text().strip()
    assert C[9]["was_running"] and r["after"]["alive"] is False

    # the resources, read over the same stdio session
    rows = {v["name"]: v for v in r["config"]["variables"]}
    assert rows["PORT"]["source"] == "environment" and rows["PORT"]["value"] == port
    assert rows["STATE_DIR"]["source"] == "override" and "PORT" in r["config"]["overridden"]
    runs = {x["run"] for x in r["runs"]["runs"]}
    assert {str(Path(C[i]["run_dir"]).relative_to(evidence)) for i in (5, 9)} <= runs
    assert "bf16-emb" in r["summary"] or "int4-emb" in r["summary"]
    assert 0 < len(r["log"].splitlines()) <= 200
    assert r["demo"].startswith("no demo report under the evidence roots") and "./vllm-t4 demo" in r["demo"]
