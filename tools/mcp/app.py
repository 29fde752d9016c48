"""The MCP app: builds a FastMCP server from the tool registry, over one set of settings and one job registry.

Every tool calls the same library function the `./vllm-t4` command line calls and returns its result as
structured content (output schema derived from the library type) plus a one-line summary; the library's errors
become MCP tool errors with the library's own message, rendered for MCP (tools/mcp/errors.py: arguments and tool
names, not flags).

Nothing this module loads imports vllm, torch or numpy (the repack tools load the numpy-backed repack modules when
called), so `tools/list` is answered about as fast as FastMCP itself starts.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from fastmcp import Context, FastMCP
from fastmcp.exceptions import DisabledError, NotFoundError
from fastmcp.exceptions import ValidationError as ArgumentsRefused
from fastmcp.server.middleware import Middleware
from fastmcp.tools import FunctionTool
from fastmcp.tools.base import ToolResult
from mcp_types import TextContent, ToolAnnotations
from pydantic import ValidationError

from tools.core.atomic import cleanup_own_partials
from tools.core.errors import ToolFailure, op, param
from tools.core.paths import Roots
from tools.core.progress import Progress
from tools.mcp import index_resources, resources  # noqa: F401  (index_resources declares its resources)
from tools.mcp.bounded import fit
from tools.mcp.catalog import load_all
from tools.mcp.errors import ToolRefusal, argument_error, to_tool_error
from tools.mcp.jobs import JobCancelled, JobRegistry
from tools.mcp.registry import ALWAYS_LISTED, TOOLS, TOOLSETS, TOOLSETS_ENV, ToolSpec, parse_toolsets
from tools.serving.config import load_config
from tools.serving import Hardware, behind_door_state, door_on_port, load_router, load_state, server_status
from tools.mcp.wording import on_platform

SERVER_NAME = "gemma4-t4"

def instructions(chosen: Iterable[str]) -> str:
    """What a client is told at initialization: where to start (the prompts), the walk, and how to reach the tools
    of a toolset not listed (enable_toolset, within the session)."""
    others = [n for n in TOOLSETS if n not in chosen and n != ALWAYS_LISTED]
    reach = (f" Other toolsets: {', '.join(others)}; enable_toolset(toolset=...) adds one's tools to this session "
             "(e.g. capacity for find_capacity)." if others else "")
    return f"""\
Deploy and benchmark all-4-bit builds of the Gemma 4 family with vLLM (one Tesla T4, or vLLM's CPU backend); plan_fit
(toolset hub) plans a member's fit on a T4. Start from a prompt: deploy_cpu (no NVIDIA GPU: the tiny stand-in, or the
member named, both builds served on CPU), deploy_t4 (a T4; member E2B unless named), then compare_builds (memory,
token identity, sweeps side by side); each lists its calls in order.
Listed toolsets: {', '.join(n for n in chosen if n != ALWAYS_LISTED)}.{reach}
One long operation runs at a time; paths must lie under the roots (server_status.roots). Every result has `summary`,
one line for people; chain the other fields. Results are kept short: where one points to a file or a resource, the
whole is there."""


@dataclass
class Settings:
    roots: Roots = field(default_factory=Roots.from_env)
    env_file: Path | None = None                                   # serving config (tpu.env); None: the default
    config_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. state_dir for an isolated server


class App:
    """What the tool functions share: settings, the job registry, the serving config."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.roots = settings.roots
        self.jobs = JobRegistry()
        self.specs: dict[str, ToolSpec] = {}
        self._platform: str | None = None

    def platform(self) -> str:
        """cuda or cpu, read once (NVML): what the remedies name (the stand-in source on CPU, the hub's on a GPU)."""
        if self._platform is None:
            self._platform = Hardware().platform()
        return self._platform

    def served_on(self, instance: str | None = None) -> str:
        """Where a served build's figures are measured, for a summary line: the server's recorded platform (the
        build's behind a front door), else this machine's, with the CPU or GPU named (wording.on_platform)."""
        cfg = self.config(instance=instance)
        st = load_state(cfg) or (behind_door_state(cfg) if instance is None else None)
        return on_platform(getattr(st, "platform", None) or self.platform())

    def config(self, **overrides: Any) -> Any:
        merged = {**self.settings.config_overrides, **{k: v for k, v in overrides.items() if v is not None}}
        return load_config(str(self.settings.env_file) if self.settings.env_file else None, **merged)

    def managed_base_url(self, instance: str | None = None) -> str:
        """The base URL of the server this project started (state file), for tools that measure it."""
        cfg = self.config(instance=instance)
        st = server_status(cfg)
        door = door_on_port(self.config()) if instance is None else None
        if (not st.alive or not st.base_url) and door is not None:  # the port is the front door's
            return door.base_url
        if not st.alive or not st.base_url:
            # a damaged record is not "nothing runs": its own line (DamagedState) says so, as the command line's
            load_state(cfg)
            if instance is None:
                load_router(self.config())
            which = f"instance {instance!r} is not running" if instance else "no vLLM server is running"
            raise ToolFailure(f"{which}; start one with {op('start')} (or pass {param('base_url')})")
        return st.base_url

    def run_job_work(self, spec: ToolSpec, params: Any, progress: Progress, checked: Any = None) -> dict[str, Any]:
        try:
            return spec.dump(spec.run(self, params, progress, checked))
        except JobCancelled:
            raise
        except Exception as exc:  # job_status shows the error as a direct call would
            raise to_tool_error(exc) from exc

    def shutdown(self, join_s: float = 20.0) -> None:
        """Cancel running jobs and foreground calls and give their clean-up up to `join_s` (SIGTERM)."""
        threads = self.jobs.cancel_all()
        deadline = time.monotonic() + join_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        remove_partial_builds()


