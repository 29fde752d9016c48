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
import hmac
import inspect
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

from tools.mcp.jobs import Busy, JobInfo, JobRegistry, ProgressFn  # noqa: E402
from tools.mcp.paths import Roots  # noqa: E402
from tools.gpu.vram import VramStatus  # noqa: E402

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


class ProbeTensorInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    shape: list[int]
    dtype: str
    tower: bool
    sampled_groups: int = 0
    offgrid_groups: int = 0
    worst_ulps: float | None = None
    on_grid: bool | None = Field(None, description="null: not a 4-bit candidate (1-D, not bf16, odd last dim)")


class ProbeResult(_Result):
    model_config = ConfigDict(extra="ignore")
    source: str
    verdict: Literal["qat", "base", "mixed", "no-candidates"] = Field(
        description="qat: every sampled text tensor is on the 4-bit grid (repack_checkpoint will succeed)")
    text_on_grid: int
    text_off_grid: int
    towers_on_grid: int
    towers_off_grid: int
    sampled_groups: int
    tensor_count: int
    off_grid_tensors: list[ProbeTensorInfo] = Field(description="Text and tower tensors found off the grid")
    table: str


class RepackTable(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(description="PLE, embed_tokens, lm_head, linears, rest or towers")
    tensors: int
    bytes_before: int
    bytes_after: int
    groups: int = Field(description="Groups of 32 values recovered on the 4-bit grid")
    offgrid_groups: int
    values: int
    identical_pct: float | None = Field(None, description="Values reproduced bit-identically with the chosen "
                                                          "scale dtype")
    identical_pct_other_dtype: float | None = None
    worst_error_ulps: float | None = None
    worst_error_ulps_other_dtype: float | None = None


class RepackResult(_Result):
    model_config = ConfigDict(extra="ignore")
    source: str
    output: str = Field(description="The written checkpoint folder; pass it to start_vllm_server as model")
    options: dict[str, Any]
    scale_dtype: str
    implementation: str = Field(description="Grid kernel used (numba or numpy)")
    tables: list[RepackTable]
    total_bytes_before: int
    total_bytes_after: int
    output_shards: int
    hardlinked_shards: int
    bytes_read: int
    bytes_written: int
    wall_s: float
    mb_per_s: float
    peak_rss_bytes: int
    table: str = Field(description="The report as a fixed-width table, for people")


class EngineFields(BaseModel):
    """What the engine log of the current start reported; null where the log did not say."""
    model_config = ConfigDict(extra="ignore")
    vllm_version: str | None = None
    platform: str | None = None
    max_model_len: int | None = None
    model_loading_gib: float | None = Field(None, description="GPU memory the weights took")
    model_loading_s: float | None = None
    weights_loading_s: float | None = None
    kv_cache_tokens: int | None = Field(None, description="KV cache size in tokens")
    max_concurrency: float | None = None
    max_concurrency_tokens: int | None = None
    cpu_kv_cache_gib: float | None = None
    torch_compile_s: float | None = None
    warmup_s: float | None = None
    linear_kernel: str | None = Field(None, description="e.g. MarlinLinearKernel (T4), CPUWNA16LinearKernel")
    embedding_method: str | None = None
    attention_backend: str | None = None
    cold_start: bool | None = Field(None, description="True: compiled from scratch (restart once for the KV "
                                                      "figure of a warm start)")
    ready: bool = False
    kernels: list[str] = Field(default_factory=list)


class StartInfo(_Result):
    model_config = ConfigDict(extra="ignore")
    pid: int
    pgid: int
    base_url: str = Field(description="OpenAI-compatible endpoint; run_sweep and compare_tokens default to it")
    model: str
    served_name: str
    platform: str = Field(description="cuda or cpu")
    argv: list[str]
    log_path: str
    state_file: str
    startup_s: float
    first_completion: str | None
    start_fields: EngineFields


class StopInfo(_Result):
    model_config = ConfigDict(extra="ignore")
    was_running: bool
    pid: int | None = None
    signal: str | None = Field(None, description="SIGTERM, or SIGKILL when the grace period ran out")
    stopped_pids: list[int] = Field(default_factory=list)
    remaining_pids: list[int] = Field(default_factory=list)
    message: str = ""


class ServerStatusInfo(_Result):
    model_config = ConfigDict(extra="ignore")
    alive: bool
    healthy: bool = Field(False, description="/health answered 200")
    pid: int | None = None
    uptime_s: float | None = None
    model: str | None = None
    served_name: str | None = None
    base_url: str | None = None
    argv: list[str] | None = None
    platform: str | None = None
    start_fields: EngineFields | None = None
    log_path: str | None = None
    vram: dict[str, Any] | None = Field(None, description="GPU memory of the server (cuda only)")
    died: bool = Field(False, description="A server was recorded but is gone")
    leftover_pids: list[int] = Field(default_factory=list)
    message: str = ""
    roots: dict[str, list[str]] = Field(default_factory=dict, description="Where tools may read and write paths")


class LogResult(_Result):
    log_path: str | None
    lines: list[str]


class QueryInfo(_Result):
    model_config = ConfigDict(extra="ignore")
    text: str
    usage: dict[str, Any]
    model: str
    finish_reason: str | None
    token_ids: list[int] | None = Field(None, description="Generated token ids (greedy, temperature 0)")
    latency_s: float


class SweepCell(BaseModel):
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int
    status: Literal["ok", "infeasible", "failed"]
    reason: str | None = None
    repeats_ok: int
    repeats: int
    output_tok_s: float | None = Field(None, description="Median output tokens/s over the ok repeats")
    request_per_s: float | None = None
    mean_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    spread_pct: float | None = Field(None, description="(max-min)/median of output tok/s over repeats, %")


class SweepInfo(_Result):
    run_id: str
    run_dir: str = Field(description="The run's evidence folder; pass it to compare_sweeps")
    label: str
    model: str | None
    max_model_len: int | None
    wall_s: float | None
    counts: dict[str, int] = Field(description="Cells by status: ok, infeasible, failed")
    cells: list[SweepCell]
    files: dict[str, str]
    table_md: str = Field(description="The run's markdown table")


class CompareCellInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input_len: int
    concurrency: int
    out_tok_s: list[float | None] = Field(description="Median output tok/s per run, in the runs' order")
    ratios: dict[str, float | None] = Field(description="'<last> vs <other>': last / other output tok/s")


class CostRowInfo(BaseModel):
    model_config = ConfigDict(extra="ignore")
    label: str
    out_tok_s: float | None
    usd_per_million: float | None


class CompareSweepsInfo(_Result):
    model_config = ConfigDict(extra="ignore")
    labels: list[str]
    run_dirs: list[str]
    price_per_hour: float
    cells: list[CompareCellInfo]
    ratio_format: dict[str, Any] = Field(description="How each ratio column is written: x (2.30x) or pct (+37%), "
                                                     "per input length")
    cost_cell: list[int] | None = None
    cost: list[CostRowInfo] = Field(default_factory=list)
    markdown: str
    report_path: str | None = Field(None, description="Where the comparison was written, when asked")


class PromptVerdict(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: str
    same_tokens: bool
    reference_len: int
    candidate_len: int
    first_divergence: int | None = Field(None, description="0-based generated position of the first difference")
    reference_token: int | None = None
    candidate_token: int | None = None
    verdict: Literal["identical", "near-tie", "divergence", "length"]
    candidate_in_reference_topk: bool | None = None
    reference_in_candidate_topk: bool | None = None
    logprob_gap: float | None = None


class RecordedPrompt(BaseModel):
    prompt: str
    tokens: int
    finish_reason: str | None
    text: str


class CompareTokensInfo(_Result):
    mode: Literal["record", "check", "live"]
    reference: str | None = Field(None, description="The token record file (record: written; check: read)")
    model: str | None = Field(None, description="record: the served model whose tokens were recorded")
    identical: int | None = Field(None, description="check/live: prompts whose generated ids are all equal")
    total: int = Field(description="Prompts compared or recorded")
    all_identical: bool | None = None
    prompts: list[PromptVerdict] = Field(default_factory=list, description="check/live: per prompt verdict")
    recorded: list[RecordedPrompt] = Field(default_factory=list, description="record: what was recorded")
    report: str = Field("", description="The comparison as text (the article's SAME TOKENS lines)")


class PatchInfo(_Result):
    model_config = ConfigDict(extra="ignore")
    target: str = Field(description="vLLM's triton_unified_attention.py in this environment")
    applied: bool
    backup: str | None = None
    message: str


class VramResult(VramStatus):
    summary: str


class JobList(_Result):
    jobs: list[JobInfo]


# ------------------------------------------------------------------------------------------------- helpers


def _reply(result: BaseModel) -> ToolResult:
    """Structured content plus text for clients that show only text: the summary, then the same JSON."""
    data = result.model_dump(mode="json")
    return ToolResult(content=[TextContent(type="text", text=str(data.get("summary", ""))),
                               TextContent(type="text", text=json.dumps(data, indent=1))],
                      structured_content=data)


def _tool(mcp: FastMCP, **kwargs: Any) -> Callable[[Callable[..., Any]], Any]:
    """mcp.tool with the docstring passed as the description: fastmcp would otherwise import a docstring
    parser (griffe) at start-up to look for Args sections we do not use (parameters carry Field descriptions)."""
    def register(fn: Callable[..., Any]) -> Any:
        description = inspect.cleandoc(fn.__doc__ or "")
        fn.__doc__ = None
        return mcp.tool(description=description, **kwargs)(fn)

    return register


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
        from tools.serving.config import load_config

        merged = {**self.settings.config_overrides, **{k: v for k, v in overrides.items() if v is not None}}
        return load_config(str(self.settings.env_file) if self.settings.env_file else None, **merged)

    def managed_base_url(self) -> str:
        """The base URL of the server this project started (state file), for tools that measure it."""
        from tools.serving.vllm_server import server_status

        st = server_status(self.config())
        if not st.alive or not st.base_url:
            raise ToolError("no vLLM server is running; call start_vllm_server first (or pass base_url)")
        return st.base_url

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

        report = probe_checkpoint(src, roots=list(self.settings.roots.models))
        d = report.to_dict()
        off = [t for t in d["tensors"] if t.get("on_grid") is False]
        summary = (f"{src}: verdict {report.verdict}; text tensors {report.text_on_grid} on grid, "
                   f"{report.text_off_grid} off")
        return ProbeResult.model_validate({**d, "summary": summary, "tensor_count": len(d["tensors"]),
                                           "off_grid_tensors": off, "table": report.format_table()})


# ------------------------------------------------------------------------------------------------ parameters


class RepackParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    output: str
    quantize_linears: bool = True
    text_only: bool = True
    embed_int4: bool = True
    embed_tokens: bool | None = None
    scale_dtype: Literal["fp16", "bf16"] = "fp16"
    force: bool = False


class StartParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    served_name: str | None = None
    port: int | None = Field(None, ge=1, le=65535)
    max_model_len: int | None = Field(None, ge=16)
    max_num_seqs: int | None = Field(None, ge=1)


class CompareArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["record", "check", "live"] = "check"
    reference: str | None = None
    base_url: str | None = None
    other_url: str | None = None
    prompts: list[str] | None = None
    max_tokens: int = Field(160, ge=1)
    top_logprobs: int = Field(5, ge=0, le=20)


class SweepArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    output_dir: str
    label: str = "build"
    input_lens: list[int] = Field(default_factory=lambda: [512, 4096])
    output_len: int = Field(128, ge=1)
    concurrencies: list[int] = Field(default_factory=lambda: [1, 4, 8, 16])
    repeats: int = Field(3, ge=1)
    seed: int = 0
    prompts_per_concurrency: int = Field(4, ge=1)
    min_prompts: int = Field(4, ge=1)
    warmup: bool = True
    resume: bool = False
    price_per_hour: float = Field(0.5241, ge=0)
    base_url: str | None = None


def create_server(settings: Settings | None = None, *, auth: Any = None) -> FastMCP:
    """The MCP server over `settings`; `auth` is a fastmcp auth provider (HTTP only)."""
    settings = settings or Settings()
    core = GemmaT4Server(settings)
    mcp = FastMCP(SERVER_NAME, instructions=INSTRUCTIONS, mask_error_details=False, auth=auth)
    mcp.gemma = core  # type: ignore[attr-defined]  # tests and the demo reach the registry through it

    ro = ToolAnnotations(readOnlyHint=True, idempotentHint=True, destructiveHint=False, openWorldHint=False)

    @_tool(mcp, title="GPU memory (NVML)", annotations=ro)
    async def vram_status() -> VramResult:
        """Per GPU: name, driver, total/used/free MiB, utilization; per process: GPU memory, with the processes
        of the vLLM server this project started marked (its engine core is a child process). On a machine
        without an NVIDIA driver: available=false and the reason, not an error."""
        from tools.gpu import vram

        def read() -> VramResult:
            pid = None
            try:
                from tools.serving.vllm_server import server_status as _status

                pid = getattr(_status(core.config()), "pid", None)
            except Exception:  # no serving config or no server: VRAM is still worth reading
                pid = None
            st = vram.vram_status(server_pid=pid)
            return VramResult(**st.model_dump(), summary=st.summary_line())

        return _reply(await _in_thread(read))  # type: ignore[return-value]

    @_tool(mcp, title="Probe a checkpoint", annotations=ro)
    async def probe_checkpoint(
        path: Annotated[str, Field(description="Checkpoint folder under a models root")],
    ) -> ProbeResult:
        """Read a checkpoint's config and safetensors headers: architecture, text/tower tensors, which tensors
        are linears or embeddings, whether they sit on the 4-bit grid. Writes nothing; run before
        repack_checkpoint."""
        return _reply(await _in_thread(lambda: core.probe(path)))  # type: ignore[return-value]

    @_tool(mcp, title="List jobs", annotations=ro)
    async def list_jobs() -> JobList:
        """Every job started with start_job in this server process, newest last, with state and progress."""
        jobs = core.jobs.list()
        running = [j.job_id for j in jobs if j.state == "running"]
        return _reply(JobList(summary=f"{len(jobs)} job(s), running: {', '.join(running) or 'none'}",
                              jobs=jobs))  # type: ignore[return-value]

    @_tool(mcp, title="Job status", annotations=ro)
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

    @_tool(mcp, title="Cancel a job", annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True,
                                                                 idempotentHint=True, openWorldHint=False))
    async def cancel_job(job_id: Annotated[str, Field(description="The job to cancel")]) -> JobInfo:
        """Ask a running job to stop at its next progress report; the library removes partial output."""
        try:
            return core.jobs.cancel(job_id)
        except KeyError as exc:
            raise _fail(exc) from exc

    @_tool(mcp, title="Run a long tool as a background job",
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
    _register_compare_tokens(mcp, core)
    return mcp


def _register_library_tools(mcp: FastMCP, core: GemmaT4Server) -> None:
    """Tools over the repack, serving and measuring libraries (imported inside the work functions)."""
    roots = core.settings.roots
    ro = ToolAnnotations(readOnlyHint=True, idempotentHint=True, destructiveHint=False, openWorldHint=False)

    # ---------------------------------------------------------------------------------------------- repack
    def repack_work(p: RepackParams, progress: ProgressFn) -> RepackResult:
        src = roots.confine(p.source, "models", must_exist=True, what="source")
        out = roots.confine(p.output, "models", what="output")
        from repack.build import BuildOptions, build_checkpoint

        opts = BuildOptions(quantize_linears=p.quantize_linears, text_only=p.text_only, embed_int4=p.embed_int4,
                            embed_tokens=p.embed_int4 if p.embed_tokens is None else p.embed_tokens,
                            scale_dtype=p.scale_dtype, force=p.force)
        report = build_checkpoint(src, out, opts, progress=lambda d, t, m: progress(d, t, m),
                                  roots=list(roots.models))
        d = report.to_dict()
        off = sum(t["offgrid_groups"] for t in d["tables"])
        summary = (f"wrote {out}: {d['total_bytes_before'] / 2**20:.1f} -> {d['total_bytes_after'] / 2**20:.1f} MiB "
                   f"in {d['wall_s']:.1f} s, {off} off-grid groups")
        return RepackResult.model_validate({**d, "summary": summary, "table": report.format_table()})

    core.long_work["repack_checkpoint"] = (RepackParams, repack_work)

    @_tool(mcp, title="Repack a QAT checkpoint to all-4-bit",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True,
                                          openWorldHint=False))
    async def repack_checkpoint(
        source: Annotated[str, Field(description="QAT checkpoint folder (config.json + safetensors) under a "
                                                 "models root")],
        output: Annotated[str, Field(description="Folder to write, under a models root")],
        quantize_linears: Annotated[bool, Field(description="Pack every linear layer as W4A16")] = True,
        text_only: Annotated[bool, Field(description="Drop vision/audio towers (Gemma4ForCausalLM)")] = True,
        embed_int4: Annotated[bool, Field(description="Pack the per-layer embedding table (PLE) as int4")] = True,
        embed_tokens: Annotated[bool | None, Field(description="Also pack embed_tokens and write an untied int4 "
                                                               "lm_head; default: same as embed_int4")] = None,
        scale_dtype: Annotated[Literal["fp16", "bf16"], Field(description="Scale dtype; fp16 for the T4")] = "fp16",
        force: Annotated[bool, Field(description="Replace an existing output folder")] = False,
        ctx: Context | None = None,
    ) -> RepackResult:
        """Recover the 4-bit grid of a QAT checkpoint in one pass: linears as compressed-tensors W4A16, text only,
        PLE and embed_tokens as int4 with an untied int4 lm_head (the bf16-embedding build: embed_int4=false).
        Aborts on any off-grid group and leaves nothing half written. Progress: bytes done / total. Replaces
        an existing `output` only with force=true. Long: see start_job."""
        params = RepackParams(source=source, output=output, quantize_linears=quantize_linears, text_only=text_only,
                              embed_int4=embed_int4, embed_tokens=embed_tokens, scale_dtype=scale_dtype,
                              force=force)
        return await core.run_long("repack_checkpoint", params, ctx)  # type: ignore[return-value]

    # ---------------------------------------------------------------------------------------------- serving
    def start_work(p: StartParams, progress: ProgressFn) -> StartInfo:
        from tools.serving.vllm_server import start_server, stop_server

        model = roots.confine_model(p.model) if p.model else None
        cfg = core.config(model=model, served_name=p.served_name, port=p.port, max_model_len=p.max_model_len,
                          max_num_seqs=p.max_num_seqs)
        if model is None:  # the config's own MODEL_NAME: a folder there must be inside the roots too
            roots.confine_model(cfg.model, what="MODEL_NAME")
        try:
            res = start_server(cfg, progress=lambda frac, msg: progress(round(frac * 100, 1), 100, msg))
        except BaseException as exc:
            if type(exc).__name__ != "ToolFailure":  # cancelled mid-start: leave no server behind
                try:
                    stop_server(cfg, grace_s=5)
                except Exception:
                    pass
            raise
        d = res.to_dict()
        sf = d.get("start_fields") or {}
        summary = (f"serving {res.served_name} at {res.base_url} (pid {res.pid}, {res.platform}) after "
                   f"{res.startup_s:.0f} s; KV cache {sf.get('kv_cache_tokens') or '?'} tokens")
        return StartInfo.model_validate({**d, "summary": summary})

    core.long_work["start_vllm_server"] = (StartParams, start_work)

    @_tool(mcp, title="Start the vLLM server",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False,
                                          openWorldHint=False))
    async def start_vllm_server(
        model: Annotated[str | None, Field(description="Checkpoint folder under a models root, or a hub id; "
                                                       "default: MODEL_NAME of the serving config")] = None,
        served_name: Annotated[str | None, Field(description="Name clients send as model; default from the "
                                                             "config (the model path)")] = None,
        port: Annotated[int | None, Field(ge=1, le=65535, description="Port on the configured host; default "
                                                                      "PORT of the config")] = None,
        max_model_len: Annotated[int | None, Field(ge=16, description="Context length; default from the "
                                                                      "config")] = None,
        max_num_seqs: Annotated[int | None, Field(ge=1, description="Concurrent sequences; default from the "
                                                                    "config")] = None,
        ctx: Context | None = None,
    ) -> StartInfo:
        """Start vLLM detached (own process group, log file, state file) with every flag from the serving
        config (tpu.env), wait for /health and a first completion, and return the engine's figures: model
        loading GiB, KV cache tokens, kernels. Refuses when a server of this config runs, the port is taken, or
        a Turing GPU lacks the attention clamp (patch_turing). CPU start ~1 min; a T4 cold start compiles."""
        params = StartParams(model=model, served_name=served_name, port=port, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs)
        return await core.run_long("start_vllm_server", params, ctx)  # type: ignore[return-value]

    @_tool(mcp, title="Stop the vLLM server",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True,
                                          openWorldHint=False))
    async def stop_vllm_server(
        grace_s: Annotated[float, Field(ge=0, le=300, description="Seconds between SIGTERM and SIGKILL")] = 20,
    ) -> StopInfo:
        """SIGTERM the server's whole process group (API server and engine core), SIGKILL after grace_s, clear
        its state file; frees the GPU. Safe to call when nothing runs."""
        from tools.serving.vllm_server import stop_server

        def work() -> StopInfo:
            res = stop_server(core.config(), grace_s=grace_s)
            return StopInfo.model_validate({**res.to_dict(), "summary": res.message or "stopped"})

        return _reply(await _in_thread(work))  # type: ignore[return-value]

    @_tool(mcp, title="vLLM server status", annotations=ro)
    async def server_status() -> ServerStatusInfo:
        """Whether the server this project started runs and answers /health: pid, uptime, model, base_url, its
        command line, the engine's start figures (KV cache tokens, kernels, cold/warm), GPU memory; also the
        path roots tools accept."""
        from tools.serving.vllm_server import server_status as status

        def work() -> ServerStatusInfo:
            res = status(core.config())
            return ServerStatusInfo.model_validate({**res.to_dict(), "summary": res.message,
                                                   "roots": roots.describe()})

        return _reply(await _in_thread(work))  # type: ignore[return-value]

    @_tool(mcp, title="vLLM server log", annotations=ro)
    async def server_logs(
        lines: Annotated[int, Field(ge=1, le=2000, description="How many last lines")] = 50,
    ) -> LogResult:
        """The last lines of the vLLM server log (this start's, or the last start's after a failure)."""
        from tools.serving.vllm_server import read_log

        def work() -> LogResult:
            cfg = core.config()
            text = read_log(cfg, lines)
            out = text.splitlines()
            return LogResult(summary=f"{len(out)} line(s) of {cfg.log_file}", log_path=str(cfg.log_file), lines=out)

        return _reply(await _in_thread(work))  # type: ignore[return-value]

    @_tool(mcp, title="Ask the served model",
              annotations=ToolAnnotations(readOnlyHint=True, destructiveHint=False, idempotentHint=False,
                                          openWorldHint=False))
    async def query_model(
        prompt: Annotated[str, Field(min_length=1, description="User message (chat template applied)")],
        max_tokens: Annotated[int, Field(ge=1, le=4096, description="Tokens to generate at most")] = 64,
    ) -> QueryInfo:
        """One greedy chat completion (temperature 0) from the running server: the text, usage and generated
        token ids."""
        from tools.serving.vllm_server import query

        def work() -> QueryInfo:
            res = query(core.config(), prompt, max_tokens=max_tokens)
            d = res.to_dict()
            usage = d.get("usage") or {}
            summary = (f"{usage.get('completion_tokens', '?')} tokens in {res.latency_s:.2f} s "
                       f"({res.finish_reason}): {res.text[:120]!r}")
            return QueryInfo.model_validate({**d, "summary": summary})

        return _reply(await _in_thread(work))  # type: ignore[return-value]

    @_tool(mcp, title="Turing attention clamp (check / apply / revert)",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=True, idempotentHint=True,
                                          openWorldHint=False))
    async def patch_turing(
        action: Annotated[Literal["check", "apply", "revert"],
                          Field(description="check: read only; apply: patch vLLM's triton_unified_attention.py "
                                            "(backup kept); revert: restore it")] = "check",
    ) -> PatchInfo:
        """The T4 (sm_75) has 64 KiB shared memory; vLLM's Triton attention asks 96 KiB at head size 512. The
        clamp halves the tile sizes on compute capability < 8 and launches with one stage. start_vllm_server
        refuses on a Turing GPU until it is applied. Patches the vLLM installed in this environment only."""
        from tools.serving import turing_patch

        def work() -> PatchInfo:
            fn = {"check": turing_patch.check, "apply": turing_patch.apply, "revert": turing_patch.revert}[action]
            res = fn()
            return PatchInfo.model_validate({**res.to_dict(), "summary": res.message})

        return _reply(await _in_thread(work))  # type: ignore[return-value]

    # ---------------------------------------------------------------------------------------------- measuring
    def sweep_work(p: SweepArgs, progress: ProgressFn) -> SweepInfo:
        out = roots.confine(p.output_dir, "evidence", what="output_dir")
        from tools.measure.sweep import run_sweep as sweep

        base_url = p.base_url or core.managed_base_url()  # the managed server, not the config's default port
        res = sweep(progress=lambda d, t, m: progress(d, t, m), base_url=base_url, out=str(out), label=p.label,
                    input_lens=p.input_lens, output_len=p.output_len, concurrencies=p.concurrencies,
                    repeats=p.repeats, seed=p.seed, prompts_per_concurrency=p.prompts_per_concurrency,
                    min_prompts=p.min_prompts, warmup=p.warmup, resume=p.resume, price_per_hour=p.price_per_hour)
        return _sweep_info(res)

    core.long_work["run_sweep"] = (SweepArgs, sweep_work)

    @_tool(mcp, title="Serving sweep (vllm bench serve)",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False,
                                          openWorldHint=False))
    async def run_sweep(
        output_dir: Annotated[str, Field(description="Folder under an evidence root; the run folder is made "
                                                     "inside it")],
        label: Annotated[str, Field(description="Build name for tables, e.g. emb4 or bf16 (no spaces)")] = "build",
        input_lens: Annotated[list[int], Field(description="Prompt lengths in tokens")] = [512, 4096],  # noqa: B006
        output_len: Annotated[int, Field(ge=1, description="Output tokens per request (ignore_eos)")] = 128,
        concurrencies: Annotated[list[int], Field(description="Concurrent requests per cell")] = [1, 4, 8, 16],  # noqa: B006
        repeats: Annotated[int, Field(ge=1, description="Repeats per cell (medians reported)")] = 3,
        seed: Annotated[int, Field(description="Base prompt seed: keep equal across builds")] = 0,
        prompts_per_concurrency: Annotated[int, Field(ge=1, description="Prompts per cell = max(min_prompts, "
                                                                         "concurrency x this)")] = 4,
        min_prompts: Annotated[int, Field(ge=1, description="Fewest prompts per cell")] = 4,
        warmup: Annotated[bool, Field(description="Warm each cell with separate-seed prompts first")] = True,
        resume: Annotated[bool, Field(description="Continue the latest matching run, skipping finished "
                                                  "repeats")] = False,
        price_per_hour: Annotated[float, Field(ge=0, description="Machine price for the $/M tokens column")] = 0.5241,
        base_url: Annotated[str | None, Field(description="Server to measure; default: the one "
                                                          "start_vllm_server started")] = None,
        ctx: Context | None = None,
    ) -> SweepInfo:
        """Measure the running server with vLLM's own benchmark over input lengths x concurrencies x repeats
        (random dataset, per-cell seeds so every build answers the same prompts and none is served from the
        prefix cache). Writes summary.json/.csv/.md, raw results and provenance into a run folder. Progress:
        repeats done / planned. Long: see start_job."""
        params = SweepArgs(output_dir=output_dir, label=label, input_lens=input_lens, output_len=output_len,
                           concurrencies=concurrencies, repeats=repeats, seed=seed,
                           prompts_per_concurrency=prompts_per_concurrency, min_prompts=min_prompts, warmup=warmup,
                           resume=resume, price_per_hour=price_per_hour, base_url=base_url)
        return await core.run_long("run_sweep", params, ctx)  # type: ignore[return-value]

    @_tool(mcp, title="Compare sweep runs",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=True,
                                          openWorldHint=False))
    async def compare_sweeps(
        run_dirs: Annotated[list[str], Field(min_length=2, description="Sweep run folders (run_sweep's run_dir), "
                                                                       "baselines first, the candidate last")],
        output: Annotated[str | None, Field(description="Optional .md file under an evidence root to write the "
                                                        "comparison to (a .json beside it)")] = None,
        price_per_hour: Annotated[float, Field(ge=0, description="Machine price for the cost table")] = 0.5241,
    ) -> CompareSweepsInfo:
        """The article's comparison: per (input length, concurrency) the median output tok/s of each run and the
        last run's ratio to each earlier one (x or +%), plus a cost-per-million-tokens table."""
        def work() -> CompareSweepsInfo:
            dirs = [roots.confine(d, "evidence", must_exist=True, what="run_dir") for d in run_dirs]
            out = roots.confine(output, "evidence", what="output") if output else None
            from tools.measure.sweep_report import compare_runs

            cmp = compare_runs([str(d) for d in dirs], price_per_hour=price_per_hour)
            d = cmp.to_dict()
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(cmp.markdown + "\n")
                out.with_suffix(".json").write_text(json.dumps(d, indent=2) + "\n")
            ratios = [f"{k}: {v}" for k, v in (d["cells"][0]["ratios"].items() if d["cells"] else [])]
            summary = f"compared {', '.join(cmp.labels)} over {len(d['cells'])} cells" + (
                f"; first cell {'; '.join(ratios)}" if ratios else "")
            return CompareSweepsInfo.model_validate({**d, "summary": summary,
                                                     "report_path": str(out) if out else None})

        return _reply(await _in_thread(work))  # type: ignore[return-value]


