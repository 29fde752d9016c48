"""The one failure type of the project, and how a front end renders it.

A failure is one line that says what went wrong and what to do, plus an optional `detail` for programs. Where the
remedy is a parameter or another operation, the library names it by meaning, not by how one front end spells it:
`param("out")` (a parameter model's field; with a value for a switch: `param("force", True)`) and
`op("stop")` (an operation; with arguments: `op("fetch", repo_id=...)`). The command line renders them as
`--out`, `--force` and `./vllm-t4 stop`; MCP as `out`, `force=true` and `stop_vllm_server`; `str()` as the plain
names. The marks are two control characters that no clipped input can hold (core.text escapes them).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

_OPEN, _CLOSE = "\x1e", "\x1f"
_UNSET = object()


def param(name: str, value: Any = _UNSET) -> str:
    """A parameter (its model field name) in a message, optionally with the value that fixes it."""
    return f"{_OPEN}p{json.dumps([name] if value is _UNSET else [name, value])}{_CLOSE}"


def op(name: str, **args: Any) -> str:
    """Another operation (`start`, `stop`, `probe`, `fetch`, ...) in a message, optionally with its arguments."""
    return f"{_OPEN}o{json.dumps([name, args])}{_CLOSE}"


@dataclass(frozen=True)
class Renderer:
    """How a front end spells a parameter and an operation."""

    param: Callable[..., str]            # (name) or (name, value) -> text
    op: Callable[[str, dict[str, Any]], str]


def _plain_param(name: str, *value: Any) -> str:
    return f"{name}={json.dumps(value[0])}" if value else name


def _plain_op(name: str, args: dict[str, Any]) -> str:
    return name + (" (" + ", ".join(f"{k}={v}" for k, v in args.items()) + ")" if args else "")


PLAIN = Renderer(_plain_param, _plain_op)


def render(message: str, renderer: Renderer = PLAIN) -> str:
    """`message` with every marked parameter and operation spelled by `renderer`."""
    if _OPEN not in message:
        return message
    out: list[str] = []
    rest = message
    while _OPEN in rest:
        head, _, tail = rest.partition(_OPEN)
        body, closed, rest = tail.partition(_CLOSE)
        out.append(head)
        if not closed or not body[:1] in ("p", "o"):
            out.append(body)
            continue
        try:
            parsed = json.loads(body[1:])
        except ValueError:
            out.append(body)
            continue
        out.append(renderer.param(*parsed) if body[0] == "p" else renderer.op(parsed[0], parsed[1]))
    out.append(rest)
    return "".join(out)


def render_all(data: Any, renderer: Renderer = PLAIN) -> Any:
    """`data` (a result as JSON: dicts, lists, strings) with the marks of every string rendered: a library result
    may carry marked text (a check's remedy, a summary) for the front end to spell."""
    if isinstance(data, str):
        return render(data, renderer)
    if isinstance(data, dict):
        return {k: render_all(v, renderer) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [render_all(v, renderer) for v in data]
    return data


class ToolFailure(Exception):
    """A failure the caller can act on.

    `message` is one line naming the file, process or parameter involved and what to do, with parameters and
    operations marked (param/op); `str(exc)` renders it plainly and front ends render it their way (`render`).
    `detail` carries whatever helps a program or a person dig further (a log tail, the process holding a port, a
    state file); `field` names the parameter at fault, where one is."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None, *, field: str | None = None) -> None:
        # One line: the CLI prints it as the whole reason, MCP clients show it as the error text.
        # (str.split would take the marks, \x1e and \x1f, for whitespace too)
        self.message = re.sub(r"[^\S\x1e\x1f]+", " ", str(message)).strip(" ")
        self.detail = detail
        self.field = field
        super().__init__(render(self.message))

    def render(self, renderer: Renderer = PLAIN) -> str:
        return render(self.message, renderer)

    def to_dict(self, renderer: Renderer = PLAIN) -> dict[str, Any]:
        detail = render_all(self.detail, renderer)  # a check's remedy in the detail is spelled as the message is
        if self.field is not None:
            detail = {"argument": self.field, **(detail or {})}
        return {"error": self.render(renderer), "detail": detail}


class BadInput(ToolFailure):
    """Input that cannot be used (an argument, a file the caller named, a server that is not the one asked for):
    the command line exits 2 and MCP reports it as the caller's to fix."""


__all__ = ["PLAIN", "BadInput", "Renderer", "ToolFailure", "op", "param", "render", "render_all"]
