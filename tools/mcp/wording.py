"""How MCP spells what a library message marks (tools.core.errors.param / op): a parameter as the tool's
argument, an operation as the tool that does it."""

from __future__ import annotations

import json
from typing import Any

from tools.core.errors import Renderer

# Operations (tools.core.errors.op) as the MCP tools that do them, with the arguments that pick the mode.
TOOL_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "start": ("start_vllm_server", {}),
    "stop": ("stop_vllm_server", {}),
    "status": ("server_status", {}),
    "log": ("server_logs", {}),
    "query": ("query_model", {}),
    "router.start": ("start_router", {}),
    "router.stop": ("stop_router", {}),
    "router.status": ("router_status", {}),
    "router.switch": ("switch_build", {}),
    "probe": ("probe_checkpoint", {}),
    "repack": ("repack_checkpoint", {}),
    "tiny_model": ("make_tiny_model", {}),
    "fetch": ("fetch_checkpoint", {}),
    "doctor": ("preflight", {}),
    "patch_turing": ("patch_turing", {}),
    "sweep": ("run_sweep", {}),
    "sweep_compare": ("compare_sweeps", {}),
    "compare_tokens": ("compare_tokens", {}),
    "compare_tokens.record": ("compare_tokens", {"mode": "record"}),
    "decode": ("run_decode_bench", {}),
    "eval": ("run_eval", {}),
    "eval_compare": ("compare_evals", {}),
    "fidelity.record": ("compare_logprobs", {"mode": "record"}),
    "fidelity.check": ("compare_logprobs", {"mode": "check"}),
    "vram": ("vram_status", {}),
    "demo": ("the deploy_cpu (or, on a T4, deploy_t4) prompt", {}),
    "capacity": ("find_capacity", {}),
    "capacity_compare": ("compare_sweeps", {}),
}

def argument(name: str, *value: Any) -> str:
    """A parameter as an MCP argument: `out`, `force=true`, `text_only=false`, `port=8001`."""
    if not value:
        return name
    v = value[0]
    return f"{name}={v if isinstance(v, str) else json.dumps(v)}"


def tool_call(name: str, args: dict[str, Any]) -> str:
    """An operation as the MCP tool that does it: `stop_vllm_server`, `fetch_checkpoint (repo_id=..., out=...)`;
    an operation no tool does keeps its name."""
    tool, fixed = TOOL_NAMES.get(name, (name, {}))
    shown = {**fixed, **args}
    return tool + (" (" + ", ".join(argument(k, v) for k, v in shown.items()) + ")" if shown else "")


MCP = Renderer(param=argument, op=tool_call)


__all__ = ["MCP", "TOOL_NAMES", "argument", "tool_call"]
