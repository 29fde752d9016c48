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
from tools.mcp.wording import MCP, OPERATION_TOOLS

# Toolsets: what a client sees is chosen with --toolsets / GEMMA4_T4_TOOLSETS (fastmcp tags do the filtering).
TOOLSETS: dict[str, str] = {
    "repack": "make a stand-in source, probe and repack a QAT checkpoint",
    "serve": "start, stop, inspect and query the vLLM server",
    "measure": "token identity between builds, serving sweeps and their comparison",
    "deploy": "check this machine before a step, and the memory each running build takes",
    # Outside the default set: what the walk from a source to a measured build does not need.
    "jobs": "run long tools in the background and follow them (for clients that time out long calls)",
    "log": "the vLLM server log's tail as a tool (the resource gemma4-t4://server/log holds it too)",
    "gpu": "the Turing (T4) attention clamp",
    "hub": "plan which Gemma 4 member fits one T4, and fetch its checkpoint from the Hugging Face hub",
    "fidelity": "logprob fidelity between builds: KLD, top-1 agreement, perplexity ratio",
    "eval": "accuracy with lm-evaluation-harness against the server, and runs side by side",
    "decode": "single-stream decode benchmark: time per token and the drafter's acceptance (speculative decoding)",
    "fleet": "vllm-router in front of named instances: start, status, stop, switch the build behind it",
    "capacity": "the most users served within a latency SLO (bracket, goodput, cost); compare_sweeps compares them",
    # Listed whatever --toolsets says: the way to the others during a session.
    "toolsets": "enable another toolset's tools during a session",
}
ALWAYS_LISTED = "toolsets"
# The design's walk end to end, on a T4 or on CPU: preflight -> source (stand-in on CPU) -> probe -> repack ->
# start -> compare tokens -> memory -> sweep -> compare. A T4 adds `gpu` and `hub` (`--toolsets default,gpu,hub`).
DEFAULT_TOOLSETS: tuple[str, ...] = ("repack", "serve", "measure", "deploy")
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
    ops: dict[str, dict[str, Any]] = field(default_factory=dict)  # operations it does -> the arguments that pick them
    context: bool = False               # an async quick tool given the MCP session: `fn(app, params, ctx)`

    def output_schema(self) -> dict[str, Any]:
        return lean_schema(self.result, self.extra)

    def run(self, app: Any, params: Any, progress: Callable[..., None], checked: Any = None) -> Reply:
        """A long tool's work, its check run once: here, or by start_job (which passes `checked`)."""
        if self.check is None:
            return self.fn(app, params, progress)
        return self.fn(app, params, progress, self.check(app, params) if checked is None else checked)

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
         extra: dict[str, tuple[Any, str]] | None = None, check: Callable[[Any, Any], Any] | None = None,
         ops: str | Iterable[str] | dict[str, dict[str, Any]] = (), context: bool = False
         ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a tool. The function's docstring is its description (one or two sentences: when to use it).

    Quick tools: `fn(app, params) -> Reply` (run in a worker thread) or `async fn(app, params) -> Reply`.
    Long tools: `fn(app, params, progress) -> Reply`, `progress(done, total, message)`. A long tool's `check`
    does its input checks that need no long work (paths in the roots, names, the endpoint) and returns what the
    tool uses of them, once per call: the caller runs it (start_job before it hands out a job id) and gives its
    result to the tool, `fn(app, params, progress, checked)` (ToolSpec.run).

    `ops`: the operations (tools.core.errors.op) the tool does, with the arguments that pick each where one tool
    does several (`{"fidelity.record": {"mode": "record"}}`): a failure that names one names this tool to MCP.
    """
    if toolset not in TOOLSETS:
        raise ValueError(f"unknown toolset {toolset!r}")
    if context and long:
        raise ValueError("a tool given the session is a quick async tool")

    does = {ops: {}} if isinstance(ops, str) else dict(ops) if isinstance(ops, dict) else dict.fromkeys(ops, {})

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        name = fn.__name__
        if name in TOOLS and TOOLS[name].fn is not fn:
            raise ValueError(f"tool {name} declared twice")
        for op_name, args in does.items():
            if OPERATION_TOOLS.get(op_name, (name,))[0] != name:
                raise ValueError(f"operation {op_name} declared by {OPERATION_TOOLS[op_name][0]} and {name}")
            OPERATION_TOOLS[op_name] = (name, dict(args))
        TOOLS[name] = ToolSpec(name=name, fn=fn, toolset=toolset, title=title,
                               description=" ".join((fn.__doc__ or "").split()), params=params, result=result,
                               long=long, read_only=read_only, destructive=destructive, idempotent=idempotent,
                               open_world=open_world, extra=dict(extra or {}),
                               is_async=inspect.iscoroutinefunction(fn), check=check, ops=does,
                               context=context)
        return fn

    return register


def parse_toolsets(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """`repack,serve` -> ("repack", "serve"); "all" -> every toolset; None/"" -> the default set, which
    "default" names among others (`default,gpu,hub`)."""
    if value is None or value == "":
        return DEFAULT_TOOLSETS
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    if "all" in names:
        return tuple(TOOLSETS)
    names = [n for v in names for n in (DEFAULT_TOOLSETS if v == "default" else (v,))]
    unknown = [n for n in names if n not in TOOLSETS]
    if unknown:
        raise ValueError(f"unknown toolset {', '.join(unknown)[:200]}; choose from {', '.join(TOOLSETS)}, "
                         "default or all")
    return tuple(dict.fromkeys(names))


# ------------------------------------------------------------------------------------------ lean output schemas

def lean_schema(result: Any, extra: dict[str, tuple[Any, str]] | None = None) -> dict[str, Any]:
    """The output schema: the library result's top-level fields, each with its JSON type and description;
    `summary`, in every result, is said once in the server's instructions.

    Derived from the library type, never copied; this lean because every connected agent pays for every schema
    in every conversation: a field's type is said to its first level (`array`, `object`, a union as `anyOf`), its
    items' and members' shapes are in the structured content itself. A field typed as any value (free-form) is
    declared nowhere in `properties` and named in the schema's description as free-form.
    """
    props: dict[str, Any] = {}
    free: list[str] = []

    def add(name: str, prop: dict[str, Any], defs: dict[str, Any], description: str | None) -> None:
        typed = field_type(prop, defs)
        if typed is None:
            free.append(name)
            return
        if name in props:  # a union of results that types one field two ways: either
            before = {k: v for k, v in props[name].items() if k != "description"}
            if before != typed:  # each branch once
                branches = [*before.get("anyOf", [before])]
                branches += [t for t in typed.get("anyOf", [typed]) if t not in branches]
                typed = branches[0] if len(branches) == 1 else {"anyOf": branches}
            description = props[name].get("description")
        props[name] = {**typed, **({"description": description} if description else {})}

    if result is not None:
        full = TypeAdapter(result).json_schema()
        defs = full.get("$defs", {})
        for b in full.get("anyOf") or [full]:
            if "$ref" in b:
                b = defs.get(b["$ref"].rsplit("/", 1)[-1], {})
            for name, prop in (b.get("properties") or {}).items():
                add(name, prop, defs, prop.get("description"))
    for name, (tp, description) in (extra or {}).items():
        schema = TypeAdapter(tp).json_schema()
        props.pop(name, None)
        add(name, schema, schema.get("$defs", {}), description)
    out: dict[str, Any] = {"type": "object", "properties": props}
    if free:
        out["description"] = f"Free-form (any JSON value, not declared): {', '.join(free)}"
    return out


def field_type(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any] | None:
    """A field's JSON type, one level deep: `{"type": ...}` (with `enum` where the values are a short list), or
    `{"anyOf": [...]}` of those; None where the type allows any value."""
    if "$ref" in prop:
        return field_type(defs.get(prop["$ref"].rsplit("/", 1)[-1], {}), defs)
    if "anyOf" in prop or "oneOf" in prop:
        branches: list[dict[str, Any]] = []
        for b in prop.get("anyOf") or prop["oneOf"]:
            t = field_type(b, defs)
            if t is None:
                return None
            for one in t.get("anyOf", [t]):
                if one not in branches:
                    branches.append(one)
        return branches[0] if len(branches) == 1 else {"anyOf": branches}
    if "enum" in prop and len(prop["enum"]) <= 8:
        return {k: prop[k] for k in ("type", "enum") if k in prop}
    if "const" in prop:
        return {"const": prop["const"]}
    t = prop.get("type")
    if isinstance(t, list):
        return {"anyOf": [{"type": one} for one in t]}
    return {"type": t} if isinstance(t, str) else None
