"""Library failures as MCP tool errors: one line, with parameters rendered as arguments and operations as tools.

A library message marks the parameter or operation that fixes it (tools.core.errors.param / op); MCP renders
`param("out")` as `out`, `param("force", True)` as `force=true` and `op("stop")` as `stop_vllm_server`, and
`ToolFailure.field` becomes `detail.argument`. A message not marked passes through as written.
"""

from __future__ import annotations

from typing import Any

from fastmcp.exceptions import ToolError
from pydantic import ValidationError

from repack.errors import RepackError
from tools.core.atomic_files import path_failure
from tools.core.errors import ToolFailure, render
from tools.core.paths import PathNotAllowed
from tools.core.text import clip
from tools.mcp.jobs import Busy, JobCancelled
from tools.mcp.wording import MCP

MESSAGE_LIMIT = 600  # characters of an MCP error line


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
    if isinstance(exc, OSError) and exc.filename is not None:  # on a path no call site foresaw
        exc = path_failure(exc)
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


__all__ = ["MCP", "OURS", "ToolRefusal", "argument_error", "one_line", "to_tool_error"]
