"""The tool registry: every MCP tool is a module-level function declared once with `@tool(...)`.

The declaration names the tool's toolset, its parameter model (the MCP signature is derived from it), its
library result type (the output schema is derived from it, plus a one-line `summary`) and whether it is long
(then it streams progress, takes the one long-operation slot, and `start_job` offers it). The tool modules
(tools/mcp/*_tools.py) declare against this module and tools/mcp/catalog.py imports them all; the app
(tools/mcp/app.py) turns the declarations into FastMCP tools; docs/mcp.md's tool table is rendered from them.
Nothing here imports fastmcp: server.py reads the toolsets before it loads the app.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from tools.core.errors import render_all
from tools.mcp.wording import MCP

# Toolsets: what a client sees is chosen with --toolsets / GEMMA4_T4_TOOLSETS (fastmcp tags do the filtering).
TOOLSETS: dict[str, str] = {
    "repack": "probe and repack a QAT checkpoint",
    "serve": "start, stop, inspect and query the vLLM server",
    "measure": "token identity between builds, serving sweeps and their comparison",
    "jobs": "run long tools in the background and follow them",
    "gpu": "GPU memory and the Turing (T4) attention clamp",
    # Outside the default set: with it the default tools/list would sit at the 24,000-character budget.
    "fidelity": "logprob fidelity between builds: KLD, top-1 agreement, perplexity ratio",
    "eval": "accuracy with lm-evaluation-harness against the server, and runs side by side",
    "deploy": "check this machine for a deployment and fetch a checkpoint from the hub",
    "decode": "single-stream decode benchmark: time per token and the drafter's acceptance (speculative decoding)",
    "fleet": "vllm-router in front of named instances: start, status, stop",
}
# The article's workflow end to end: probe -> repack -> serve -> compare tokens -> sweep -> compare, with jobs for
# clients that time out long calls. `gpu` (VRAM, the one-time T4 clamp) is added where a T4 is set up.
DEFAULT_TOOLSETS: tuple[str, ...] = ("repack", "serve", "measure", "jobs")
TOOLSETS_ENV = "GEMMA4_T4_TOOLSETS"


@dataclass
class Reply:
    """What a tool function returns: the library result, the one-line summary, and any added fields."""

    result: Any
    summary: str
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolSpec:
    name: str
    fn: Callable[..., Any]
    toolset: str
    title: str
    description: str
    params: type | None                 # an OpParams subclass, or None for a tool without arguments
    result: Any                         # the library result type the output schema is derived from; None: untyped
    long: bool = False
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False
    open_world: bool = False
    extra: dict[str, tuple[Any, str]] = field(default_factory=dict)  # added fields: name -> (type, description)
    is_async: bool = False
    check: Callable[[Any, Any], Any] | None = None  # a long tool's quick input checks: `check(app, params)`

    def output_schema(self) -> dict[str, Any]:
        return lean_schema(self.result, self.extra)

    def dump(self, reply: Reply) -> dict[str, Any]:
        """The structured content: the library result as JSON, the added fields, the summary."""
        res = reply.result
        if isinstance(res, dict):
            data = dict(res)
        else:
            data = TypeAdapter(type(res)).dump_python(res, mode="json")
        data.update(reply.extra)
        data["summary"] = reply.summary
        return render_all(data, MCP)  # remedies in a result (a check's fix) name tools, not commands


TOOLS: dict[str, ToolSpec] = {}


def tool(*, toolset: str, title: str, params: type | None = None, result: Any = None, long: bool = False,
         read_only: bool = False, destructive: bool = False, idempotent: bool = False, open_world: bool = False,
         extra: dict[str, tuple[Any, str]] | None = None,
         check: Callable[[Any, Any], Any] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a tool. The function's docstring is its description (one or two sentences: when to use it).

    Quick tools: `fn(app, params) -> Reply` (run in a worker thread) or `async fn(app, params) -> Reply`.
    Long tools: `fn(app, params, progress) -> Reply`, `progress(done, total, message)`. A long tool's `check`
    does its input checks that need no long work (paths in the roots, names, the endpoint) and returns what the
    tool uses of them; the tool calls it first, and start_job before it hands out a job id.
    """
    if toolset not in TOOLSETS:
        raise ValueError(f"unknown toolset {toolset!r}")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__
        if name in TOOLS and TOOLS[name].fn is not fn:
            raise ValueError(f"tool {name} declared twice")
        TOOLS[name] = ToolSpec(name=name, fn=fn, toolset=toolset, title=title,
                               description=inspect.cleandoc(fn.__doc__ or ""), params=params, result=result,
                               long=long, read_only=read_only, destructive=destructive, idempotent=idempotent,
                               open_world=open_world, extra=dict(extra or {}),
                               is_async=inspect.iscoroutinefunction(fn), check=check)
        return fn

    return register


