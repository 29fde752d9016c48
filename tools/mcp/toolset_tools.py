"""Toolsets within one session: list the toolsets and enable one without restarting the server.

The server lists a few toolsets to keep tools/list short; the rest stay one call away. Enabling marks the
toolset's tools visible for this session only (FastMCP's session visibility), which sends the client
`notifications/tools/list_changed`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tools.core.params import OpParams
from tools.mcp.registry import ALWAYS_LISTED, TOOLS, TOOLSETS, Reply, tool

ToolsetName = Literal[tuple(n for n in TOOLSETS if n != ALWAYS_LISTED)]  # type: ignore[valid-type]


class EnableToolsetParams(OpParams):
    toolset: ToolsetName = Field(description="The toolset to list")  # type: ignore[valid-type]


class ToolsetEnabled(BaseModel):
    toolset: str
    tools: list[str]


# Read-only: it changes what this session lists, nothing on the machine.
@tool(toolset=ALWAYS_LISTED, title="Enable a toolset", params=EnableToolsetParams, result=ToolsetEnabled,
      read_only=True, idempotent=True, context=True)
async def enable_toolset(app, p: EnableToolsetParams, ctx) -> Reply:
    """List a toolset's tools in this session (e.g. capacity: find_capacity)."""
    names = [n for n, s in TOOLS.items() if s.toolset == p.toolset]
    if ctx is not None:
        await ctx.enable_components(tags={p.toolset}, components={"tool"})
    res = ToolsetEnabled(toolset=p.toolset, tools=names)
    return Reply(res, f"toolset {p.toolset} ({TOOLSETS[p.toolset]}) enabled for this session: {', '.join(names)}")
