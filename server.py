#!/usr/bin/env python3
"""gemma4-t4 MCP server: deploy and benchmark Gemma 4 E2B 4-bit builds with vLLM, one typed tool per step.

A thin layer over `repack/` and `tools/`: every tool calls the same library function the `./vllm-t4` command
line calls, returns a pydantic model (structured content with an output schema, plus a one-line summary), and
turns the library's errors into MCP tool errors with the library's own actionable message.

Run:  python server.py                      (stdio, what MCP clients launch)
      python server.py --http [--port 8765]  (streamable HTTP on 127.0.0.1, bearer token required)

This process never imports vllm or torch (vLLM runs as its own process): library modules are imported inside
the tools that need them, so `tools/list` is answered as fast as FastMCP itself starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import json
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

# `python /path/to/server.py` from any directory: the project's packages sit next to this file.
PROJECT_ROOT = Path(__file__).resolve().parent
if str(PROJECT_ROOT) not in sys.path:
    sys.path.insert(0, str(PROJECT_ROOT))

import anyio  # noqa: E402
import anyio.from_thread  # noqa: E402
import anyio.to_thread  # noqa: E402
from fastmcp import Context, FastMCP  # noqa: E402
from fastmcp.exceptions import ToolError  # noqa: E402
from fastmcp.tools.base import ToolResult  # noqa: E402
from mcp_types import TextContent, ToolAnnotations  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, ValidationError  # noqa: E402

from tools.jobs import Busy, JobInfo, JobRegistry, ProgressFn  # noqa: E402
from tools.paths import PathNotAllowed, Roots  # noqa: E402
from tools.vram import VramStatus  # noqa: E402

SERVER_NAME = "gemma4-t4"
TOKEN_ENV = "GEMMA4_T4_MCP_TOKEN"
R = TypeVar("R", bound=BaseModel)

INSTRUCTIONS = """\
Deploy and benchmark Gemma 4 E2B 4-bit builds with vLLM (one Tesla T4, or vLLM's CPU backend).
Typical order: probe_checkpoint -> repack_checkpoint -> patch_turing (T4 only) -> start_vllm_server ->
server_status / vram_status -> query_model -> compare_tokens (record with build A, check with build B) ->
run_sweep -> compare_sweeps -> stop_vllm_server.
Long tools (repack_checkpoint, start_vllm_server, run_sweep, compare_tokens) stream progress; if your client
times out tool calls, run them with start_job and follow with job_status. One long operation runs at a time.
Paths must lie under the configured roots (see server_status.roots)."""


# ---------------------------------------------------------------------------------------------------- settings


@dataclass
class Settings:
    roots: Roots = field(default_factory=Roots.from_env)
    env_file: Path | None = None                               # serving config (tpu.env); None: the library default
    config_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. state_dir for an isolated server


# ------------------------------------------------------------------------------------------------ result models


class _Result(BaseModel):
    model_config = ConfigDict(extra="forbid")
    summary: str = Field(description="One line for people; agents should chain the other fields")


class ProbeResult(_Result):
    path: str
    details: dict[str, Any] = Field(description="The probe report: architecture, tensors by kind, grid checks")


class RepackResult(_Result):
    source: str
    output: str = Field(description="The written checkpoint folder; pass it to start_vllm_server as model")
    details: dict[str, Any] = Field(description="The repack report: per tensor group counts, bytes, grid fidelity")


class ServerInfo(_Result):
    details: dict[str, Any]


class LogResult(_Result):
    log_path: str | None
    lines: list[str]


class QueryResult(_Result):
    text: str
    details: dict[str, Any]


class SweepResult(_Result):
    output_dir: str | None = Field(None, description="Where the sweep wrote its results; pass to compare_sweeps")
    details: dict[str, Any]


class CompareTokensResult(_Result):
    details: dict[str, Any]


class CompareSweepsResult(_Result):
    report_path: str | None = None
    details: dict[str, Any]


class PatchResult(_Result):
    details: dict[str, Any]


class VramResult(VramStatus):
    summary: str


class JobList(_Result):
    jobs: list[JobInfo]


# ------------------------------------------------------------------------------------------------- helpers


def _plain(obj: Any) -> Any:
    """A library result (pydantic, dataclass, .to_dict(), Path, nested) as JSON-ready data."""
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return _plain(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return str(obj)


def _reply(result: BaseModel) -> ToolResult:
    """Structured content plus text for clients that show only text: the summary, then the same JSON."""
    data = result.model_dump(mode="json")
    return ToolResult(content=[TextContent(type="text", text=str(data.get("summary", ""))),
                               TextContent(type="text", text=json.dumps(data, indent=1))],
                      structured_content=data)


def _fail(exc: BaseException) -> ToolError:
    """The library's one-line message, unchanged when it is one of ours; the type named otherwise."""
    msg = str(exc).strip() or type(exc).__name__
    ours = ("RepackError", "ToolFailure", "PathNotAllowed", "Busy", "KeyError", "ValueError",
            "FileNotFoundError", "FileExistsError", "JobCancelled")
    if not any(c.__name__ in ours for c in type(exc).__mro__):
        msg = f"{type(exc).__name__}: {msg}"
    if isinstance(exc, KeyError):
        msg = msg.strip("'\"")
    return ToolError(msg)


async def _in_thread(fn: Callable[[], R]) -> R:
    try:
        return await anyio.to_thread.run_sync(fn)
    except ToolError:
        raise
    except Exception as exc:
        raise _fail(exc) from exc


class GemmaT4Server:
    """The tools, bound to one Settings and one job registry (module state: sessions come and go)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.jobs = JobRegistry()
        # The work functions long tools run, foreground or as jobs: name -> (params model, work(params, progress)).
        self.long_work: dict[str, tuple[type[BaseModel], Callable[[Any, ProgressFn], BaseModel]]] = {}

    # ------------------------------------------------------------------------------------------ plumbing

    def config(self, **overrides: Any) -> Any:
        from tools.config import load_config

        merged = {**self.settings.config_overrides, **{k: v for k, v in overrides.items() if v is not None}}
        return load_config(str(self.settings.env_file) if self.settings.env_file else None, **merged)

    async def run_long(self, name: str, params: BaseModel, ctx: Context | None) -> ToolResult:
        """A long tool in the foreground: exclusive, in a worker thread, progress sent as MCP notifications."""
        _, work = self.long_work[name]
        last = [0.0]

        def progress(done: float, total: float | None, message: str) -> None:
            anyio.from_thread.check_cancelled()  # the client cancelled the request: stop at this report
            now = time.monotonic()
            final = total is not None and done >= total
            if ctx is None or (now - last[0] < 0.2 and not final):
                return
            last[0] = now
            try:
                anyio.from_thread.run(ctx.report_progress, float(done), None if total is None else float(total),
                                      message)
            except Exception:  # a client that went away must not fail the work
                pass

        def call() -> BaseModel:
            with self.jobs.exclusive(name):
                return work(params, progress)

        return _reply(await _in_thread(call))

    # ------------------------------------------------------------------------------------------ work

    def probe(self, path: str) -> ProbeResult:
        src = self.settings.roots.confine(path, "models", must_exist=True, what="checkpoint")
        from repack.probe import probe_checkpoint

        report = probe_checkpoint(src)
        details = _plain(report)
        summary = report.summary() if hasattr(report, "summary") else f"probed {src}"
        return ProbeResult(summary=summary, path=str(src), details=details)


# ------------------------------------------------------------------------------------------------ parameters


class RepackParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="QAT checkpoint folder (config.json + safetensors) under a models root")
    output: str = Field(description="New folder to write, under a models root")
    quantize_linears: bool = Field(True, description="Pack every linear layer as W4A16 (pack-quantized)")
    text_only: bool = Field(True, description="Drop the vision and audio towers; Gemma4ForCausalLM config")
    embed_int4: bool = Field(True, description="Pack the per-layer embedding table (PLE) as int4")
    embed_tokens: bool = Field(True, description="Also pack embed_tokens and write an untied int4 lm_head")
    scale_dtype: Literal["fp16", "bf16"] = Field("fp16", description="Scale dtype; fp16 for the T4")
    force: bool = Field(False, description="Overwrite an existing output folder")


class StartParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="Checkpoint folder under a models root, or a hub id; default: "
                                                "the serving config's MODEL")
    served_name: str | None = Field(None, description="Name clients use in requests; default from the config")
    port: int | None = Field(None, ge=1, le=65535, description="Port on 127.0.0.1; default from the config")
    max_model_len: int | None = Field(None, ge=16, description="Context length; default from the config")


class SweepParamsIn(BaseModel):
    model_config = ConfigDict(extra="allow")
    output_dir: str = Field(description="Folder for the results, under an evidence root")


class CompareParamsIn(BaseModel):
    model_config = ConfigDict(extra="allow")


def create_server(settings: Settings | None = None, *, auth: Any = None) -> FastMCP:
    """The MCP server over `settings`; `auth` is a fastmcp auth provider (HTTP only)."""
    settings = settings or Settings()
    core = GemmaT4Server(settings)
    mcp = FastMCP(SERVER_NAME, instructions=INSTRUCTIONS, mask_error_details=False, auth=auth)
    mcp.gemma = core  # type: ignore[attr-defined]  # tests and the demo reach the registry through it

    ro = ToolAnnotations(readOnlyHint=True, idempotentHint=True, destructiveHint=False, openWorldHint=False)

    @mcp.tool(title="GPU memory (NVML)", annotations=ro)
    async def vram_status() -> VramResult:
        """Per GPU: name, driver, total/used/free MiB, utilization; per process: GPU memory, with the processes
        of the vLLM server this project started marked (its engine core is a child process). On a machine
        without an NVIDIA driver: available=false and the reason, not an error."""
        from tools import vram

        def read() -> VramResult:
            pid = None
            try:
                from tools.vllm_server import server_status as _status

                pid = getattr(_status(core.config()), "pid", None)
            except Exception:  # no serving config or no server: VRAM is still worth reading
                pid = None
            st = vram.vram_status(server_pid=pid)
            return VramResult(**st.model_dump(), summary=st.summary_line())

        return _reply(await _in_thread(read))  # type: ignore[return-value]

    @mcp.tool(title="Probe a checkpoint", annotations=ro)
    async def probe_checkpoint(
        path: Annotated[str, Field(description="Checkpoint folder under a models root")],
    ) -> ProbeResult:
        """Read a checkpoint's config and safetensors headers: architecture, text/tower tensors, which tensors
        are linears or embeddings, whether they sit on the 4-bit grid. Writes nothing; run before
        repack_checkpoint."""
        return _reply(await _in_thread(lambda: core.probe(path)))  # type: ignore[return-value]

    @mcp.tool(title="List jobs", annotations=ro)
    async def list_jobs() -> JobList:
        """Every job started with start_job in this server process, newest last, with state and progress."""
        jobs = core.jobs.list()
        running = [j.job_id for j in jobs if j.state == "running"]
        return _reply(JobList(summary=f"{len(jobs)} job(s), running: {', '.join(running) or 'none'}",
                              jobs=jobs))  # type: ignore[return-value]

    @mcp.tool(title="Job status", annotations=ro)
    async def job_status(
        job_id: Annotated[str, Field(description="The job_id start_job returned")],
        wait_s: Annotated[float, Field(ge=0, le=600, description="Wait up to this long for the job to finish")] = 0,
    ) -> JobInfo:
        """State, progress and message of a job; once succeeded, `result` holds the structured result of the
        tool it ran (that tool's output schema); once failed, `error` holds the one-line error."""
        try:
            info = await anyio.to_thread.run_sync(lambda: core.jobs.wait(job_id, wait_s) if wait_s else
                                                  core.jobs.get(job_id))
        except KeyError as exc:
            raise _fail(exc) from exc
        return info

    @mcp.tool(title="Cancel a job", annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True,
                                                                 idempotentHint=True, openWorldHint=False))
    async def cancel_job(job_id: Annotated[str, Field(description="The job to cancel")]) -> JobInfo:
        """Ask a running job to stop at its next progress report; the library removes partial output."""
        try:
            return core.jobs.cancel(job_id)
        except KeyError as exc:
            raise _fail(exc) from exc

    @mcp.tool(title="Run a long tool as a background job",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=False,
                                          openWorldHint=False))
    async def start_job(
        tool: Annotated[Literal["repack_checkpoint", "start_vllm_server", "run_sweep", "compare_tokens"],
                        Field(description="The long tool to run")],
        arguments: Annotated[dict[str, Any], Field(description="Its arguments, as for a direct call")],
    ) -> JobInfo:
        """Start a long tool without waiting (for clients whose tool calls time out): returns a job_id at once;
        follow it with job_status (wait_s to block a while). Same arguments and result as the direct call."""
        params_model, work = core.long_work[tool]
        try:
            params = params_model.model_validate(arguments)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ToolError(f"{tool}: argument {'.'.join(map(str, first['loc'])) or '?'}: {first['msg']}") from exc
        try:
            return core.jobs.submit(tool, params.model_dump(exclude_none=True), lambda p: work(params, p))
        except Busy as exc:
            raise _fail(exc) from exc

    _register_library_tools(mcp, core)
    return mcp


