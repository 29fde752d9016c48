"""Answers an assistant can repeat to its user without checking them: one statistic per figure across a result,
its summary and its files; every figure names where it was measured; no comparison across machines, models or
vLLM versions unsaid."""

from __future__ import annotations

import re

from tests.helpers.fixtures import stand_in_sweep_run

CPU = {"gpu_count": 0, "cpu_model": "Intel Xeon (test)", "vllm_version_server": "0.32.0",
       "server": {"model_root": "/m/tiny-e2b-emb4"}}


def test_run_sweep_gives_each_figure_in_the_statistic_its_table_gives(tmp_path):
    """run_sweep's summary said a median (50.34 out tok/s) where summary.md gave the geometric mean (48.32) of the
    same cell: the summary, the result's cells and the table now give the one figure, named as such."""
    from tools.mcp.measure_tools import sweep_reply

    # repeats whose median (50) is not their geometric mean (about 42.7)
    res = stand_in_sweep_run(tmp_path / "run", "a", {(512, 1): [12.0, 12.5, 11.5], (512, 4): [50.0, 30.0, 52.0]},
                         provenance=CPU)
    reply = sweep_reply(res)
    cell = res.cell(512, 4)
    geo = cell.output_throughput_ci.mean
    assert abs(geo - cell.median["output_throughput"]) > 5
    assert f"best {geo:.2f} out tok/s (geometric mean of 3 repeats) at in=512 c=4" in reply.summary
    table = (tmp_path / "run" / "summary.md").read_text()
    assert re.search(rf"\| 4 \| {geo:,.2f} \(", table), table
    rows = {c["concurrency"]: c for c in reply.result["cells"]}
    assert rows[4]["geometric_mean"]["output_throughput"] == round(geo, 3)
    assert "output_throughput" not in rows[4]["median"] and rows[4]["median"]["completed"] == 4
    assert "Intel Xeon (test)" in reply.summary  # where it was measured


def test_run_sweep_answers_every_cell_and_its_whole_summary_within_the_budget(tmp_path):
    """A 2x2 sweep of a stand-in came back with its cells left out and its summary cut mid-sentence (the n/a
    roofline's long method text, unrounded figures and internal log-scale fields filled the budget): now every cell
    and the whole summary fit, the n/a roofline named in the summary only (its figures stay in summary.json)."""
    from tools.mcp.bounded import fit
    from tools.mcp.measure_tools import sweep_reply
    from tools.measure.roofline import Roofline

    res = stand_in_sweep_run(tmp_path / "run", "a", {(64, 1): [72.36, 72.59], (64, 4): [150.1, 174.2],
                                                     (256, 1): [30.1, 30.2], (256, 4): [86.4, 86.5]}, provenance=CPU)
    method = ("bytes per step: linears and output layer whole, embedding rows gathered, KV at 80 tokens; bandwidth: "
              "numpy copy of 256 MiB (last-level cache 32 MiB), best of 5, read + write bytes, 2 CPUs")
    res.roofline = {L: Roofline(tok_s=72.0 / (1 + i), step_bytes=672416 + 49152 * i, context_tokens=L + 16,
                                bandwidth_bytes_per_s=32234720392.54, roofline_tok_s=47938.66,
                                achieved_bytes_per_s=50169683.85, fraction=0.0015563865, device="cpu", method=method)
                    for i, L in enumerate((64, 256))}
    reply = sweep_reply(res)
    data = fit({**reply.result, **reply.extra, "summary": reply.summary})
    assert "clipped" not in data and len(data["cells"]) == 4, data.get("clipped")
    assert data["summary"].endswith("; no memory-bandwidth roofline share at c=1, in=64, 256: a decode step reads "
                                    "only 0.64-0.69 MiB (a stand-in's size), too little for bandwidth to set its "
                                    "speed"), data["summary"]
    assert data["roofline"] == {} and all(set(c["output_throughput_ci"]) == {"n", "mean", "low", "high"}
                                          for c in data["cells"])


