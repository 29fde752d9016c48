"""How MCP spells what a library message marks (tools.core.errors.param / op): a parameter as the tool's
argument, an operation as the tool that does it."""

from __future__ import annotations

import json
from typing import Any

from tools.core.commands import command_line
from tools.core.errors import Renderer
from tools.gpu.vram import vram_status
from tools.measure.provenance import cpu_model

# Operations (tools.core.errors.op) -> the MCP tool that does each and the arguments that pick the mode: filled by
# the tools' declarations (`@tool(ops=...)`, tools.mcp.registry).
OPERATION_TOOLS: dict[str, tuple[str, dict[str, Any]]] = {}
# Operations no MCP tool does, and how an MCP client gets them done instead (`{command}`: the command line's).
WITHOUT_TOOL: dict[str, str] = {
    "demo": "the deploy_cpu (or, on a T4, deploy_t4) prompt",
    "swap": "{command} as root on the server's machine (no MCP tool: the swapfile needs root)",
    "pareto": "{command} on the command line (no MCP tool: it plots several sweep or capacity runs into one "
              "folder)",
}


def on_platform(platform: str | None) -> str:
    """Where a figure of a served build was measured, for a summary line, naming the CPU or the GPU: a CPU figure
    read as a T4's misleads. The servers this project starts run on this machine."""
    if platform == "cpu":
        return f"on the CPU stand-in (vLLM CPU backend, {cpu_model() or 'CPU model unknown'})"
    if platform == "cuda":
        names = sorted({g.name for g in vram_status().gpus})
        return f"on the GPU ({', '.join(names) or 'name unknown'})"
    return "where the server runs (its platform unrecorded)"


def warnings_text(warnings: list[str]) -> str:
    """A start's or switch's checks that warn, each as preflight says it, for the end of its summary."""
    return "".join(f"; warning: {w}" for w in warnings)


def argument(name: str, *value: Any) -> str:
    """A parameter as an MCP argument: `out`, `force=true`, `text_only=false`, `port=8001`."""
    if not value:
        return name
    v = value[0]
    return f"{name}={v if isinstance(v, str) else json.dumps(v)}"


def tool_call(name: str, args: dict[str, Any]) -> str:
    """An operation as the MCP tool that does it: `stop_vllm_server`, `fetch_checkpoint (repo_id=..., out=...)`;
    one no tool does as WITHOUT_TOOL says, else as the command line spells it."""
    if name not in OPERATION_TOOLS:
        command = command_line(name, args)
        return WITHOUT_TOOL.get(name, "{command} on the command line").format(command=command)
    tool, fixed = OPERATION_TOOLS[name]
    # env_file is the command line's: this server's configuration is the one it was launched with
    shown = {**fixed, **{k: v for k, v in args.items() if k != "env_file"}}
    return tool + (" (" + ", ".join(argument(k, v) for k, v in shown.items()) + ")" if shown else "")


MCP = Renderer(param=argument, op=tool_call)


__all__ = ["MCP", "OPERATION_TOOLS", "WITHOUT_TOOL", "argument", "tool_call"]
