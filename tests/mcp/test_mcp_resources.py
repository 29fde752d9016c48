"""MCP resources and prompts over an in-memory MCP client: listing, reading, the evidence template confined to the
evidence roots, clean errors for what is missing, the prompts' tool calls valid against the tools they name, and
docs/mcp.md equal to the declarations."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from fastmcp import Client

from tools.mcp.app import Settings, create_server
from tools.core.paths import Roots
from tools.mcp.resources import CONDITIONS, PROMPTS, RESOURCES, SCHEME, Ref, walkthrough

ROOT = Path(__file__).resolve().parents[2]


def run(coro):
    return asyncio.run(coro)


@pytest.fixture()
def mcp(tmp_path, monkeypatch):
    for name in ("PORT", "MODEL_NAME", "STATE_DIR", "MAX_MODEL_LEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "models").mkdir()
    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(tmp_path / "models")], [str(tmp_path / "evidence")], environ={})
    return create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}))


async def _read(c: Client, uri: str) -> str:
    return (await c.read_resource(uri))[0].text


async def _refused(c: Client, uri: str) -> str:
    with pytest.raises(Exception) as ei:
        await c.read_resource(uri)
    return str(ei.value)


def test_resources_templates_and_prompts_are_listed_under_the_default_toolsets(mcp):
    async def go():
        async with Client(mcp) as c:
            return (await c.list_resources(), await c.list_resource_templates(), await c.list_prompts())

    res, templates, prompts = run(go())
    listed = {str(r.uri): r for r in res} | {t.uri_template: t for t in templates}
    assert set(listed) == set(RESOURCES)
    assert {f"{SCHEME}://evidence/{{run*}}/summary.md", f"{SCHEME}://evidence/{{run*}}/summary.json",
            f"{SCHEME}://evidence/{{run*}}/capacity.md", f"{SCHEME}://evidence/{{run*}}/capacity.json",
            f"{SCHEME}://server/log/{{lines}}", f"{SCHEME}://evidence/runs/page/{{page}}"} == {
        t.uri_template for t in templates}
    for uri, spec in RESOURCES.items():
        assert listed[uri].mime_type == spec.mime_type and listed[uri].description and listed[uri].title, uri
    by_name = {p.name: p for p in prompts}
    assert set(by_name) == {"deploy_t4", "deploy_cpu", "compare_builds"}
    assert [a.name for a in by_name["compare_builds"].arguments] == list(PROMPTS["compare_builds"].arguments)
    assert all(a.description and not a.required for p in prompts for a in p.arguments)


def test_config_marks_what_the_environment_and_the_server_override(mcp, tmp_path, monkeypatch):
    monkeypatch.setenv("PORT", "8123")
    monkeypatch.delenv("FRONT_DOOR")  # the suite's own pin (conftest): tpu.env's value here

    async def go():
        async with Client(mcp) as c:
            return json.loads(await _read(c, f"{SCHEME}://config"))

    cfg = run(go())
    rows = {r["name"]: r for r in cfg["variables"]}
    assert cfg["env_file"] == str(ROOT / "tpu.env")
    assert rows["PORT"] == {"name": "PORT", "value": 8123, "source": "environment", "file_value": "8000"}
    assert rows["STATE_DIR"]["source"] == "override" and rows["STATE_DIR"]["value"] == str(tmp_path / "run")
    assert rows["MODEL_NAME"]["source"] == "file" and "file_value" not in rows["MODEL_NAME"]
    assert cfg["overridden"] == ["PORT", "STATE_DIR"] and cfg["base_url"].endswith(":8123")


def test_evidence_runs_are_listed_and_read_inside_the_roots_only(mcp, tmp_path):
    ev = tmp_path / "evidence"
    sweep = ev / "sweeps" / "20261129-emb4"
    sweep.mkdir(parents=True)
    (sweep / "summary.md").write_text("| cell | tok/s |\n")
    (sweep / "summary.json").write_text('{"label": "emb4"}')
    cap = ev / "capacity-20261205-emb4"  # a capacity run: its report beside its cells' summary
    cap.mkdir(parents=True)
    (cap / "summary.json").write_text("{}")
    (cap / "capacity.md").write_text("capacity: 4 concurrent users\n")
    (ev / "evals" / "e1").mkdir(parents=True)
    (ev / "evals" / "e1" / "summary.json").write_text("{}")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "summary.md").write_text("SECRET")
    (ev / "escape").symlink_to(outside)

    async def go():
        async with Client(mcp) as c:
            index = json.loads(await _read(c, f"{SCHEME}://evidence/runs"))
            md = await _read(c, f"{SCHEME}://evidence/sweeps/20261129-emb4/summary.md")
            js = await _read(c, f"{SCHEME}://evidence/sweeps/20261129-emb4/summary.json")
            missing = await _refused(c, f"{SCHEME}://evidence/sweeps/nope/summary.md")
            no_md = await _refused(c, f"{SCHEME}://evidence/evals/e1/summary.md")
            escape = await _refused(c, f"{SCHEME}://evidence/escape/summary.md")
            report = await _read(c, f"{SCHEME}://evidence/capacity-20261205-emb4/capacity.md")
            return index, md, js, missing, no_md, escape, report

    index, md, js, missing, no_md, escape, report = run(go())
    runs = {r["run"]: r for r in index["runs"]}
    # the symlink out of the roots is not a run
    assert set(runs) == {"sweeps/20261129-emb4", "evals/e1", "capacity-20261205-emb4"}
    assert runs["capacity-20261205-emb4"]["uris"][-1].endswith("/capacity.md") and report.startswith("capacity: 4")
    assert runs["evals/e1"]["uris"] == [f"{SCHEME}://evidence/evals/e1/summary.json"]
    assert md == "| cell | tok/s |\n" and json.loads(js) == {"label": "emb4"}
    assert missing.startswith("no summary.md for run sweeps/nope under the evidence roots")
    assert f"{SCHEME}://evidence/runs" in missing and "Traceback" not in missing
    assert no_md.startswith("no summary.md for run evals/e1")
    assert "outside the evidence roots" in escape and "SECRET" not in escape and str(outside) not in escape


@pytest.mark.parametrize("uri", ["evidence/../outside/summary.md", "evidence/sweeps/../../outside/summary.md",
                                 "evidence//etc/summary.md", "evidence/%2E%2E/outside/summary.md",
                                 "evidence/..%2Foutside/summary.md"])
def test_traversal_in_the_uri_is_refused_by_the_server(mcp, tmp_path, uri):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "summary.md").write_text("SECRET")

    async def go():
        # straight to the server: a client may normalise `..` away before sending, a hostile one does not
        with pytest.raises(Exception) as ei:
            await mcp.read_resource(f"{SCHEME}://{uri}")
        return str(ei.value)

    err = run(go())
    assert "SECRET" not in err and "Unknown resource" in err, err
    # and behind FastMCP's screening, the resource itself confines what it reads
    from tools.mcp.resources import ResourceFailure, run_summary_md

    with pytest.raises(ResourceFailure, match="outside the evidence roots"):
        run_summary_md(mcp.gemma, "../outside")


def test_latest_demo_report_and_a_clean_error_without_one(mcp, tmp_path):
    ev = tmp_path / "evidence"

    async def read():
        async with Client(mcp) as c:
            try:
                return await _read(c, f"{SCHEME}://demo/latest")
            except Exception as exc:
                return f"ERROR {exc}"

    # an MCP-only client cannot run the CLI: the prompt that makes the same walk through the tools comes first
    missing = run(read())
    assert missing.startswith(f"ERROR no demo report under the evidence roots ({ev}): follow the deploy_cpu prompt")
    assert missing.index("deploy_cpu") < missing.index("./vllm-t4 demo")
    for name, t in (("demo-old", 1_000_000), ("demo-new", 2_000_000), ("not-a-demo", 3_000_000)):
        (ev / name).mkdir()
        body = {"probe_verdict": "qat", "served": []} if name.startswith("demo") else {"cells": []}
        (ev / name / "report.json").write_text(json.dumps(body))
        (ev / name / "report.md").write_text(f"# {name}\n")
        os.utime(ev / name / "report.json", (t, t))
    assert run(read()) == f"<!-- {ev / 'demo-new'} -->\n# demo-new\n"

    # A newer demo folder inside the root whose report links out of the roots is not read: the newest of ours is.
    secret = tmp_path / "secret.md"
    secret.write_text("outside the roots\n")
    for name, linked in (("demo-link-md", "report.md"), ("demo-link-json", "report.json")):
        (ev / name).mkdir()
        (ev / name / "report.json").write_text(json.dumps({"probe_verdict": "qat", "served": []}))
        (ev / name / "report.md").write_text(f"# {name}\n")
        os.utime(ev / name / "report.json", (4_000_000, 4_000_000))
        (ev / name / linked).unlink()
        (ev / name / linked).symlink_to(secret if linked == "report.md" else tmp_path / "demo.json")
    (tmp_path / "demo.json").write_text(json.dumps({"probe_verdict": "qat", "served": []}))
    assert run(read()) == f"<!-- {ev / 'demo-new'} -->\n# demo-new\n"


def test_latest_demo_report_is_the_newest_by_its_own_timestamp(mcp, tmp_path):
    """A checkout or a copy resets file times: the report's own time decides (finished_at, else report.md's date
    line), whatever the files' times say."""
    ev = tmp_path / "evidence"
    reports = {"demo-nov29": ({}, "# a\n\n2026-11-29 16:33 UTC, vm, 496 s end to end.\n", 3_000_000),
               "demo-nov30": ({}, "# b\n\n2026-11-30 00:52 UTC, vm, 111 s end to end.\n", 2_000_000),
               "demo-dec01": ({"finished_at": "2026-12-01T08:00:00+00:00"}, "# c\n", 1_000_000),
               "demo-undated": ({}, "# d\n", 4_000_000)}
    for name, (extra, md, t) in reports.items():
        (ev / name).mkdir()
        (ev / name / "report.json").write_text(json.dumps({"probe_verdict": "qat", "served": [], **extra}))
        (ev / name / "report.md").write_text(md)
        os.utime(ev / name / "report.json", (t, t))

    async def read():
        async with Client(mcp) as c:
            return await _read(c, f"{SCHEME}://demo/latest")

    assert run(read()).startswith(f"<!-- {ev / 'demo-dec01'} -->")
    (ev / "demo-dec01" / "report.json").unlink()
    assert run(read()).startswith(f"<!-- {ev / 'demo-nov30'} -->")