def _register_library_tools(mcp: FastMCP, core: GemmaT4Server) -> None:
    """Tools over the repack, serving and measuring libraries."""
    roots = core.settings.roots
    ro = ToolAnnotations(readOnlyHint=True, idempotentHint=True, destructiveHint=False, openWorldHint=False)

    # --- repack
    def repack_work(p: RepackParams, progress: ProgressFn) -> RepackResult:
        src = roots.confine(p.source, "models", must_exist=True, what="source")
        out = roots.confine(p.output, "models", what="output")
        from repack.build import BuildOptions, build_checkpoint

        opts = BuildOptions(quantize_linears=p.quantize_linears, text_only=p.text_only, embed_int4=p.embed_int4,
                            embed_tokens=p.embed_tokens, scale_dtype=p.scale_dtype, force=p.force)
        report = build_checkpoint(src, out, opts, progress=lambda d, t, m: progress(d, t, m))
        summary = report.summary() if hasattr(report, "summary") else f"wrote {out}"
        return RepackResult(summary=summary, source=str(src), output=str(out), details=_plain(report))

    core.long_work["repack_checkpoint"] = (RepackParams, repack_work)

    @mcp.tool(title="Repack a QAT checkpoint to all-4-bit",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True,
                                          openWorldHint=False))
    async def repack_checkpoint(source: str, output: str, quantize_linears: bool = True, text_only: bool = True,
                                embed_int4: bool = True, embed_tokens: bool = True,
                                scale_dtype: Literal["fp16", "bf16"] = "fp16", force: bool = False,
                                ctx: Context | None = None) -> RepackResult:
        """Recover the 4-bit grid of a QAT checkpoint in one pass: linears as compressed-tensors W4A16, optionally
        text only, PLE and embed_tokens as int4 with an untied int4 lm_head. Aborts on any off-grid group and
        leaves nothing half written. Progress: tensors done / total. Overwrites `output` only with force=true."""
        params = RepackParams(source=source, output=output, quantize_linears=quantize_linears, text_only=text_only,
                              embed_int4=embed_int4, embed_tokens=embed_tokens, scale_dtype=scale_dtype,
                              force=force)
        return await core.run_long("repack_checkpoint", params, ctx)  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------ auth / main