def parse_toolsets(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """`repack,serve` -> ("repack", "serve"); "all" -> every toolset; None/"" -> the default set."""
    if value is None or value == "":
        return DEFAULT_TOOLSETS
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    if "all" in names:
        return tuple(TOOLSETS)
    unknown = [n for n in names if n not in TOOLSETS]
    if unknown:
        raise ValueError(f"unknown toolset {', '.join(unknown)[:200]}; choose from {', '.join(TOOLSETS)} or all")
    return tuple(dict.fromkeys(names))


# ------------------------------------------------------------------------------------------ lean output schemas

_KEEP = ("type", "description", "enum", "items")


def _lean_prop(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One property, one level deep: scalars keep their type, objects and arrays of objects stay open."""
    if "$ref" in prop:
        target = defs.get(prop["$ref"].rsplit("/", 1)[-1], {})
        out = _lean_prop({k: v for k, v in target.items() if k != "description"}, defs)
        if prop.get("description"):
            out["description"] = prop["description"]
        return out
    if "anyOf" in prop:
        branches = [_lean_prop(b, defs) for b in prop["anyOf"]]
        types: list[str] = []
        for b in branches:
            t = b.get("type", "object")
            for one in (t if isinstance(t, list) else [t]):
                if one not in types:
                    types.append(one)
        out: dict[str, Any] = {"type": types[0] if len(types) == 1 else types}
        items = [b["items"] for b in branches if "items" in b]
        if items:
            out["items"] = items[0]
        if prop.get("description"):
            out["description"] = prop["description"]
        return out
    t = prop.get("type")
    if t is None or t == "object" or "properties" in prop or "additionalProperties" in prop:
        out = {"type": "object"}
    elif t == "array":
        item = prop.get("items") or {}
        item_type = item.get("type") if isinstance(item.get("type"), str) else None
        scalar = item_type in ("string", "integer", "number", "boolean") and "$ref" not in item
        out = {"type": "array", "items": {"type": item_type} if scalar else {}}
    else:
        out = {"type": t}
        if "enum" in prop:
            out["enum"] = prop["enum"]
    if prop.get("description"):
        out["description"] = prop["description"]
    return out


def _leaner(prop: dict[str, Any]) -> dict[str, Any]:
    """Keep a property's type only where it is one plain JSON type; its description always."""
    t = prop.get("type")
    out: dict[str, Any] = {"type": t} if isinstance(t, str) and t not in ("object", "array") else {}
    if prop.get("description"):
        out["description"] = prop["description"]
    return out


def lean_schema(result: Any, extra: dict[str, tuple[Any, str]] | None = None) -> dict[str, Any]:
    """The output schema: the library result's top-level field names, plain types and descriptions (nested
    objects, lists and nullable fields left open) plus `summary`.

    Derived from the library type, never copied; this lean because every connected agent pays for every schema
    in every conversation (the full shape is in the structured content itself).
    """
    props: dict[str, Any] = {}
    if result is not None:
        full = TypeAdapter(result).json_schema()
        defs = full.get("$defs", {})
        branches = full.get("anyOf") or [full]
        for b in branches:
            if "$ref" in b:
                b = defs.get(b["$ref"].rsplit("/", 1)[-1], {})
            for name, prop in (b.get("properties") or {}).items():
                props.setdefault(name, _leaner(_lean_prop(prop, defs)))
    for name, (tp, description) in (extra or {}).items():
        props[name] = {**_leaner(_lean_prop(TypeAdapter(tp).json_schema(), {})), "description": description}
    props["summary"] = {"type": "string"}  # one line for people (the instructions say so once)
    return {"type": "object", "properties": props, "required": ["summary"]}