def test_a_run_measured_beside_other_work_says_so_in_its_summary_and_in_every_comparison(tmp_path):
    """compare_sweeps called one build 1.94x faster than another of the same size while another session's vLLM
    ran on the same two cores: a run records the cores other work kept busy while none of its requests was in
    flight (before and after it), and its summary and any comparison with it say so first."""
    from tools.mcp.measure_tools import sweep_reply
    from tools.measure.sweep.report import compare_runs

    quiet = stand_in_sweep_run(tmp_path / "a", "fp16", {(256, 1): [30.1, 30.2]},
                               provenance={**CPU, "other_load_cores": [0.05, 0.1]})
    busy = stand_in_sweep_run(tmp_path / "b", "fp16-exact", {(256, 1): [58.4, 58.6]},
                              provenance={**CPU, "other_load_cores": [1.42, 0.2]})
    assert "other work" not in sweep_reply(quiet).summary
    said = sweep_reply(busy).summary
    assert "other work kept 1.4 cores busy while none of its requests was in flight" in said
    assert said.endswith("(compare_sweeps gives no verdict on them): run it again when nothing else runs"), said
    cmp = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert cmp.caveat.startswith("OTHER WORK on the machine around fp16-exact (1.4 cores busy while none of its "
                                 "requests was in flight): a ratio with it measures that load too"), cmp.caveat
    assert "fp16 (" not in cmp.caveat and cmp.caveat in cmp.markdown
    assert compare_runs([tmp_path / "a", tmp_path / "a"]).caveat is None
    # A ratio with a loaded run gives no verdict: its interval holds the repeats' spread, not the load's (a build
    # compared with itself under load came out "slower" than itself). The quiet pair keeps its verdict.
    [cell] = cmp.cells
    [r] = cell.intervals.values()
    assert r.verdict == "other work" and r.low > 1 and "(verdicts: 1 other work)" in cmp.summary(), r
    stand_in_sweep_run(tmp_path / "c", "fp16-again", {(256, 1): [35.1, 35.2]}, provenance={**CPU})
    three = compare_runs([tmp_path / "b", tmp_path / "a", tmp_path / "c"])
    verdicts = {k.split(" (")[0]: v.verdict for k, v in three.cells[0].intervals.items()}
    assert verdicts == {"fp16-again vs fp16": "faster", "fp16-again vs fp16-exact": "other work"}, verdicts


def test_runs_of_builds_on_other_cpu_cores_counts_are_compared_across_them(tmp_path):
    """A switch beside the running build gives the new one a core of its own: one build measured on one core and
    the other on two was compared as builds. The cores each server had are recorded, and a comparison across
    other core counts says so first (one core against another of the same count is still a build's ratio)."""
    from tools.measure.sweep.report import compare_runs

    stand_in_sweep_run(tmp_path / "a", "bf16-emb", {(64, 1): [50.1, 50.2]},
                       provenance={**CPU, "cpu_count": 2, "server_cpu_cores": [0, 1]})
    stand_in_sweep_run(tmp_path / "b", "int4-emb", {(64, 1): [45.1, 45.2]},
                       provenance={**CPU, "cpu_count": 2, "server_cpu_cores": [1]})
    stand_in_sweep_run(tmp_path / "c", "int4-again", {(64, 1): [45.3, 45.2]},
                       provenance={**CPU, "cpu_count": 2, "server_cpu_cores": [0]})
    cmp = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert cmp.caveat and cmp.caveat.startswith("ACROSS CPU cores (1 vs 2)"), cmp.caveat
    assert compare_runs([tmp_path / "b", tmp_path / "c"]).caveat is None


def test_the_cores_a_started_server_has_are_its_runs_provenance(monkeypatch):
    import os
    from types import SimpleNamespace

    from tools.measure import provenance

    st = SimpleNamespace(alive=True, base_url="http://127.0.0.1:1", argv=["vllm"], start_fields=None,
                         cpu_cores=[[1], [1]])
    monkeypatch.setattr(provenance, "server_status", lambda cfg: st)
    monkeypatch.setattr(provenance, "server_info", lambda url: provenance.ServerInfo(base_url=url))
    prov = provenance.collect("http://127.0.0.1:1", serve_config=object())
    assert prov.server_cpu_cores == [1] and prov.cpu_count and prov.cpu_count >= 1
    st.cpu_cores = None  # unbound: every core
    every = list(range(os.cpu_count()))
    assert provenance.collect("http://127.0.0.1:1", serve_config=object()).server_cpu_cores == every
    # through the front door on the config's port: the build it routes to
    st.alive = False
    door = SimpleNamespace(argv=["vllm", "--model", "b"], cpu_cores=[[0]])
    monkeypatch.setattr(provenance, "behind_door_state", lambda cfg: door)
    cfg = SimpleNamespace(base_url="http://127.0.0.1:2")
    prov = provenance.collect("http://127.0.0.1:2", serve_config=cfg)
    assert prov.server_cpu_cores == [0] and prov.server_argv == door.argv
    assert provenance.collect("http://127.0.0.1:3", serve_config=cfg).server_cpu_cores is None  # not the door