def _register_compare_tokens(mcp: FastMCP, core: GemmaT4Server) -> None:
    roots = core.settings.roots

    def compare_work(p: CompareArgs, progress: ProgressFn) -> CompareTokensInfo:
        ref = None
        if p.reference:
            ref = roots.confine(p.reference, "evidence", must_exist=p.mode == "check", what="reference")
        from tools.measure.compare_tokens import compare_tokens as compare

        base_url = p.base_url or core.managed_base_url()
        res = compare(progress=lambda d, t, m: progress(d, t, m), mode=p.mode, base_url=base_url,
                      other_url=p.other_url, reference=str(ref) if ref else None, prompts=p.prompts,
                      max_tokens=p.max_tokens, top_logprobs=p.top_logprobs)
        if p.mode == "record":
            recorded = [RecordedPrompt(prompt=g.prompt, tokens=len(g.token_ids), finish_reason=g.finish_reason,
                                       text=g.text) for g in res.generations]
            return CompareTokensInfo(summary=res.summary(), mode="record", reference=str(ref), model=res.model,
                                     total=len(recorded), recorded=recorded,
                                     report="\n".join(f"{r.tokens} tokens: {r.prompt}" for r in recorded))
        return CompareTokensInfo(summary=f"{res.summary} ({res.reference} vs {res.candidate})", mode=p.mode,
                                 reference=str(ref) if ref else res.reference, identical=res.identical,
                                 total=res.total, all_identical=res.identical == res.total,
                                 prompts=[PromptVerdict.model_validate(x.model_dump()) for x in res.prompts],
                                 report=res.text())

    core.long_work["compare_tokens"] = (CompareArgs, compare_work)

    @_tool(mcp, title="Greedy token identity between builds",
              annotations=ToolAnnotations(readOnlyHint=False, destructiveHint=False, idempotentHint=False,
                                          openWorldHint=False))
    async def compare_tokens(
        mode: Annotated[Literal["record", "check", "live"],
                        Field(description="record: save the running build's greedy tokens to `reference`; "
                                          "check: compare the running build with that record; live: compare "
                                          "base_url (reference) with other_url")] = "check",
        reference: Annotated[str | None, Field(description="Token record file under an evidence root (record "
                                                           "and check)")] = None,
        base_url: Annotated[str | None, Field(description="Build under test; default: the server "
                                                          "start_vllm_server started")] = None,
        other_url: Annotated[str | None, Field(description="live: the candidate's endpoint")] = None,
        prompts: Annotated[list[str] | None, Field(description="record/live: prompts; default: the article's "
                                                               "eight")] = None,
        max_tokens: Annotated[int, Field(ge=1, description="Generated tokens per prompt")] = 160,
        top_logprobs: Annotated[int, Field(ge=0, le=20, description="Alternatives kept per position for the "
                                                                     "near-tie check")] = 5,
        ctx: Context | None = None,
    ) -> CompareTokensInfo:
        """Exact generated token ids (chat template, temperature 0) of two builds, prompt by prompt: the first
        divergence and whether it is a near-tie (each side's token in the other's top-k). One T4 serves one
        build at a time: record with build A, restart with build B, check. Progress: prompts done."""
        params = CompareArgs(mode=mode, reference=reference, base_url=base_url, other_url=other_url,
                             prompts=prompts, max_tokens=max_tokens, top_logprobs=top_logprobs)
        return await core.run_long("compare_tokens", params, ctx)  # type: ignore[return-value]


