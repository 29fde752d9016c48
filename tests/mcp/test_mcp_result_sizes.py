"""Small by default, whole on request: the default results of the tools and resources stay within RESULT_BUDGET
characters and say where the whole is (tools/mcp/bounded.py; bench/bench_mcp_result_sizes.py measures the walk)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from fastmcp import Client

from tests.helpers.stand_ins.measure import greedy_chat_stand_in, serve_in_thread
from tools.mcp.app import Settings, create_server
from tools.mcp.bounded import SUMMARY_MAX, RESULT_BUDGET, fit, size

LONG_PROMPTS = [f"needle {n}: " + "the quick brown fox jumps over the lazy dog. " * (n // 45) for n in
                (2_000, 8_000, 14_000)]


def run(coro):
    return asyncio.run(coro)


def test_fit_keeps_the_summary_and_where_the_whole_is():
    big = {"summary": "3 of 3", "path": "/e/x.json", "rows": [{"prompt": "p" * 5_000, "n": i} for i in range(40)],
           "note": "n" * 20_000}
    small = fit(big)
    assert size(small) <= RESULT_BUDGET and small["summary"] == "3 of 3" and small["path"] == "/e/x.json"
    assert "/e/x.json" in small["clipped"]
    assert all(isinstance(r, dict) for r in small.get("rows", []))  # a shortened list keeps its kind of items
    assert fit({"summary": "ok", "x": 1}) == {"summary": "ok", "x": 1}  # what fits is left alone
    # many short fields: the largest left out, by name, the rest (strings included) kept
    wide = {"summary": "s", "run_dir": "/e/r", "label": "emb4",
            **{f"f{i}": {f"k{j}": 123456.789 for j in range(8)} for i in range(60)}}
    cut = fit(wide)
    assert size(cut) <= RESULT_BUDGET and cut["label"] == "emb4" and cut["run_dir"] == "/e/r"
    assert "left out: f" in cut["clipped"]
    # the summary line is what an assistant repeats: whole (up to SUMMARY_MAX), never cut mid-sentence to make room
    line = "sweep s1 on the CPU stand-in: 4 ok; " + "; ".join(f"c=1 at in={n}: n/a of the roofline" for n in range(20))
    assert 600 < len(line) <= SUMMARY_MAX
    kept = fit({**wide, "summary": line})
    assert size(kept) <= RESULT_BUDGET and kept["summary"] == line, kept["summary"]
    # the note says where the whole is by the first such field, not by repeating every path the result keeps
    files = {f"f{i}": f"/e/r/{'x' * 80}-{i}.json" for i in range(6)}
    noted = fit({**wide, "summary": line, "files": files})
    assert noted["files"] == files and "; the whole: run_dir /e/r" in noted["clipped"]
    assert "x" * 80 not in noted["clipped"] and size(noted) <= RESULT_BUDGET


@pytest.fixture()
def chat_servers():
    """The reference and the candidate, which differs from it at token 3 of the last prompt, by a near-tie."""
    with serve_in_thread(greedy_chat_stand_in()) as a, serve_in_thread(greedy_chat_stand_in(LONG_PROMPTS[-1])) as b:
        yield a, b


def test_long_prompt_token_check_stays_small_and_writes_the_whole(roots, tmp_path, chat_servers):
    """The issue's walk: 11 prompts, three of 2k/8k/14k characters, recorded then checked: each result within the
    budget, one line per prompt with the counts that matter, the whole comparison in the evidence folder."""
    a, b = chat_servers
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}))
    ref = str(roots.evidence[0] / "tokens" / "ref.json")
    prompts = [f"prompt {i}: write one sentence about the Tesla T4" for i in range(8)] + LONG_PROMPTS

    async def go():
        async with Client(mcp) as c:
            rec = await c.call_tool("compare_tokens", {"mode": "record", "reference": ref, "base_url": a,
                                                       "prompts": prompts, "max_tokens": 64})
            chk = await c.call_tool("compare_tokens", {"mode": "check", "reference": ref, "base_url": b})
            return rec, chk

    rec, chk = run(go())
    for res in (rec, chk):
        shown = sum(len(t.text) for t in res.content)
        assert shown <= RESULT_BUDGET, (shown, res.content[0].text)
        assert "clipped" not in res.structured_content  # shaped by the tool, not cut by the guard
    data = chk.structured_content
    assert data["identical"] == 10 and data["total"] == 11
    last = data["prompts"][-1]
    assert last["first_divergence"] == 3 and last["verdict"] == "near-tie" and last["compared"] == 64
    lines = data["report"].splitlines()
    assert len(lines) == 12 and "identical, 64 tokens compared" in lines[0]
    assert "first divergence at token 3 of 64 (near-tie" in lines[10]
    whole = json.loads(Path(data["comparison_path"]).read_text())
    assert whole["prompts"][-1]["prompt"] == LONG_PROMPTS[-1]  # every prompt in full, in the file
    assert Path(data["comparison_path"]).parent == Path(ref).parent


def _next_uri(text: str) -> str | None:
    m = re.search(r"gemma4-t4://[\w/.-]+/\d+", text.split("\n", 1)[0] if not text.startswith("{") else
                  json.loads(text).get("next", ""))
    return m.group(0) if m else None


def test_resources_are_bounded_and_page_to_the_rest(roots, tmp_path):
    """The log and the evidence index, however long, answer within RESULT_BUDGET and name the URI of the next
    page; following them reads every line and every run once (evidence/runs/all answered 228,956 characters with
    300 runs, server/log/100000 70,102)."""
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}))
    cfg = mcp.gemma.config()
    cfg.log_file.parent.mkdir(parents=True, exist_ok=True)
    log = [f"INFO line {i} " + "x" * 120 for i in range(300)] + ["ERROR the end"]
    cfg.log_file.write_text("\n".join(log) + "\n")
    for i in range(300):
        run_dir = roots.evidence[0] / "sweeps" / f"run-{i:03d}"
        run_dir.mkdir(parents=True)
        (run_dir / "summary.json").write_text("{}")

    async def go():
        async with Client(mcp) as c:
            out = {}
            for first in ("gemma4-t4://server/log", "gemma4-t4://server/log/100000", "gemma4-t4://evidence/runs"):
                uri, pages = first, []
                while uri is not None and len(pages) < 400:
                    pages.append((await c.read_resource(uri))[0].text)
                    uri = None if first.endswith("server/log") else _next_uri(pages[-1])
                out[first] = pages
            return out

    got = run(go())
    tail = got["gemma4-t4://server/log"][0]
    assert len(tail) <= RESULT_BUDGET and tail.endswith("ERROR the end") and "server/log/" in tail
    log_pages = got["gemma4-t4://server/log/100000"]
    assert all(len(p) <= RESULT_BUDGET for p in log_pages) and len(log_pages) > 5
    read = [ln for p in log_pages for ln in p.split("\n")[1:] if ln]
    assert read == log  # every line once, in order
    index = [json.loads(p) for p in got["gemma4-t4://evidence/runs"]]
    assert all(len(p) <= RESULT_BUDGET for p in got["gemma4-t4://evidence/runs"]) and len(index) > 2
    assert index[0]["total"] == 300 and "evidence/runs/page/2" in index[0]["next"]
    names = [r["run"] for page in index for r in page["runs"]]
    assert sorted(names) == sorted(f"sweeps/run-{i:03d}" for i in range(300))
    assert "next" not in index[-1]


def test_a_page_or_line_count_that_is_no_whole_number_is_one_line(roots, tmp_path):
    """Past 4300 digits Python refuses to convert the text to an int: page/<5000 nines> answered its "Exceeds the
    limit" message; any number too long to be 1-100000 gets the same line as any other out of range."""
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}))

    async def go():
        out = {}
        async with Client(mcp) as c:
            for uri in ("evidence/runs/page/0", "evidence/runs/page/\u00b2", "evidence/runs/page/x",
                        "server/log/\u00b2", "server/log/100001", "evidence/runs/page/" + "9" * 5000,
                        "server/log/" + "9" * 5000):
                try:
                    await c.read_resource(f"gemma4-t4://{uri}")
                except Exception as exc:
                    out[uri] = str(exc)
        return out

    got = run(go())
    assert len(got) == 7, got
    for uri, err in got.items():
        assert "give a whole number" in err and "ValueError" not in err and "\n" not in err, (uri, err)