def test_server_log_tail_and_a_clean_error_without_a_log(mcp, tmp_path):
    async def read():
        async with Client(mcp) as c:
            try:
                return await _read(c, f"{SCHEME}://server/log")
            except Exception as exc:
                return f"ERROR {exc}"

    err = run(read())
    assert err == f"ERROR no server log at {tmp_path / 'run' / 'vllm.log'}; start one with start_vllm_server"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "vllm.log").write_text("".join(f"line {i}\n" for i in range(300)))
    tail = run(read()).splitlines()
    assert tail[0] == "line 100" and tail[-1] == "line 299" and len(tail) == 200


def _sample(v):
    """A value for a placeholder taken from an earlier result."""
    if isinstance(v, Ref):
        return f"sweeps/run-of-step-{v.step}"
    if isinstance(v, list):
        return [_sample(x) for x in v]
    return v


def test_prompt_steps_name_real_tools_with_valid_arguments():
    from tools.mcp.catalog import load_all
    from tools.mcp.registry import TOOLSETS

    tools = load_all()
    # each prompt's walk with its defaults and with a member named (deploy_cpu's differ: the stand-in or a fetch)
    walks = [(spec, given) for spec in PROMPTS.values() for given in ({}, {"member": "E4B"})]
    for spec, given in walks:
        assert set(spec.toolsets) <= set(TOOLSETS)
        for i, step in enumerate(spec.bind(given), 1):
            assert step.tool in tools, (spec.name, step.tool)
            assert tools[step.tool].toolset in spec.toolsets, (spec.name, step.tool)
            params = tools[step.tool].params
            if params is None:
                assert step.args == {}, (spec.name, step.tool)
            else:  # the documented call is one the tool accepts
                params.from_mcp_args({k: _sample(v) for k, v in step.args.items()})
            assert (step.condition in CONDITIONS) if step.when else not step.condition, (spec.name, i)
            for ref in [v for v in step.args.values() if isinstance(v, list)] + [list(step.args.values())]:
                for r in (x for x in ref if isinstance(x, Ref)):
                    assert r.step < i and spec.steps[r.step - 1].tool == "run_sweep"
    # the article's orders
    assert [s.tool for s in PROMPTS["deploy_t4"].steps] == [
        "preflight", "plan_fit", "fetch_checkpoint", "probe_checkpoint", "preflight", "repack_checkpoint", "patch_turing",
        "start_vllm_server", "query_model"]
    # deploy_cpu: the stand-in is made without a member, the member's source fetched with one, in the same place
    cpu = {m: [s.tool for s in PROMPTS["deploy_cpu"].bind({"member": m})] for m in ("", "E4B")}
    assert cpu[""][:3] == ["preflight", "make_tiny_model", "probe_checkpoint"]
    assert cpu["E4B"] == ["preflight", "fetch_checkpoint"] + cpu[""][2:]
    cmp = [s.tool for s in PROMPTS["compare_builds"].steps]
    swap = cmp.index("start_vllm_server", 2)  # B in A's place, A served again when B fails
    assert cmp.index("compare_tokens") < swap < cmp.index("compare_sweeps") and "stop_vllm_server" not in cmp[:-1]
    assert PROMPTS["compare_builds"].steps[swap].args["replace"] is True
    assert [s.tool for _, _, s in walkthrough()][0] == "preflight" and walkthrough()[-2][2].tool == "compare_sweeps"


