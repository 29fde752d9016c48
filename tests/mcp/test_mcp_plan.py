"""The MCP tool plan_fit: a member by name, an unknown name and a path outside the roots refused."""

from __future__ import annotations

import asyncio

from fastmcp import Client


def test_mcp_plan_fit(mcp, roots):
    async def go():
        async with Client(mcp) as c:
            r = await c.call_tool("plan_fit", {"member": "E4B"})
            assert r.structured_content["member"] == "E4B"
            assert "all-4-bit build fits" in r.content[0].text
            bad = await c.call_tool("plan_fit", {"member": "9B"}, raise_on_error=False)
            assert bad.is_error and "member" in bad.content[0].text
            out = await c.call_tool("plan_fit", {"path": "../x"}, raise_on_error=False)
            assert out.is_error
    asyncio.run(go())


def test_plan_fit_answers_fit_unclipped_for_every_member(mcp):
    """Every member's plan fits the result budget whole: nothing clipped, the readable table in full, what was left
    out named (the command line's --json), and the summary says the figures are the planner's, not measured."""
    from repack.build.fit import plan_member
    from repack.family.members import by_name
    from tools.mcp.bounded import RESULT_BUDGET

    async def go():
        async with Client(mcp) as c:
            return {m: await c.call_tool("plan_fit", {"member": m}) for m in ("E2B", "E4B", "12B", "26B-A4B", "31B")}

    for member, r in asyncio.run(go()).items():
        data = r.structured_content
        assert sum(len(t.text) for t in r.content) <= RESULT_BUDGET and "clipped" not in data, member
        assert data["table"] == plan_member(by_name(member)).format_table()
        assert f"python -m repack plan --member {member} --json" in data["whole"]
        assert [b["build"] for b in data["builds"]] == ["bf16", "qat-w4a16-ct", "repack-bf16-emb", "all-4-bit"]
        assert "the planner's figures (on paper, planned for a T4; not measured)" in data["summary"]
        # the error bars are E2B's, measured; every other member's are unknown, and the answer says which
        said = "error validated against the article" if member == "E2B" else f"error unknown (no {member} measurement)"
        assert said in data["summary"] and data["error"]["validated"] == (member == "E2B"), data["summary"]


def test_a_text_shape_of_the_wrong_type_is_one_line_through_mcp(mcp, roots):
    """num_experts as a string or a list in text_config: plan_fit and probe_checkpoint name the key (a bare
    "TypeError: '>' not supported" before)."""
    import json

    from repack.stand_ins.synthetic import write_small_checkpoint

    src = write_small_checkpoint(roots.models[0] / "src")
    cfg = json.loads((src / "config.json").read_text())

    async def go(value):
        cfg["text_config"]["num_experts"] = value
        (src / "config.json").write_text(json.dumps(cfg))
        async with Client(mcp) as c:
            return [await c.call_tool(tool, {"path": "src"}, raise_on_error=False)
                    for tool in ("plan_fit", "probe_checkpoint")]

    for value in ("4", [4]):
        for r in asyncio.run(go(value)):
            text = r.content[0].text
            assert r.is_error and "text_config.num_experts" in text and "not a whole number" in text, text
            assert "\n" not in text and "TypeError" not in text
