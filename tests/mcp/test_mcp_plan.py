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