def test_prompts_take_the_member(mcp):
    """The member names the source, the repository fetched and the builds, and the planner sets the T4 flags:
    the 12B's all-4-bit build holds three 16,384-token requests, the 31B fits in no build."""
    async def go():
        async with Client(mcp) as c:
            e4b = await c.get_prompt("deploy_t4", {"member": "e4b"})
            twelve = await c.get_prompt("deploy_t4", {"member": "12B"})
            big = await c.get_prompt("deploy_t4", {"member": "31B"})
            cmp = await c.get_prompt("compare_builds", {"member": "E4B"})
            try:
                await c.get_prompt("deploy_t4", {"member": "7B"})
                refused = ""
            except Exception as exc:
                refused = str(exc)
            return [x.messages[0].content.text for x in (e4b, twelve, big, cmp)] + [refused]

    e4b, twelve, big, cmp, refused = run(go())
    assert ('fetch_checkpoint(repo_id="google/gemma-4-E4B-it-qat-q4_0-unquantized", '
            'out="gemma-4-E4B-it-qat-q4_0-unquantized")') in e4b
    assert 'repack_checkpoint(source="gemma-4-E4B-it-qat-q4_0-unquantized", ' \
           'output="gemma-4-E4B-it-qat-q4_0-w4a16-ct-text-emb4")' in e4b
    assert "max_num_seqs=3)" in twelve and "E4B answers in words" in e4b
    assert "31B does not fit one T4 in any build" in big and "stop after plan_fit" in big
    assert 'build_b="gemma-4-E4B-it-qat-q4_0-w4a16-ct-text"' in cmp or "gemma-4-E4B-it-qat-q4_0-w4a16-ct-text" in cmp
    assert "7B" in refused and "not a Gemma 4 member" in refused