def test_every_resource_is_bounded_over_the_shipped_evidence(tmp_path):
    """docs/mcp.md: every resource within RESULT_BUDGET, pages included. Every listed resource and every run's
    summary and capacity URIs, over the evidence this project ships (its demo report and article runs are longer
    than the budget): each one bounded, and a shortened one names the file that holds the whole."""
    from tools.core.paths import Roots

    root = Path(__file__).resolve().parents[2]
    (tmp_path / "models").mkdir()
    roots = Roots.from_env([str(tmp_path / "models")], [str(root / "evidence")], environ={})
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}))

    async def go():
        async with Client(mcp) as c:
            uris = [str(r.uri) for r in await c.list_resources()]
            runs, page = [], "gemma4-t4://evidence/runs"
            while page:
                index = json.loads((await c.read_resource(page))[0].text)
                runs += index["runs"]
                page = index.get("next")
            uris += [u for r in runs for u in r["uris"]]
            out = {}
            for uri in uris:
                try:
                    out[uri] = (await c.read_resource(uri))[0].text
                except Exception as exc:  # the log before any start: a one-line error, bounded too
                    out[uri] = str(exc)
            return out

    got = run(go())
    assert "gemma4-t4://demo/latest" in got and "gemma4-t4://evidence/article-t4/emb4/summary.json" in got
    over = {u: len(t) for u, t in got.items() if len(t) > RESULT_BUDGET}
    assert not over, over
    shortened = {u: t for u, t in got.items() if "characters, shortened to" in t[:300]}
    assert "gemma4-t4://demo/latest" in shortened  # the shipped demo report is longer than the budget
    for uri, text in shortened.items():
        assert "the whole is the file " + str(root / "evidence") in text[:600], uri


