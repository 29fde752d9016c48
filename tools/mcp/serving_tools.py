"""Serving tools: the vLLM servers (named instances) this project starts (tools/serving does the work)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from tools.core.errors import ToolFailure
from tools.mcp.registry import Reply, tool
from tools.serving.instances import fleet_status, stop_all
from tools.serving.ops import LogParams, QueryParams, StartParams, StatusParams, StopParams
from tools.serving.vllm_server import (QueryResult, ServerStatus, StartResult, StopResult, query, read_log,
                                       server_status as status, start_server, stop_server)


def _start_config(app, p: StartParams):
    """The serving config of the instance with the model confined (a folder under a models root, or a hub id)."""
    base = app.config(instance=p.instance)
    also = (base.state_dir, base.instance_dir)  # vLLM runs there and would read a relative model string from there
    if p.model is not None:
        model = app.roots.confine_model(p.model, also_relative_to=also)
    else:  # the config's own MODEL_NAME: a folder there must be inside the roots too
        model = app.roots.confine_model(base.model, what="MODEL_NAME", also_relative_to=also)
    return app.config(**{**p.overrides(), "model": model})


@tool(toolset="serve", title="Start the vLLM server", params=StartParams, result=StartResult, long=True,
      open_world=True, check=_start_config)
def start_vllm_server(app, p: StartParams, progress) -> Reply:
    """Start vLLM detached with the serving config's flags, wait for /health and a first completion, and return
    the engine's figures (KV cache tokens, kernels, load time). `model` is a folder under a models root or a hub
    id (owner/name, downloaded by vLLM). Long: CPU ~1 min, a cold T4 start compiles."""
    res = start_server(_start_config(app, p), progress=lambda frac, msg: progress(round(frac * 100, 1), 100, msg))
    sf = res.start_fields
    return Reply(res, f"serving {res.served_name} at {res.base_url} (pid {res.pid}, {res.platform}) after "
                      f"{res.startup_s:.0f} s; KV cache {sf.kv_cache_tokens or '?'} tokens")


class StopAll(BaseModel):
    stopped: list[dict] = Field(description="Each stop's result: the router first, then every instance")


@tool(toolset="serve", title="Stop the vLLM server", params=StopParams, result=StopResult | StopAll,
      destructive=True, idempotent=True)
def stop_vllm_server(app, p: StopParams) -> Reply:
    """Stop a server this project started (SIGTERM to its process group, SIGKILL after grace_s) and free the
    GPU; all=true stops the router and every instance. Safe to call when nothing runs."""
    if p.all:
        if p.instance is not None:
            raise ToolFailure("all and instance exclude each other: pass one")
        results = stop_all(app.config(), grace_s=p.grace_s)
        return Reply(StopAll(stopped=[r.to_dict() for r in results]), "; ".join(r.message for r in results))
    res = stop_server(app.config(instance=p.instance), grace_s=p.grace_s)
    return Reply(res, res.message or "stopped")


@tool(toolset="serve", title="vLLM server status", params=StatusParams, result=ServerStatus, read_only=True,
      idempotent=True, extra={"roots": (dict[str, list[str]], "Where tools may read and write paths")})
def server_status(app, p: StatusParams) -> Reply:
    """Whether the servers this project started run and answer /health: the default one's model, base_url,
    command line and engine figures, `instances` (every instance) and `router`; also lists the path roots
    tools accept. Use it first when unsure what is running."""
    if p.instance is not None:
        res = status(app.config(instance=p.instance))
    else:
        res = fleet_status(app.config())
        if res.instances and len(res.instances) > 1:
            res.message += "; " + ", ".join(f"{i.instance}: {'serving' if i.healthy else 'down'}"
                                            for i in res.instances)
    return Reply(res, res.message, {"roots": app.roots.describe()})


class LogTail(BaseModel):
    log_path: str | None = Field(description="The server's log file")
    lines: list[str] = Field(description="Its last lines")


@tool(toolset="serve", title="vLLM server log", params=LogParams, result=LogTail, read_only=True, idempotent=True)
def server_logs(app, p: LogParams) -> Reply:
    """The last lines of the vLLM server log (this start's, or the last start's after a failure); use it when
    a start failed or the server misbehaves."""
    cfg = app.config(instance=p.instance)
    out = read_log(cfg, p.lines).splitlines()
    return Reply(LogTail(log_path=str(cfg.log_file), lines=out), f"{len(out)} line(s) of {cfg.log_file}")


@tool(toolset="serve", title="Ask the served model", params=QueryParams, result=QueryResult, read_only=True)
def query_model(app, p: QueryParams) -> Reply:
    """One greedy chat completion (temperature 0) from a server start_vllm_server started: text, usage and
    token ids. A quick check that a build answers sensibly."""
    app.managed_base_url(p.instance)  # refuses when no server is recorded, instead of posting to the config's port
    res = query(app.config(instance=p.instance), p.prompt, max_tokens=p.max_tokens)
    usage = res.usage or {}
    return Reply(res, f"{usage.get('completion_tokens', '?')} tokens in {res.latency_s:.2f} s "
                      f"({res.finish_reason}): {res.text[:120]!r}")