@pytest.mark.parametrize("member", ["31B", "26B-A4B"])
def test_a_member_that_fits_no_t4_ends_the_t4_walk_after_plan_fit(mcp, member):
    """The planner fits 31B and 26B-A4B in no T4 build: deploy_t4 ends after plan_fit with the planner's figures
    and what it would need, and invents no T4 flags; compare_builds warns the same way."""
    async def go():
        async with Client(mcp) as c:
            return [(await c.get_prompt(n, {"member": member})).messages[0].content.text
                    for n in ("deploy_t4", "compare_builds")]

    deploy, compare = run(go())
    steps = [line.split("`")[1].split("(")[0] for line in deploy.splitlines() if line[:1].isdigit()]
    assert steps == ["preflight", "plan_fit"] and "t4_flags null" in deploy
    for banned in ("fetch_checkpoint", "repack_checkpoint", "start_vllm_server", "max_num_seqs", "T4 flags"
                   " (", "planner's T4 flags"):
        assert banned not in deploy, banned
    last = deploy.rsplit("\n\n", 1)[1]
    assert last.startswith(f"Stop here: the planner says {member} does not fit one T4 in any build")
    assert "GiB of weights where vLLM may use 13.50 GiB" in last and "would need a GPU of about" in last
    assert "not measured" in last
    assert f"the planner says {member} does not fit one T4 in any build" in compare.split("\n\n")[0]


def test_compare_builds_names_its_files_after_the_member_and_either_device():
    """Two members compared under one evidence root do not overwrite each other's record and sweeps (E2B keeps
    the article's names); the walk is worded for a GPU or a CPU, as deploy_cpu sends CPU users to it."""
    spec = PROMPTS["compare_builds"]
    e2b, e4b = spec.render({}), spec.render({"member": "E4B"})
    assert 'reference="tokens/E4B-int4-emb.json"' in e4b and 'label="E4B-bf16-emb"' in e4b
    assert 'output="sweeps/E4B-int4-emb-vs-E4B-bf16-emb.md"' in e4b
    assert 'reference="tokens/int4-emb.json"' in e2b and 'label="int4-emb"' in e2b
    assert 'label="mine"' in spec.render({"member": "E4B", "label_a": "mine"})  # the caller's label holds
    for text in (e2b, e4b):
        assert "One GPU serves" not in text and "free the GPU" not in text and "a GPU or a CPU" in text


