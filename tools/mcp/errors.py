"""Library failures as MCP tool errors: one line, with parameters rendered as arguments and operations as tools.

A library message marks the parameter or operation that fixes it (tools.core.errors.param / op); MCP renders
`param("out")` as `out`, `param("force", True)` as `force=true` and `op("stop")` as `stop_vllm_server`, and
`ToolFailure.field` becomes `detail.argument`. A message not marked passes through as written.
"""

from __future__ import annotations

import json
from typing import Any

from fastmcp.exceptions import ToolError
from pydantic import ValidationError

from repack.errors import RepackError
from tools.core.errors import Renderer, ToolFailure, render
from tools.core.paths import PathNotAllowed
from tools.core.text import clip
from tools.mcp.jobs import Busy, JobCancelled

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
    "probe": ("probe_checkpoint", {}),
    "repack": ("repack_checkpoint", {}),
    "fetch": ("fetch_checkpoint", {}),
    "doctor": ("preflight", {}),
    "patch_turing": ("patch_turing", {}),
    "sweep": ("run_sweep", {}),
    "sweep_compare": ("compare_sweeps", {}),
    "compare_tokens": ("compare_tokens", {}),
    "decode": ("run_decode_bench", {}),
    "eval": ("run_eval", {}),
    "eval_compare": ("compare_evals", {}),
    "fidelity.record": ("compare_logprobs", {"mode": "record"}),
    "fidelity.check": ("compare_logprobs", {"mode": "check"}),
    "vram": ("vram_status", {}),
}
MESSAGE_LIMIT = 600  # characters of an MCP error line


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

# The errors whose message is written for the caller; anything else is named by its type as well.
OURS: tuple[type[BaseException], ...] = (RepackError, ToolFailure, PathNotAllowed, Busy, JobCancelled, KeyError,
                                         ValueError, FileNotFoundError, FileExistsError, ToolError)

# FastMCP checks a direct call against the tool function's signature, start_job against the parameter model: the
# signature's words for a missing or unknown argument become the model's, so both say the same.
_MODEL_WORDS = {"missing_keyword_only_argument": ("missing", "Field required"),
                "unexpected_keyword_argument": ("extra_forbidden", "Extra inputs are not permitted")}


def argument_error(exc: ValidationError, tool: str | None = None) -> ToolFailure:
    """Arguments a tool's parameter model refuses, as one line naming the (first) argument and the problem."""
    first = exc.errors(include_url=False)[0]
    loc = ".".join(map(str, first["loc"])) or "?"
    problem, msg = _MODEL_WORDS.get(first["type"], (first["type"], first["msg"]))
    detail: dict[str, Any] = {"argument": loc, "problem": problem, "errors": exc.error_count()}
    if "input" in first and problem != "missing":
        detail["input"] = clip(first["input"])
    if tool:
        detail["tool"] = tool
    return ToolFailure(f"{tool + ': ' if tool else ''}argument {loc}: {msg}", detail)


def one_line(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` on one line, at most about `limit` characters (tools.core.text.clip keeps its end: what to do)."""
    return clip(" ".join(str(text).split()), limit)


class ToolRefusal(ToolError):
    """A tool error: the one-line message and the library's machine-readable detail (None where it gave none)."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.detail = detail


def to_tool_error(exc: BaseException) -> ToolRefusal:
    """The library's one-line message rendered for MCP (`detail.argument` from the failure's field); the type
    named when it is not one of ours."""
    if isinstance(exc, ValidationError):
        exc = argument_error(exc)
    if isinstance(exc, ToolFailure):
        data = exc.to_dict(MCP)
        msg, detail = data["error"], data["detail"]
    else:
        msg, detail = render(str(exc), MCP), getattr(exc, "detail", None)
    msg = msg.strip() or type(exc).__name__
    if isinstance(exc, KeyError):
        msg = msg.strip("'\"")
    if not isinstance(exc, OURS):
        msg = f"{type(exc).__name__}: {msg}"
    return ToolRefusal(one_line(msg), detail if isinstance(detail, dict) else None)


__all__ = ["MCP", "OURS", "TOOL_NAMES", "ToolRefusal", "argument", "argument_error", "one_line", "to_tool_error",
           "tool_call"]