def bearer_verifier(token: str) -> Any:
    """A constant-time check of one static bearer token (fastmcp's TokenVerifier interface)."""
    from fastmcp.server.auth import TokenVerifier
    from fastmcp.server.auth.auth import AccessToken

    expected = token.encode()

    class _Static(TokenVerifier):
        async def verify_token(self, presented: str) -> AccessToken | None:
            if not presented or not hmac.compare_digest(presented.encode(), expected):
                return None
            return AccessToken(token=presented, client_id="gemma4-t4-client", scopes=[], expires_at=None)

    return _Static()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="server.py", description="gemma4-t4 MCP server (stdio by default).")
    p.add_argument("--http", action="store_true", help="serve streamable HTTP instead of stdio (bearer token)")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8765, help="HTTP port (default 8765)")
    p.add_argument("--token-env", default=TOKEN_ENV,
                   help=f"environment variable holding the HTTP bearer token (default {TOKEN_ENV}); if unset a "
                        "random token is generated and printed on stderr")
    p.add_argument("--models-root", action="append", metavar="DIR",
                   help="folder tools may read/write checkpoints under (repeatable; default ./models or "
                        "$GEMMA4_T4_MODELS_ROOTS)")
    p.add_argument("--evidence-root", action="append", metavar="DIR",
                   help="folder for results and reports (repeatable; default ./evidence or $GEMMA4_T4_EVIDENCE_ROOTS)")
    p.add_argument("--env-file", type=Path, default=None, help="serving config (default: the project's tpu.env)")
    p.add_argument("--state-dir", type=Path, default=None,
                   help="where the started vLLM server's state and log live (default from the serving config)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.state_dir is not None:
        overrides["state_dir"] = str(args.state_dir)
    settings = Settings(roots=Roots.from_env(args.models_root, args.evidence_root), env_file=args.env_file,
                        config_overrides=overrides)
    if not args.http:
        create_server(settings).run("stdio", show_banner=False)
        return 0
    token = os.environ.get(args.token_env, "").strip()
    if not token:
        token = secrets.token_urlsafe(32)
        print(f"server.py: no ${args.token_env}; bearer token for this run: {token}", file=sys.stderr, flush=True)
    mcp = create_server(settings, auth=bearer_verifier(token))
    print(f"server.py: MCP over HTTP at http://{args.host}:{args.port}/mcp (Authorization: Bearer ...)",
          file=sys.stderr, flush=True)
    mcp.run("http", show_banner=False, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
