"""Tool errors over an in-memory MCP client: one line naming the argument and the fix, a little of the input,
and a machine-readable detail."""

from __future__ import annotations

import asyncio

import pytest
from fastmcp import Client


def run(coro):
    return asyncio.run(coro)


async def _errors(mcp, calls: list[tuple[str, dict]]) -> list:
    async with Client(mcp) as c:
        return [await c.call_tool(name, args, raise_on_error=False) for name, args in calls]


def test_over_long_inputs_are_named_echoed_short_and_keep_the_fix(mcp):
    long = "x" * 3000
    results = run(_errors(mcp, [
        ("probe_checkpoint", {"path": long}),
        ("compare_tokens", {"mode": "check", "reference": long, "base_url": "http://127.0.0.1:9"}),
        ("start_vllm_server", {"model": "a/" + long}),
        ("repack_checkpoint", {"source": "a", "output": "b", "scheme": long}),
        ("run_sweep", {"base_url": "http://127.0.0.1:9", "label": "a b" + long}),
        ("job_status", {"job_id": "job-abcdef-" + "1" * 3000}),
    ]))
    texts = [r.content[0].text for r in results]
    assert all(r.is_error for r in results), texts
    for text, (name, fix) in zip(texts, [("path", "shorter"), ("reference", "shorter"), ("model", "shorter"),
                                         ("scheme", "choose one of"), ("label", "no spaces or slashes"),
                                         ("job", "start it again")]):
        assert "\n" not in text and not text.startswith("OSError"), text
        assert text.startswith(name) and fix in text, text
        assert text.count("x") + text.count("1") <= 210 and len(text) < 600, text


def test_error_results_carry_the_message_and_a_machine_readable_detail(mcp):
    bad_instance, outside = run(_errors(mcp, [("server_status", {"instance": "../x"}),
                                              ("probe_checkpoint", {"path": "../outside"})]))
    for r in (bad_instance, outside):
        assert r.is_error and r.structured_content["error"] == r.content[0].text, r
        assert isinstance(r.structured_content["detail"], dict), r.structured_content
    assert "../x" in bad_instance.structured_content["detail"]["instance"]
    assert outside.structured_content["detail"] == {"argument": "path", "input": "../outside",
                                                    "problem": "outside-roots"}


def test_a_failed_job_carries_the_detail_a_direct_call_would(mcp, roots):
    async def go():
        async with Client(mcp) as c:
            # a checkpoint without weights: refused inside the job, by the library
            (roots.models[0] / "empty").mkdir()
            (roots.models[0] / "empty" / "config.json").write_text("{}")
            started = await c.call_tool("start_job", {"tool": "repack_checkpoint",
                                                      "arguments": {"source": "empty", "output": "out"}})
            return (await c.call_tool("job_status", {"job_id": started.structured_content["job_id"],
                                                     "wait_s": 30})).structured_content

    info = run(go())
    assert info["state"] == "failed" and info["error"], info
    assert isinstance(info["error_detail"], dict), info


def test_arguments_the_schema_refuses_are_one_line_naming_the_argument(mcp):
    calls = [("probe_checkpoint", {}), ("probe_checkpoint", {"path": 5}), ("probe_checkpoint", {"path": "x", "bogus": 1}),
             ("job_status", {"job_id": "x", "wait_s": -1}), ("server_logs", {"lines": 10**9}),
             ("start_job", {"tool": "repack_checkpoint", "arguments": {"source": 3, "output": "o"}})]
    results = run(_errors(mcp, calls))
    for (name, _), r, argument in zip(calls, results, ["path", "path", "bogus", "wait_s", "lines", "source"]):
        text = r.content[0].text
        assert r.is_error and "\n" not in text and "pydantic" not in text, text
        assert text.startswith(f"{name if name != 'start_job' else 'repack_checkpoint'}: argument {argument}: "), text
        assert r.structured_content["detail"]["argument"] == argument, r.structured_content


def test_booleans_and_numbers_are_strict_as_the_schema_says(mcp):
    results = run(_errors(mcp, [
        ("repack_checkpoint", {"source": "a", "output": "b", "force": "yes"}),
        ("repack_checkpoint", {"source": "a", "output": "b", "text_only": 0}),
        ("start_job", {"tool": "repack_checkpoint", "arguments": {"source": "a", "output": "b", "force": "yes"}}),
        ("server_logs", {"lines": "5"}),
        ("job_status", {"job_id": "x", "wait_s": 1}),  # an integer is a number: accepted, then no such job
    ]))
    texts = [r.content[0].text for r in results]
    assert [t.split(": ")[1] for t in texts[:4]] == ["argument force", "argument text_only", "argument force",
                                                     "argument lines"], texts
    assert "no job 'x'" in texts[4], texts


