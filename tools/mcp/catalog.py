"""Every MCP tool: importing the capability modules declares their tools in the registry (tools/mcp/registry.py).

The tool modules import the registry, never this module; the app and the docs renderer import this one.
"""

from __future__ import annotations

from tools.mcp import (deploy_tools, eval_tools, fleet_tools, gpu_tools, job_tools,  # noqa: F401
                       measure_tools, repack_tools, serving_tools, toolset_tools)
from tools.mcp.registry import TOOLS, ToolSpec


def load_all() -> dict[str, ToolSpec]:
    """Every declared tool by name, in declaration order."""
    return TOOLS


__all__ = ["load_all"]