def _sweep_info(res: Any) -> SweepInfo:
    from tools.measure.sweep_report import markdown_run

    cells = []
    for c in res.cells:
        m, sp = c.median or {}, c.spread_pct or {}
        cells.append(SweepCell(input_len=c.input_len, output_len=c.output_len, concurrency=c.concurrency,
                               num_prompts=c.num_prompts, status=c.status, reason=c.reason,
                               repeats_ok=sum(r.status == "ok" for r in c.repeats), repeats=len(c.repeats),
                               output_tok_s=m.get("output_throughput"), request_per_s=m.get("request_throughput"),
                               mean_ttft_ms=m.get("mean_ttft_ms"), p99_ttft_ms=m.get("p99_ttft_ms"),
                               mean_tpot_ms=m.get("mean_tpot_ms"), spread_pct=sp.get("output_throughput")))
    counts = res.counts
    best = max((c for c in cells if c.output_tok_s), key=lambda c: c.output_tok_s or 0, default=None)
    summary = (f"sweep {res.run_id} ({res.label}): {counts['ok']} ok, {counts['failed']} failed, "
               f"{counts['infeasible']} infeasible cells"
               + (f"; best {best.output_tok_s:.2f} out tok/s at in={best.input_len} c={best.concurrency}"
                  if best else ""))
    return SweepInfo(summary=summary, run_id=res.run_id, run_dir=res.run_dir, label=res.label, model=res.model,
                     max_model_len=res.max_model_len, wall_s=res.wall_s, counts=counts, cells=cells,
                     files=dict(res.files), table_md=markdown_run(res, price_per_hour=res.params.get(
                         "price_per_hour", 0.5241)))


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