@pytest.mark.parametrize("shape", ["e4b", "moe"])
def test_repack_result_lists_every_table_and_names_the_report(roots, tmp_path, shape):
    """repack_checkpoint's default result holds a row for every table with tensors (linears and experts too),
    none for an empty one, within the budget and unclipped; it names repack-report.json as the whole, and says
    all-4-bit only when every packed table is int4 (not for the bf16-embedding build)."""
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}))

    async def go():
        async with Client(mcp, timeout=600) as c:
            await c.call_tool("make_tiny_model", {"out": "src", "shape": shape})
            four = await c.call_tool("repack_checkpoint", {"source": "src", "output": "emb4"})
            bf16 = await c.call_tool("repack_checkpoint", {"source": "src", "output": "bf16", "embed_int4": False})
            return four, bf16

    four, bf16 = run(go())
    for r, out in ((four, "emb4"), (bf16, "bf16")):
        data = r.structured_content
        assert sum(len(t.text) for t in r.content) <= RESULT_BUDGET and "clipped" not in data, data.get("clipped")
        report = roots.models[0] / out / "repack-report.json"
        assert data["report_path"] == str(report) and str(report) in data["summary"]
        whole = {t["name"]: t for t in json.loads(report.read_text())["tables"]}
        assert [t["name"] for t in data["tables"]] == [
            n for n in ("linears", "experts", "PLE", "embed_tokens", "lm_head", "rest", "towers")
            if whole.get(n, {}).get("tensors")]
    names = [t["name"] for t in four.structured_content["tables"]]
    assert "linears" in names and ("experts" in names) == (shape == "moe") and ("PLE" in names) == (shape == "e4b")
    assert four.structured_content["all_4_bit"] and "all-4-bit" in four.structured_content["summary"]
    assert not bf16.structured_content["all_4_bit"] and "all-4-bit" not in bf16.structured_content["summary"]


def test_stop_all_over_many_damaged_records_stays_within_the_budget(roots, tmp_path):
    """stop_vllm_server(all=true) with 40 instance records it cannot read: every answer (the error's too) within
    RESULT_BUDGET, saying how many were left out and where the whole is (4,501 characters before)."""
    state = tmp_path / "run"
    for i in range(40):
        d = state / f"instance-{i:02d}-with-a-longer-name"
        d.mkdir(parents=True)
        (d / "vllm.json").write_text('{"pid": "abc", "port": ')  # cut short
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(state)}))

    async def go():
        async with Client(mcp) as c:
            return await c.call_tool("stop_vllm_server", {"all": True}, raise_on_error=False)

    r = run(go())
    shown = sum(len(t.text) for t in r.content)
    assert shown <= RESULT_BUDGET, (shown, r.content[0].text[:300])
    assert len(json.dumps(r.structured_content, separators=(",", ":"))) <= RESULT_BUDGET
    text = r.content[0].text
    assert "instance-00" in text and "40 could not be" in text and "38 more" in text, text[:500]


def test_a_shortened_log_names_the_file_it_was_read_from(roots, tmp_path):
    """With the front door the builds' logs are in their slots' folders (run/green/vllm-*.log) and run/vllm.log
    never exists: the log resource's line on where the rest is names the file it read, not run/vllm.log."""
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}))
    green = tmp_path / "run" / "green" / "vllm-20261207T105616.000000Z-1.log"
    green.parent.mkdir(parents=True)
    green.write_text("".join(f"INFO line {i} " + "x" * 120 + "\n" for i in range(300)))

    async def go():
        async with Client(mcp) as c:
            return (await c.read_resource("gemma4-t4://server/log"))[0].text

    first = run(go()).split("\n")[0]
    assert f"or the file {green}]" in first and "run/vllm.log" not in first, first


def test_a_server_log_that_is_a_link_is_not_read(roots, tmp_path):
    """run/vllm.log linked to a file outside the project's folders had `log`, server_logs and the log resource
    show that file's last lines to an MCP client: a log is STATE_DIR's own file, never read through a link."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the secret line\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "vllm.log").symlink_to(secret)
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(run_dir)}), toolsets="all")

    async def go():
        out = []
        async with Client(mcp) as c:
            for uri in ("gemma4-t4://server/log", "gemma4-t4://server/log/3"):
                try:
                    out.append((await c.read_resource(uri))[0].text)
                except Exception as exc:
                    out.append(str(exc))
            r = await c.call_tool("server_logs", {"lines": 3}, raise_on_error=False)
            out.append(r.content[0].text)
        return out

    for said in run(go()):
        assert "the secret line" not in said and "is a link" in said, said