def test_a_comparison_of_two_loaded_stand_in_runs_answers_its_summary_and_method_whole(roots):
    """Two E4B stand-in runs, each beside other work: the caveat (no T4 measurement, other work) filled the budget
    three times over (summary, caveat, markdown) with unrounded cells, and `method` came back cut to 20 characters.
    The reply gives the caveat and the method once each (the markdown points to them) and four-digit figures."""
    import asyncio

    from fastmcp import Client

    from tools.mcp.app import Settings, create_server
    from tools.measure.uncertainty import METHOD

    ev = roots.evidence[0]
    e4b = _stand_in_build(roots.models[0] / "tiny-e4b-int4-emb", "e4b")
    for name, load in (("bf16-emb", [1.02, 1.1]), ("int4-emb", [0.98, 1.13])):
        stand_in_sweep_run(ev / name, name, {(64, 1): [30.1, 30.2], (64, 4): [86.4, 86.5]},
                           provenance={**e4b, "other_load_cores": load})

    async def go():
        async with Client(create_server(Settings(roots=roots))) as c:
            return (await c.call_tool("compare_sweeps", {"run_dirs": [str(ev / "bf16-emb"),
                                                                      str(ev / "int4-emb")]})).structured_content

    out = asyncio.run(go())
    assert out["method"] == METHOD and out["summary"].endswith("not a T4 cost"), out
    assert ("OTHER WORK on the machine around bf16-emb (1.1 cores busy while none of its requests was in flight), "
            "int4-emb (1.1 cores busy): a ratio with them measures that load too") in out["summary"]
    assert out["markdown"].startswith("(**Caveat: see `caveat`.**)") and out["caveat"] in out["summary"]
    assert out["cells"][0]["estimates"][0] == {"n": 2, "mean": 30.15, "low": 29.52, "high": 30.79}


def test_the_cores_other_work_keeps_busy_are_measured(tmp_path):
    import subprocess
    import sys

    from tools.measure.provenance import machine_busy_cores

    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 5: pass"])
    try:
        assert machine_busy_cores(1.0) >= 0.7  # the spinning process's core, at least
    finally:
        spin.kill()
        spin.wait()


T4 = {"gpu_count": 1, "gpu_name": "Tesla T4", "vllm_version_server": "0.29.0",
      "server_argv": ["vllm", "serve", "xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text-emb4"]}


def _stand_in_build(folder, shape: str) -> dict:
    """A build folder's config.json of the tiny stand-in shaped as `shape`, and a CPU provenance pointing at it."""
    import json

    from repack.stand_ins.tiny_model import text_config

    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"text_config": text_config(shape)}))
    return {**CPU, "server": {"model_root": str(folder)}}


