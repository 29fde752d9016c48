"""The whole walk over stdio as an MCP client launches the server, with the default toolsets, from an empty models
root and with no step outside MCP, on real vLLM CPU servers: the `deploy_cpu` prompt's tool calls (make the tiny
stand-in source, E4B-shaped here, probe, preflight the repack, repack both builds, start the all-4-bit one, query),
then `compare_builds`' (memory, record tokens, sweep, serve B in A's place, memory, check tokens, sweep, compare the
sweeps, stop), each condition decided as an agent would, then the resources. Two vLLM starts in all. The
E2B-shaped stand-in (the default shape) is served and compared by the other real-vLLM tests. deploy_t4's steps are
the same tools (its fetch and clamp steps need the hub and a T4); its text is checked in test_mcp_resources.py.
The memory figures are checked against the server's processes as psutil reads them here."""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
from pathlib import Path

import psutil
import pytest
from fastmcp import Client
from fastmcp.client.transports import StdioTransport

from tests.helpers.fixtures import in_process_engine, free_port
from tools.mcp.bounded import RESULT_BUDGET
from tools.mcp.resources import PROMPTS, SCHEME, Ref
from tools.measure.sweep.report import load_run

ROOT = Path(__file__).resolve().parents[2]

# What the tiny CPU run changes in the documented calls: a short sweep grid with two repeats a cell (so that each
# ratio has an interval and a verdict) and short token records (the check reads its prompts from the record).
# The grid's two loads, 1 and the engine's cap of 8 users, give the capacity search its SLO: a TTFT limit between
# the two (as tests/measure/capacity/test_capacity_vllm.py sets it), which the search must find below the cap. The token
# record adds the long-context prompts that fit MAX_MODEL_LEN (the ~2k-token one). The stand-in is E4B-shaped: its
# two builds' token identity through MCP is this walk's to prove.
TINY_SWEEP = {"input_lens": [512], "output_len": 8, "concurrencies": [1, 8], "repeats": 2, "warmup": False,
              "min_prompts": 4, "prompts_per_concurrency": 2}
TINY = {"make_tiny_model": {"shape": "e4b"}, "run_sweep": TINY_SWEEP, "query_model": {"max_tokens": 8},
        "compare_tokens": {"prompts": ["abcdefgh", "The quick brown fox"], "max_tokens": 12, "long": True}}
VERDICTS = {"faster", "slower", "within noise"}