def test_deploy_cpu_takes_the_member_and_says_where_its_fit_is_unknown(mcp):
    """Without a member deploy_cpu makes the tiny stand-in; with one, it fetches the member's repository and names
    the member's builds, and says plainly whether the member's fit on a CPU is known (E2B's builds were served on
    one at its real shapes, evidence/real-shapes.md) or not (the others)."""
    async def go():
        async with Client(mcp) as c:
            out = [await c.get_prompt("deploy_cpu", args) for args in (
                {}, {"member": "e4b"}, {"member": "E2B"}, {"member": "31B"},
                {"member": "E4B", "source": "mine", "output_bf16": "b"})]
            try:
                await c.get_prompt("deploy_cpu", {"member": "7B"})
                refused = ""
            except Exception as exc:
                refused = str(exc)
            return [x.messages[0].content.text for x in out] + [refused]

    tiny, e4b, e2b, big, given, refused = run(go())
    # the stand-in walk, as before: nothing fetched, the stand-in's folders
    assert '2. `make_tiny_model(out="tiny-gemma4-qat")`' in tiny and "fetch_checkpoint" not in tiny
    assert "nothing is downloaded" in tiny and 'start_vllm_server(model="tiny-emb4")' in tiny
    # a member: its repository fetched into its source folder, its two builds repacked and served
    assert ('2. `fetch_checkpoint(repo_id="google/gemma-4-E4B-it-qat-q4_0-unquantized", '
            'out="gemma-4-E4B-it-qat-q4_0-unquantized")` — only when the source folder does not exist') in e4b
    assert "make_tiny_model" not in e4b and "enable_toolset" in e4b
    assert ('repack_checkpoint(source="gemma-4-E4B-it-qat-q4_0-unquantized", '
            'output="gemma-4-E4B-it-qat-q4_0-w4a16-ct-text", embed_int4=false)') in e4b
    assert 'start_vllm_server(model="gemma-4-E4B-it-qat-q4_0-w4a16-ct-text-emb4")' in e4b
    assert "build_b=gemma-4-E4B-it-qat-q4_0-w4a16-ct-text and " in e4b and "E4B answers in words" in e4b
    # its fit on a CPU: measured for E2B and E4B (its decode rate on 2 AVX2 cores), unknown for the 31B
    assert "0.52 tok/s" in e4b and "evidence/real-shapes.md" in e4b  # measured, and where
    assert "all-4-bit build (4.26 GiB)" in e4b
    assert "Whether 31B fits this machine is not known" in big
    assert "not known" not in e2b and "evidence/real-shapes.md" in e2b and "7.8 GB" in e2b
    assert "tiny-gemma4-qat" not in e2b and 'out="gemma-4-E2B-it-qat-q4_0-unquantized"' in e2b
    # the caller's folders hold over the member's
    assert 'fetch_checkpoint(repo_id="google/gemma-4-E4B-it-qat-q4_0-unquantized", out="mine")' in given
    assert 'output="b", embed_int4=false' in given
    assert "7B" in refused and "not a Gemma 4 member" in refused


def test_prompts_render_the_callers_arguments(mcp):
    async def go():
        async with Client(mcp) as c:
            d = await c.get_prompt("deploy_t4", {"source": "qat", "output": "emb4"})
            b = await c.get_prompt("compare_builds", {})
            return d.messages[0].content.text, b.messages[0].content.text

    deploy, compare = run(go())
    assert '2. `plan_fit(member="E2B")`' in deploy
    assert '3. `fetch_checkpoint(repo_id="google/gemma-4-E2B-it-qat-q4_0-unquantized", out="qat")` — only when' in deploy
    assert '6. `repack_checkpoint(source="qat", output="emb4")`' in deploy
    assert ('8. `start_vllm_server(model="emb4", gpu_memory_utilization=0.9, max_model_len=16384, max_num_seqs=8)`'
            in deploy and "start_job" in deploy)
    # what query_model shows is true of both models: the tiny stand-in gives its pattern's tokens, not text
    assert "sensible" not in deploy and "the tiny stand-in answers tokens of its training pattern" in deploy
    assert 'compare_sweeps(run_dirs=[<run_dir from step 9>, <run_dir from step 5>], ' \
           'output="sweeps/int4-emb-vs-bf16-emb.md")' in compare
    assert compare.endswith(f"({SCHEME}://evidence/runs lists them).")


def test_readme_shows_the_declared_resources_prompts_and_walkthrough():
    from tools.mcp.readme import resources_section

    doc = (ROOT / "docs" / "mcp.md").read_text()
    assert resources_section() in doc, "docs/mcp.md's resources section is stale: run python -m tools.mcp.readme"