def test_compare_sweeps_says_when_runs_differ_in_model_platform_or_vllm(tmp_path, roots):
    """compare_sweeps set a CPU stand-in against the article's E2B on a T4 and printed "first cell
    tiny-e4b-int4-emb vs emb4: 0.14x" with no word that models and machines differ, nor that E4B has no T4
    measurement: the first line and every ratio say so now. Two builds of one stand-in on one CPU say nothing."""
    import asyncio

    from fastmcp import Client

    from tools.mcp.app import Settings, create_server
    from tools.measure.sweep.report import compare_runs

    ev = roots.evidence[0]
    e4b = _stand_in_build(roots.models[0] / "tiny-e4b-int4-emb", "e4b")
    stand_in_sweep_run(ev / "emb4", "emb4", {(512, 1): [12.5], (512, 4): [50.3]}, provenance=T4,
                   model="xbill9/gemma-4-E2B-it-qat-q4_0-w4a16-ct-text-emb4")
    stand_in_sweep_run(ev / "bf16", "tiny-e4b-bf16-emb", {(512, 1): [1.6, 1.7], (512, 4): [6.0, 6.2]}, provenance=e4b)
    stand_in_sweep_run(ev / "int4", "tiny-e4b-int4-emb", {(512, 1): [1.7, 1.8], (512, 4): [7.0, 7.1]}, provenance=e4b)

    async def go(dirs):
        async with Client(create_server(Settings(roots=roots))) as c:
            return (await c.call_tool("compare_sweeps", {"run_dirs": [str(ev / d) for d in dirs]})).structured_content

    out = asyncio.run(go(["emb4", "int4"]))
    first = out["summary"].split(": ")[0]
    assert first.startswith("ACROSS models (the tiny stand-in shaped as E4B vs E2B)"), out["summary"]
    assert "platforms (CPU (Intel Xeon (test)) vs Tesla T4); vLLM versions (0.32.0 vs 0.29.0)" in first
    assert "no T4 measurement of E4B exists" in out["summary"] and "evidence/article-t4" in out["summary"]
    # the whole comparison (the MCP result shortens its long texts): every ratio's name says what differs
    cmp = compare_runs([ev / "emb4", ev / "int4"])
    key = "tiny-e4b-int4-emb vs emb4 (other models, platforms, vLLM versions)"
    for cell in cmp.cells:
        assert list(cell.ratios) == [key] and list(cell.intervals) == [key]
    assert f"first cell {key}: " in cmp.summary() and cmp.summary().startswith(cmp.caveat)
    assert cmp.markdown.startswith(f"**{cmp.caveat}.**") and key in cmp.markdown
    assert cmp.across[key].startswith("models: the tiny stand-in shaped as E4B vs E2B")
    # the written report names each run's machine, and its cost table how it was priced (a saved comparison
    # named neither: the T4's price on a CPU's throughput read as a cost)
    assert ("Measured: emb4: E2B on Tesla T4, vLLM 0.29.0; tiny-e4b-int4-emb: the tiny stand-in shaped as E4B on "
            "CPU (Intel Xeon (test)), vLLM 0.32.0.") in cmp.markdown, cmp.markdown
    assert "Priced at $0.5241/h; the T4 VM's $0.5241/h applied to this CPU's throughput, not a T4 cost" in cmp.markdown

    # the run's own table prices it as what it is: the T4's price on this CPU's throughput, E4B never on a T4
    table = (ev / "int4" / "summary.md").read_text()
    assert "not a T4 cost; no T4 measurement of E4B exists" in table and "used instead, the tiny stand-in" in table

    same = asyncio.run(go(["bf16", "int4"]))
    assert "ACROSS" not in same["summary"] and same["across"] == {}
    assert list(same["cells"][0]["ratios"]) == ["tiny-e4b-int4-emb vs tiny-e4b-bf16-emb"]
    assert same["summary"].startswith("no T4 measurement of E4B exists")  # still a CPU stand-in's figures


def test_served_figures_name_the_cpu_or_the_gpu(roots, tmp_path, monkeypatch):
    """query_model said "64 tokens in 4.13 s where the server runs" and compare_tokens named no platform: a served
    build's figures name the CPU stand-in and its CPU, or the GPU by name; a server recorded without a platform is
    placed on this machine (the servers this project starts run here)."""
    import tools.gpu.vram as vram
    from tests.helpers.stand_ins.nvml import StandInNvml
    from tools.mcp.app import App, Settings
    from tools.measure.provenance import cpu_model

    app = App(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}))
    app._platform = "cpu"  # no server recorded: this machine's platform
    assert app.served_on() == f"on the CPU stand-in (vLLM CPU backend, {cpu_model()})"
    monkeypatch.setattr(vram, "_load_nvml", lambda: StandInNvml([{"name": b"Tesla T4", "total": 15 << 30,
                                                               "used": 1 << 30, "util": 0, "compute": [],
                                                               "graphics": []}]))
    app._platform = "cuda"
    assert app.served_on() == "on the GPU (Tesla T4)"