def _text_config(build: Path) -> dict:
    """The text model's config of a checkpoint (nested under text_config in a multimodal one)."""
    cfg = json.loads((build / "config.json").read_text())
    return cfg.get("text_config", cfg)


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
@pytest.mark.vllm_lane(1)
def test_stdio_walk_from_an_empty_models_root_to_compared_builds(tmp_path, monkeypatch):
    in_process_engine(monkeypatch)  # two starts; what the walk checks is the MCP surface, not vLLM's processes
    models, evidence, state = tmp_path / "models", tmp_path / "evidence", tmp_path / "run"
    models.mkdir()
    evidence.mkdir()
    port = free_port()
    # Serving settings for the tiny model, the way a user overrides tpu.env: environment variables.
    env = dict(os.environ, PORT=str(port), MAX_MODEL_LEN="4096", MAX_NUM_SEQS="8", CPU_KVCACHE_SPACE_GIB="1",
               SPECULATIVE_CONFIG="", EXTRA_ARGS="", START_TIMEOUT_S="900")
    env.pop("GEMMA4_T4_TOOLSETS", None)  # the default set is enough
    transport = StdioTransport(command=sys.executable, cwd="/", env=env, keep_alive=False, args=[
        str(ROOT / "server.py"), "--models-root", str(models), "--evidence-root", str(evidence),
        "--state-dir", str(state)])
    cpu = PROMPTS["deploy_cpu"]
    values = {"deploy_cpu": {}, "compare_builds": {"build_a": cpu.values()["output"],
                                                   "build_b": cpu.values()["output_bf16"],
                                                   "source": cpu.values()["source"]}}
    progress: dict[tuple[str, int], list[float]] = {}
    messages: dict[tuple[str, int], list[str]] = {}
    results: dict[tuple[str, int], dict] = {}
    measured: dict[tuple[str, int], float] = {}
    skipped: list[tuple[str, int]] = []
    sizes: dict[str, int] = {}  # characters of each result as the client receives it (summary line and JSON)

    def note(where: str, r) -> None:
        sizes[where] = sum(len(getattr(x, "text", "") or "") for x in r.content)

    async def capacity_in_session(c: Client) -> dict:
        """Before compare_builds' stop, while B serves: find_capacity from the default set (refused, naming the
        way in), enable_toolset, then a search whose TTFT limit lies between B's own sweep at 1 and 8 users."""
        ex: dict = {}
        r = await c.call_tool("find_capacity", {}, raise_on_error=False)
        note("find_capacity before enable_toolset", r)
        ex["refused"] = (r.is_error, r.content[0].text)
        r = await c.call_tool("enable_toolset", {"toolset": "capacity"})
        note("enable_toolset", r)
        ex["listed"] = {t.name for t in await c.list_tools()}
        sweep = load_run(Path(results[("compare_builds", 9)]["run_dir"]))
        t1, t8 = (sweep.cell(512, n).estimate("p50_ttft_ms").mean for n in (1, 8))
        ex["t"] = (t1, t8)
        ex["limit"] = limit = round(math.sqrt(t1 * t8), 1)
        r = await c.call_tool("find_capacity", {"slo": f"ttft_p50_ms={limit},tpot_p99_ms=10000", "input_len": 512,
                                                "output_len": 8, "max_load": 16, "repeats": 2, "label": "bf16-emb"})
        note("find_capacity", r)
        ex["result"] = r.structured_content
        return ex

    def recorder(key):
        async def on_progress(p, total, message):
            progress.setdefault(key, []).append(p)
            messages.setdefault(key, []).append(message or "")
        return on_progress

    async def applies(c: Client, name: str, step) -> bool:
        """Each conditional step's condition, decided from the machine and the earlier results."""
        if step.condition == "source_missing":
            return not (models / step.args["out"]).exists()
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
        out: dict = {"listed": None}
        async with Client(transport, timeout=1200) as c:
            out["listed"] = {t.name for t in await c.list_tools()}
            try:
                for name in ("deploy_cpu", "compare_builds"):
                    spec = PROMPTS[name]
                    # what the agent is told is what this test runs
                    out[f"prompt:{name}"] = (await c.get_prompt(name, values[name])).messages[0].content.text
                    for i, step in enumerate(spec.bind(values[name]), 1):
                        if step.condition and not await applies(c, name, step):
                            skipped.append((name, i))
                            continue
                        if name == "compare_builds" and step.tool == "stop_vllm_server":
                            out["capacity"] = await capacity_in_session(c)
                        tiny = {} if step.args.get("mode") == "check" else TINY.get(step.tool, {})
                        args = {k: resolve(name, v) for k, v in step.args.items()} | tiny
                        r = await c.call_tool(step.tool, args, progress_handler=recorder((name, i)))
                        note(f"{name} step {i}: {step.tool}", r)
                        results[(name, i)] = r.structured_content
                        if step.tool == "vram_status":  # the server's group as this test reads it, at the same time
                            st = (await c.call_tool("server_status", {})).structured_content
                            measured[(name, i)] = _group_rss_mib(st["pid"])
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
    D = {i: results.get(("deploy_cpu", i)) for i in range(1, 9)}
    C = {i: results.get(("compare_builds", i)) for i in range(1, 12)}

    for name in ("deploy_cpu", "compare_builds"):
        assert r[f"prompt:{name}"] == PROMPTS[name].render(values[name])
        # the default toolsets hold every step of this walk (deploy_cpu's fetch of a member needs hub)
        assert {s.tool for s in PROMPTS[name].bind(values[name])} <= r["listed"]
    # from an empty models root: the stand-in is made; B exists (deploy_cpu built it) and A is still served
    assert skipped == [("compare_builds", 1), ("compare_builds", 2)]

    # deploy_cpu
    assert D[1]["platform"] == "cpu"
    assert D[2]["path"] == str(models / "tiny-gemma4-qat") and D[3]["verdict"] == "qat"
    # the stand-in and both builds served below are E4B-shaped: 2 KV heads, single-width MLP (E2B's: 1, double)
    assert D[2]["shape"] == "e4b"
    for folder in ("tiny-gemma4-qat", "tiny-emb4", "tiny-bf16-emb"):
        tc = _text_config(models / folder)
        assert (tc["num_key_value_heads"], tc["use_double_wide_mlp"]) == (2, False), (folder, tc)
    assert D[4]["ready"] and {c["name"]: c["status"] for c in D[4]["checks"]} == {"source": "ok", "disk": "ok"}
    assert D[5]["output"] == str(models / "tiny-bf16-emb") and D[6]["output"] == str(models / "tiny-emb4")
    assert {t["name"]: t["groups"] for t in D[5]["tables"]}.get("embed_tokens", 0) == 0  # bf16 embeddings
    key = ("deploy_cpu", 6)
    assert progress[key][-1] == max(progress[key]) and len(progress[key]) >= 2
    start = D[7]
    assert start["platform"] == "cpu" and start["model"] == str(models / "tiny-emb4")
    assert start["first_completion"] is not None and start["base_url"].endswith(f":{port}")
    assert start["start_fields"].get("model_loading_gib") is None  # a GPU figure, not made up on CPU
    # a start's progress is phases with a fraction that only rises, and no message sent twice
    p7, m7 = progress[("deploy_cpu", 7)], [m for m in messages[("deploy_cpu", 7)] if m]
    assert p7 and p7 == sorted(p7) and len(m7) == len(set(m7))
    assert D[8]["token_ids"] and D[8]["usage"]["completion_tokens"] == len(D[8]["token_ids"])
    assert "on the CPU stand-in" in D[8]["summary"]  # a speed says where it was measured

    # compare_builds: memory of each build, its tokens, its throughput
    for i, build in ((3, "tiny-emb4"), (7, "tiny-bf16-emb")):
        vs = C[i]
        assert vs["available"] is False  # no NVIDIA GPU here: not an error
        [hm] = vs["host"]
        assert hm["instance"] == "default" and hm["rss_mib"] > 0 and hm["weights_mib"] > 0
        assert hm["weights_mib"] == pytest.approx(sum(f.stat().st_size for f in (models / build).glob(
            "*.safetensors")) / 2**20, abs=0.01)
        if hm["pss_mib"] is not None:  # smaps_rollup readable: our own processes on Linux
            assert 0 < hm["pss_mib"] <= hm["rss_mib"] * 1.01 and "smaps_rollup" in hm["method"]
        # true: the tool's RSS is the group's as read from here (the engine's resident set moves a little)
        assert hm["rss_mib"] == pytest.approx(measured[("compare_builds", i)], rel=0.25)
        assert "RSS" in vs["summary"] and "default" in vs["summary"]
    # the int4 embeddings make the all-4-bit build's weights smaller
    assert C[3]["host"][0]["weights_mib"] < C[7]["host"][0]["weights_mib"]
    assert C[4]["summary"].startswith("recorded 3 prompts") and "generations" not in C[4]
    assert C[4]["path"] == str(evidence / "tokens" / "int4-emb.json") and Path(C[4]["path"]).is_file()
    # B served in A's place, in one call
    assert C[6]["model"] == str(models / "tiny-bf16-emb") and C[6]["pid"] != start["pid"]
    assert C[6]["outcome"] == f"serving {C[6]['served_name']}" and C[6]["replaced"]
    hm6 = C[6]["host_memory"]
    assert hm6["instance"] == "default" and C[6]["pid"] in hm6["pids"] and "rss" in hm6["method"]
    # the tiny model is trained to be confident: int4 embeddings change no greedy token
    # ... on a long-context prompt of about 2k tokens too (the ~8k and ~14k ones do not fit MAX_MODEL_LEN 4096)
    assert C[8]["identical"] == C[8]["total"] == 3
    assert all(p["verdict"] == "identical" for p in C[8]["prompts"])
    assert max(p["prompt_tokens"] for p in C[8]["prompts"]) >= 1900, C[8]["prompts"]
    for i, label in ((5, "int4-emb"), (9, "bf16-emb")):
        sweep = C[i]
        assert sweep["label"] == label and Path(sweep["run_dir"]).is_relative_to(evidence / "sweeps")
        assert sweep["counts"]["ok"] == 2 and sweep["counts"]["failed"] == 0
        # two repeats a cell, summarised; the repeats themselves stay in the run folder (a small result)
        # out tok/s as the table gives it (the geometric mean of the repeats), not also as a median
        assert all(c["geometric_mean"]["output_throughput"] == round(c["output_throughput_ci"]["mean"], 3) > 0
                   and "output_throughput" not in c["median"] and c["output_throughput_ci"]["n"] == 2
                   and "repeats" not in c for c in sweep["cells"])
        assert Path(sweep["files"]["summary_json"]).is_file()
        # the single-stream cell's decode rate as a share of the roofline, with the CPU's measured bandwidth (in
        # the run's summary.json: the result gives a roofline where it applies)
        roofline = json.loads(Path(sweep["files"]["summary_json"]).read_text())["roofline"]
        assert set(roofline) == {"512"} and 0 < roofline["512"]["fraction"]
        assert roofline["512"]["device"] == "cpu" and "copy" in roofline["512"]["method"]
        # a stand-in's step (about 1 MiB) is no memory-bandwidth figure: n/a, not 0%
        assert roofline["512"]["applicable"] is False and sweep["roofline"] == {}
        assert "no memory-bandwidth roofline share at c=1, in=512: a decode step reads only" in sweep["summary"]
    assert progress[("compare_builds", 5)] and max(progress[("compare_builds", 5)]) == 4  # cells x repeats
    cmp = C[10]
    assert cmp["labels"] == ["bf16-emb", "int4-emb"] and len(cmp["cells"]) == 2
    assert "(verdicts: " in cmp["summary"]  # counted over every cell, not the first one's alone
    # two builds of one stand-in on one CPU: nothing across, but E4B was never measured on a T4, and it says so
    assert cmp["summary"].startswith("no T4 measurement of E4B exists") and not cmp["across"]
    for cell in cmp["cells"]:  # two repeats a side: every ratio has its interval and a verdict
        [ratio] = cell["intervals"].values()
        assert ratio["low"] <= ratio["value"] <= ratio["high"]
        # a verdict, or none where other work (the suite's other tests) loaded the machine, and then said so
        assert ratio["verdict"] in VERDICTS or (ratio["verdict"] == "other work" and "OTHER WORK" in cmp["summary"])
    # the answer's method may be shortened to keep the answer within its budget; the report holds it whole
    assert cmp["method"].startswith("Values are geometric means") and "95%" in Path(cmp["report_path"]).read_text()
    assert C[11]["was_running"] and r["after"]["alive"] is False

    # the resources, read over the same stdio session
    rows = {v["name"]: v for v in r["config"]["variables"]}
    assert rows["PORT"]["source"] == "environment" and rows["PORT"]["value"] == port
    assert rows["STATE_DIR"]["source"] == "override" and "PORT" in r["config"]["overridden"]
    runs = {x["run"] for x in r["runs"]["runs"]}
    assert {str(Path(C[i]["run_dir"]).relative_to(evidence)) for i in (5, 9)} <= runs
    assert "bf16-emb" in r["summary"] or "int4-emb" in r["summary"]
    assert 0 < len(r["log"].splitlines()) <= 200
    assert r["demo"].startswith("no demo report under the evidence roots") and "./vllm-t4 demo" in r["demo"]

    # the capacity search, reached inside the session from the default toolsets
    cap = r["capacity"]
    refused, why = cap["refused"]
    assert refused and "toolset capacity" in why and "enable_toolset" in why, why
    assert "find_capacity" in cap["listed"]
    t1, t8 = cap["t"]
    # eight 512-token prompts prefilled together wait for each other: the limit between the two has room each side
    assert t8 > 1.5 * t1, (t1, t8)
    res = cap["result"]
    assert res["status"] == "found", (cap["limit"], res["statement"], res["search"])
    assert res["max_num_seqs"] == 8 and 1 <= res["capacity"] < 8 and res["first_fail"] == res["capacity"] + 1
    assert "max_num_seqs" not in res["summary"]  # the SLO's own limit, not the engine's cap
    # where it was measured: the CPU stand-in and the build, in the result and in its summary line
    assert res["platform"] == "cpu" and "CPU" in res["measured_on"] and "bf16-emb" in res["measured_on"]
    assert "CPU" in res["summary"]
    assert res["usd_per_million"] is None or "CPU" in res["cost_basis"]

    # every default result of the walk within the answer budget
    assert sizes and max(sizes.values()) <= RESULT_BUDGET, {k: v for k, v in sizes.items() if v > RESULT_BUDGET}