def remove_partial_builds() -> None:
    """Removes the partial build folders this process's repacks left (the repack library tracks the ones it
    owns), after asking any build still running in a worker thread to stop."""
    cleanup_own_partials()


# ------------------------------------------------------------------------------------------------ plumbing


def error_result(exc: BaseException) -> ToolResult:
    """A failed call's result (isError): the one line as text, and as structured content {error, detail} as the
    command line's --json prints it, both within RESULT_BUDGET (a long detail shortened, `clipped` saying so). Clients check only successful results against the output schema."""
    err = exc if isinstance(exc, ToolRefusal) else to_tool_error(exc)
    data = fit({"error": str(err), "detail": err.detail})  # within RESULT_BUDGET, as every answer is
    return ToolResult(content=[TextContent(type="text", text=data["error"])], structured_content=data, is_error=True)


def _result(data: dict[str, Any]) -> ToolResult:
    """Structured content plus text for clients that show only text: the summary, then the same JSON; within
    RESULT_BUDGET characters (bounded.fit: the whole stays in the files the result names, or in the next pages)."""
    data = fit(data)
    return ToolResult(content=[TextContent(type="text", text=str(data.get("summary", ""))),
                               TextContent(type="text", text=json.dumps(data, separators=(",", ":")))],
                      structured_content=data)


class ArgumentErrors(Middleware):
    """FastMCP checks a call's arguments against the tool's input schema before the tool runs and answers a
    refusal with pydantic's multi-line text; this answers it as every other tool error: one line naming the
    argument, with its detail. A prompt's arguments are checked here too (FastMCP drops unknown ones)."""

    async def on_get_prompt(self, context: Any, call_next: Any) -> Any:
        spec = resources.PROMPTS.get(context.message.name)
        if spec is not None:
            try:
                spec.check(context.message.arguments)
            except ValueError as exc:
                raise ArgumentsRefused(str(exc), log_level=logging.DEBUG) from None
        return await call_next(context)

    async def on_call_tool(self, context: Any, call_next: Any) -> Any:
        try:
            return await call_next(context)
        except (NotFoundError, DisabledError):
            spec = TOOLS.get(context.message.name)
            if spec is None:
                raise
            return error_result(ToolRefusal(
                f"{spec.name} is in toolset {spec.toolset}, not listed by this server: call enable_toolset "
                f"(toolset={spec.toolset}) to add its tools to this session, then call {spec.name} again",
                {"tool": spec.name, "toolset": spec.toolset, "enable": {"tool": "enable_toolset",
                                                                         "arguments": {"toolset": spec.toolset}}}))
        except ArgumentsRefused as exc:
            if not isinstance(exc.__cause__, ValidationError):
                raise
            return error_result(argument_error(exc.__cause__, context.message.name))


async def in_thread(fn: Callable[[], Any]) -> Any:
    return await anyio.to_thread.run_sync(fn)


async def run_long(app: App, spec: ToolSpec, params: Any, ctx: Context | None) -> dict[str, Any]:
    """A long tool in the foreground: exclusive, in a worker thread, progress sent as MCP notifications."""
    last = [0.0]
    lock = threading.Lock()
    # A library may report from threads of its own (the hub client's download pool): those reach the loop by
    # its token, and only the worker thread can see the client's cancellation.
    token = anyio.lowlevel.current_token()

    def call() -> dict[str, Any]:
        worker = threading.get_ident()
        with app.jobs.exclusive(spec.name) as cancelled:
            def progress(done: float, total: float | None, message: str) -> None:
                if cancelled.is_set():
                    raise JobCancelled(f"{spec.name} cancelled: the server is shutting down")
                if threading.get_ident() == worker:
                    anyio.from_thread.check_cancelled()  # the client cancelled the request: stop at this report
                now = time.monotonic()
                final = total is not None and done >= total
                with lock:
                    if ctx is None or (now - last[0] < 0.2 and not final):
                        return
                    last[0] = now
                try:
                    anyio.from_thread.run(ctx.report_progress, float(done),
                                          None if total is None else float(total), message, token=token)
                except Exception:  # a client that went away must not fail the work
                    pass

            return spec.dump(spec.run(app, params, progress))

    return await in_thread(call)