def test_probe_build_preview_sizes_say_their_unit(tmp_path):
    """probe_checkpoint's build_preview gave each table's size as a bare number: its keys name the unit."""
    from repack.build.probe import probe_checkpoint
    from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint

    src = cached_tiny_qat_checkpoint(tmp_path / "src").path
    builds = probe_checkpoint(src).build_preview["builds"]
    for b in builds.values():
        assert set(b) == {"tables_bytes", "total_bytes"} and b["total_bytes"] == sum(b["tables_bytes"].values())


def test_the_switchs_host_memory_figures_say_what_they_count(tmp_path, monkeypatch):
    """The switch announced "about 2.0 of 12.2 GiB host memory available" on a 23.5 GiB host, unexplained: the
    need is given by part and the available figure as MemAvailable (the running builds' share taken) of the total."""
    from types import SimpleNamespace

    import psutil

    import tools.serving.frontdoor.door as frontdoor
    from tools.serving.config import load_config

    model = tmp_path / "tiny-e4b-emb4"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    cfg = load_config(model=str(model), state_dir=str(tmp_path / "run"), cpu_kvcache_space_gib=1)
    monkeypatch.setattr(frontdoor.placement, "plan", lambda b, hw: b)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=int(12.2 * 2**30),
                                                                          total=int(23.5 * 2**30)))
    fit, _ = frontdoor.fits_beside(cfg, SimpleNamespace(platform=lambda: "cpu"))
    assert fit.beside and "about 3.0 GiB needed (weights 0.0, KV cache 1.0, engine 2.0)" in fit.why, fit.why
    assert "of 12.2 GiB host memory available now (MemAvailable" in fit.why and "of 23.5 GiB total" in fit.why


def test_the_served_names_default_is_given_as_what_it_is(roots, tmp_path, monkeypatch):
    """start_vllm_server's served_name said "(default: SERVED_MODEL_NAME)", which the config resource gave as the
    E2B build's name while a start served another build under its folder name: an empty SERVED_MODEL_NAME reads
    as empty, with what a start serves under instead."""
    import asyncio
    import json

    from fastmcp import Client

    from tools.mcp.app import Settings, create_server

    monkeypatch.delenv("SERVED_MODEL_NAME", raising=False)
    env = tmp_path / "tpu.env"
    env.write_text(f"MODEL_NAME={roots.models[0] / 'gemma-4-E2B-emb4'}\nSERVED_MODEL_NAME=\n")

    async def go():
        async with Client(create_server(Settings(roots=roots, env_file=env), toolsets="all")) as c:
            tools = {t.name: t for t in await c.list_tools()}
            return tools, json.loads((await c.read_resource("gemma4-t4://config"))[0].text)

    tools, config = asyncio.run(go())
    row = next(r for r in config["variables"] if r["name"] == "SERVED_MODEL_NAME")
    assert row["value"] == "" and row["default_value"] == "gemma-4-E2B-emb4"
    assert "folder name" in row["default"]
    for name in ("start_vllm_server", "switch_build"):
        text = tools[name].input_schema["properties"]["served_name"]["description"]
        assert "where empty the model's folder name" in text, text


def test_output_schemas_type_every_field_and_name_the_free_form_ones():
    """An output schema listed property names with no type (the Inspector's "Schema carries no validation keyword
    at all", 139 times): each field now carries its JSON type (a nullable one as anyOf with null, two result types
    that type a field differently as either), and a field typed as any value is left undeclared and named."""
    from typing import Any

    from pydantic import BaseModel, Field

    from tools.mcp.registry import lean_schema

    class A(BaseModel):
        n: int = Field(description="a count")
        ratio: float | None = None
        rows: list[dict[str, Any]] = []
        anything: Any = None

    class B(BaseModel):
        n: str
        ratio: float  # typed by A too: each branch once

    schema = lean_schema(A | B, {"extra": (dict[str, int], "added")})
    props = schema["properties"]
    assert props["n"] == {"anyOf": [{"type": "integer"}, {"type": "string"}], "description": "a count"}
    assert props["ratio"] == {"anyOf": [{"type": "number"}, {"type": "null"}]}
    assert props["rows"] == {"type": "array"} and props["extra"] == {"type": "object", "description": "added"}
    assert "anything" not in props and schema["description"] == "Free-form (any JSON value, not declared): anything"