def test_start_job_refuses_what_a_direct_call_refuses_before_handing_out_a_job_id(mcp, roots):
    (roots.models[0] / "src").mkdir()
    (roots.models[0] / "src" / "config.json").write_text("{}")
    calls = [("repack_checkpoint", {"source": "src", "output": "../outside/x"}),
             ("start_vllm_server", {"instance": "../../x"}),
             ("start_vllm_server", {"model": "../elsewhere"}),
             ("run_sweep", {"base_url": "http://127.0.0.1:9", "label": "a b"}),
             ("compare_tokens", {"mode": "check"})]

    async def go():
        async with Client(mcp) as c:
            out = []
            for tool, args in calls:
                direct = await c.call_tool(tool, args, raise_on_error=False)
                job = await c.call_tool("start_job", {"tool": tool, "arguments": args}, raise_on_error=False)
                out.append((direct, job))
            return out, (await c.call_tool("list_jobs", {})).structured_content["jobs"]

    pairs, jobs = run(go())
    for (direct, job), (tool, _) in zip(pairs, calls):
        assert direct.is_error and job.is_error, (tool, job.structured_content)
        assert job.structured_content == direct.structured_content, tool
    assert jobs == []


def test_unreadable_resources_are_invalid_params_and_never_listed(mcp, roots, tmp_path):
    import json

    from mcp_types import INVALID_PARAMS

    ev = roots.evidence[0]
    (ev / "ok").mkdir()
    (ev / "ok" / "summary.md").write_text("# ok\n")
    (tmp_path / "outside.md").write_text("outside the roots\n")
    (ev / "linked").mkdir()
    (ev / "linked" / "summary.md").symlink_to(tmp_path / "outside.md")

    async def go():
        async with Client(mcp) as c:
            index = json.loads((await c.read_resource("gemma4-t4://evidence/runs"))[0].text)
            codes = []
            for uri in ("gemma4-t4://evidence/nonexistent/summary.md", "gemma4-t4://evidence/linked/summary.md"):
                with pytest.raises(Exception) as ei:
                    await c.read_resource(uri)
                codes.append((ei.value.error.code, str(ei.value)))
            return index, codes

    index, codes = run(go())
    assert [r["run"] for r in index["runs"]] == ["ok"], index
    assert [c for c, _ in codes] == [INVALID_PARAMS, INVALID_PARAMS], codes
    assert "evidence/runs" in codes[0][1] and "outside the evidence roots" in codes[1][1], codes
    assert "outside the roots" not in codes[1][1]


def test_prompts_refuse_unknown_and_over_long_arguments(mcp):
    from mcp_types import INVALID_PARAMS

    async def go():
        async with Client(mcp) as c:
            out = []
            for args in ({"bogus": "x"}, {"output": "x" * 100_000}):
                with pytest.raises(Exception) as ei:
                    await c.get_prompt("deploy_t4", args)
                out.append((ei.value.error.code, str(ei.value)))
            ok = await c.get_prompt("deploy_t4", {"output": "my-build"})
            return out, ok.messages[0].content.text

    refused, text = run(go())
    assert all(code == INVALID_PARAMS for code, _ in refused), refused
    assert "unknown argument bogus" in refused[0][1] and "source, output, repo_id" in refused[0][1]
    assert "argument output is 100000 characters" in refused[1][1] and len(refused[1][1]) < 300
    assert "my-build" in text


def test_marked_parameters_and_operations_are_rendered_as_arguments_and_tools():
    """A library message names a parameter by its field and a remedy by its operation; MCP spells them as the
    argument and the tool (the command line as --flag and ./vllm-t4 ...), and the failure's field is
    detail.argument."""
    from repack.errors import RepackError
    from tools.core.errors import BadInput, ToolFailure, op, param
    from tools.mcp.errors import to_tool_error

    err = to_tool_error(BadInput(f"{param('out')} holds something else: choose another or pass "
                                 f"{param('force', True)} ({param('text_only', False)} for the full build); "
                                 f"stop it first with {op('stop')}", field="out"))
    assert str(err) == ("out holds something else: choose another or pass force=true (text_only=false for the "
                        "full build); stop it first with stop_vllm_server")
    assert err.detail == {"argument": "out"}
    fetch = to_tool_error(ToolFailure(f"no source: {op('fetch', repo_id='google/x', out='qat')}, then "
                                      f"{op('doctor')}, {op('probe')}, {op('patch_turing')}, {op('tiny_model')}"))
    assert str(fetch) == ("no source: fetch_checkpoint (repo_id=google/x, out=qat), then preflight, "
                          "probe_checkpoint, patch_turing, make_tiny_model")
    assert str(to_tool_error(RepackError(f"{param('scheme')} 'x': unknown"))).startswith("scheme 'x'")
    assert str(to_tool_error(ToolFailure(f"record first with {op('fidelity.record')}"))) == \
        "record first with compare_logprobs (mode=record)"
    # a remedy carried in the detail (a failing check's line, every check of a refused start) is spelled too:
    # no mark reaches a client
    checks = to_tool_error(ToolFailure("output: x exists", {"checks": [{"fix": f"pass {param('force', True)}"}]}))
    assert checks.detail == {"checks": [{"fix": "pass force=true"}]}