def _handler(spec: ToolSpec, app: App) -> Callable[..., Any]:
    # A parameter model may depend on the app (start_job offers the long tools this server lists).
    model = spec.params.for_app(app) if hasattr(spec.params, "for_app") else spec.params

    async def handler(**kwargs: Any) -> ToolResult:
        ctx = kwargs.pop("ctx", None)
        try:
            params = model.from_mcp_args(kwargs) if model is not None else None
            if spec.long:
                data = await run_long(app, spec, params, ctx)
            elif spec.context:
                data = spec.dump(await spec.fn(app, params, ctx))
            elif spec.is_async:
                data = spec.dump(await spec.fn(app, params))
            else:
                data = await in_thread(lambda: spec.dump(spec.fn(app, params)))
        except Exception as exc:
            return error_result(exc)
        return _result(data)  # detail=true pages what it lists (probe_checkpoint): every answer within budget

    sig = model.mcp_signature() if model is not None else []
    if spec.long or spec.context:
        sig.append(inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, default=None,
                                     annotation=Context | None))
    handler.__signature__ = inspect.Signature(sig, return_annotation=ToolResult)  # type: ignore[attr-defined]
    handler.__annotations__ = {p.name: p.annotation for p in sig} | {"return": ToolResult}
    handler.__name__ = spec.name
    handler.__doc__ = None
    return handler


class ListedTool(FunctionTool):
    """A tool listed without FastMCP's `_meta` (its tags): the toolsets are chosen when the server starts, and
    every listed byte is paid for by every connected agent."""

    def get_meta(self) -> dict[str, Any] | None:  # type: ignore[override]
        return None


# The spec's defaults for the hints a tool leaves out.
_HINT_DEFAULTS = {"readOnlyHint": False, "destructiveHint": True, "idempotentHint": False, "openWorldHint": True}


def hints(spec: ToolSpec) -> ToolAnnotations:
    """The tool's hints where they differ from the spec's defaults; destructive and idempotent say nothing of a
    read-only tool (the spec reads them only when readOnlyHint is false)."""
    given = {"readOnlyHint": spec.read_only, "openWorldHint": spec.open_world}
    if not spec.read_only:
        given |= {"destructiveHint": spec.destructive, "idempotentHint": spec.idempotent}
    return ToolAnnotations(**{k: v for k, v in given.items() if v != _HINT_DEFAULTS[k]})


def compact_input_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """The input schema as listed: an optional argument's `anyOf [T, null]` with default null is written as T
    (leaving it out means null), and no `additionalProperties` (an unknown argument is refused all the same):
    the call is still checked against the parameter model."""
    props = {}
    for name, prop in (schema.get("properties") or {}).items():
        prop = dict(prop)
        branches = prop.get("anyOf")
        if "default" in prop and prop["default"] is None:
            del prop["default"]
            if branches and {"type": "null"} in branches and len(branches) == 2:
                del prop["anyOf"]
                prop = {**next(b for b in branches if b != {"type": "null"}), **prop}
        props[name] = prop
    return {**{k: v for k, v in schema.items() if k != "additionalProperties"}, "properties": props}


def create_server(settings: Settings | None = None, *, auth: Any = None,
                  toolsets: str | Iterable[str] | None = None) -> FastMCP:
    """The MCP server over `settings`; `auth` is a fastmcp auth provider (HTTP only); `toolsets` picks what is
    listed (default: $GEMMA4_T4_TOOLSETS, else the default set)."""
    settings = settings or Settings()
    chosen = parse_toolsets(toolsets if toolsets is not None else os.environ.get(TOOLSETS_ENV))
    app = App(settings)
    specs = load_all()
    app.specs = {name: s for name, s in specs.items() if s.toolset in chosen}
    # Strict: the input schema is the contract, so "yes" is no boolean and "5" no integer (5 is a number).
    mcp = FastMCP(SERVER_NAME, instructions=instructions(chosen), mask_error_details=False, auth=auth,
                  strict_input_validation=True, middleware=[ArgumentErrors()])
    mcp.gemma = app  # type: ignore[attr-defined]  # tests and the demo reach the registry through it
    for spec in specs.values():
        tool = ListedTool.from_function(_handler(spec, app), name=spec.name, title=spec.title,
                                        description=spec.description, tags={spec.toolset},
                                        output_schema=spec.output_schema(), annotations=hints(spec))
        tool.parameters = compact_input_schema(tool.parameters)
        mcp.add_tool(tool)
    # Every tool carries its one toolset's tag: hiding the other toolsets' tags leaves the chosen tools, and the
    # untagged resources and prompts, which cost a client nothing until it asks for them.
    hidden = set(TOOLSETS) - set(chosen) - {ALWAYS_LISTED}
    if hidden:
        mcp.disable(tags=hidden)
    resources.register(mcp, app)
    return mcp


def install_sigterm(app: App) -> None:
    """SIGTERM cancels running jobs and foreground calls (their library clean-up runs), then exits 143."""
    def on_term(signum: int, frame: object) -> None:
        threading.Thread(target=_shutdown_then_exit, args=(app,), daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)


def _shutdown_then_exit(app: App) -> None:
    try:
        app.shutdown()
    finally:
        os._exit(143)
