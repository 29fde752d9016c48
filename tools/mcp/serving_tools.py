"""Serving tools: the vLLM server this project starts (tools/serving does the work)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from tools.mcp.registry import Reply, tool
from tools.serving.ops import LogParams, QueryParams, StartParams, StopParams
from tools.serving.vllm_server import QueryResult, ServerStatus, StartResult, StopResult


@tool(toolset="serve", title="Start the vLLM server", params=StartParams, result=StartResult, long=True,
      open_world=True)
def start_vllm_server(app, p: StartParams, progress) -> Reply:
    """Start vLLM detached with the serving config's flags, wait for /health and a first completion, and return
    the engine's figures (KV cache tokens, kernels, load time). `model` is a folder under a models root or a hub
    id (owner/name, downloaded by vLLM). Long: CPU ~1 min, a cold T4 start compiles."""
    from tools.serving.vllm_server import start_server

    base = app.config()
    also = (base.state_dir,)  # vLLM runs there and would read a relative model string from there first
    if p.model is not None:
        model = app.roots.confine_model(p.model, also_relative_to=also)
    else:  # the config's own MODEL_NAME: a folder there must be inside the roots too
        model = app.roots.confine_model(base.model, what="MODEL_NAME", also_relative_to=also)
    cfg = app.config(**{**p.overrides(), "model": model})
    res = start_server(cfg, progress=lambda frac, msg: progress(round(frac * 100, 1), 100, msg))
    sf = res.start_fields
    return Reply(res, f"serving {res.served_name} at {res.base_url} (pid {res.pid}, {res.platform}) after "
                      f"{res.startup_s:.0f} s; KV cache {sf.kv_cache_tokens or '?'} tokens")


@tool(toolset="serve", title="Stop the vLLM server", params=StopParams, result=StopResult, destructive=True,
      idempotent=True)
def stop_vllm_server(app, p: StopParams) -> Reply:
    """Stop the server this project started (SIGTERM to its process group, SIGKILL after grace_s) and free the
    GPU; safe to call when nothing runs."""
    from tools.serving.vllm_server import stop_server

    res = stop_server(app.config(), grace_s=p.grace_s)
    return Reply(res, res.message or "stopped")


@tool(toolset="serve", title="vLLM server status", result=ServerStatus, read_only=True, idempotent=True,
      extra={"roots": (dict[str, list[str]], "Where tools may read and write paths")})
def server_status(app, p) -> Reply:
    """Whether the server this project started runs and answers /health, with its model, base_url, command line
    and engine figures; also lists the path roots tools accept. Use it first when unsure what is running."""
    from tools.serving.vllm_server import server_status as status

    res = status(app.config())
    return Reply(res, res.message, {"roots": app.roots.describe()})


class LogTail(BaseModel):
    log_path: str | None = Field(description="The server's log file")
    lines: list[str] = Field(description="Its last lines")


@tool(toolset="serve", title="vLLM server log", params=LogParams, result=LogTail, read_only=True, idempotent=True)
def server_logs(app, p: LogParams) -> Reply:
    """The last lines of the vLLM server log (this start's, or the last start's after a failure); use it when
    a start failed or the server misbehaves."""
    from tools.serving.vllm_server import read_log

    cfg = app.config()
    out = read_log(cfg, p.lines).splitlines()
    return Reply(LogTail(log_path=str(cfg.log_file), lines=out), f"{len(out)} line(s) of {cfg.log_file}")


@tool(toolset="serve", title="Ask the served model", params=QueryParams, result=QueryResult, read_only=True)
def query_model(app, p: QueryParams) -> Reply:
    """One greedy chat completion (temperature 0) from the server start_vllm_server started: text, usage and
    token ids. A quick check that a build answers sensibly."""
    from tools.serving.vllm_server import query

    app.managed_base_url()  # refuses when no server is recorded, instead of posting to the config's port
    res = query(app.config(), p.prompt, max_tokens=p.max_tokens)  # the recorded server and its served name
    usage = res.usage or {}
    return Reply(res, f"{usage.get('completion_tokens', '?')} tokens in {res.latency_s:.2f} s "
                      f"({res.finish_reason}): {res.text[:120]!r}")
