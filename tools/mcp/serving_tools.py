"""Serving tools: the vLLM servers (named instances) this project starts (tools/serving does the work)."""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel, Field

from tools.core.errors import ToolFailure
from tools.core.paths import PathNotAllowed
from tools.core.progress import percent
from tools.mcp.registry import Reply, tool
from tools.serving import (QueryResult, ServerStatus, StartResult, StopResult, SwitchResult, behind_door_state,
                           fleet_status, log_path, missing_model_fix, query, read_log, server_status as status,
                           service, stop_all)
from tools.serving.ops import LogParams, QueryParams, StartParams, StatusParams, StopParams
from tools.mcp.wording import on_platform, warnings_text


def _start_config(app, p: StartParams):
    """The serving config of the instance with the model confined (a folder under a models root, or a hub id);
    a missing folder is refused with the calls that make it on this platform."""
    base = app.config(instance=p.instance)
    also = (base.state_dir, base.instance_dir)  # vLLM runs there and would read a relative model string from there
    given = p.model if p.model is not None else base.model
    try:  # the config's own MODEL_NAME too: a folder there must be inside the roots
        model = app.roots.confine_model(given, what="model" if p.model is not None else "MODEL_NAME",
                                        also_relative_to=also)
    except PathNotAllowed as exc:
        if exc.detail["problem"] != "missing":
            raise
        raise ToolFailure(f"{exc}: {missing_model_fix(exc.detail['input'], app.platform())}",
                          detail=exc.detail) from None
    return app.config(**{**p.overrides(), "model": model})


@tool(toolset="serve", title="Start the vLLM server", params=StartParams, result=StartResult | SwitchResult,
      long=True, open_world=True, check=_start_config, ops="start")
def start_vllm_server(app, p: StartParams, progress, checked) -> Reply:
    """Serve a build (a folder under a models root, or a hub id) with vLLM; returns once it answers a completion
    and a chat, or at once naming the fix. Long."""
    # Owned until ready (service.start): a client that goes away, a SIGTERM or a SIGKILL of this server while
    # vLLM starts ends that vLLM too; once it serves it is handed over. A front-door switch runs in a process of
    # its own and ends alone.
    res = service.start(checked, replace_running=p.replace, new_key=bool(p.new_key),
                        progress=percent(progress))
    if isinstance(res, SwitchResult):
        where = on_platform(getattr(behind_door_state(checked), "platform", None))
        return Reply(res, f"{service.describe(res)} {where}{warnings_text(res.warnings)}")
    sf = res.start_fields
    mem = f"; host RSS {res.host_memory.rss_mib:.0f} MiB" if res.host_memory else ""
    instead = (f" in place of {res.replaced['served_name']} (its port refused connections while "
               f"{res.served_name} loaded, {res.startup_s:.0f} s)") if res.replaced else ""
    door = (f" (the front door; the build on instance {res.front_door['instance']} at "
            f"{res.front_door['backend_url']})") if res.front_door else ""
    note = f"; {res.note}" if res.note else ""
    return Reply(res, f"serving {res.served_name}{instead} at {res.base_url}{door} (pid {res.pid}, {res.platform}) "
                      f"after {res.startup_s:.0f} s; KV cache {sf.kv_cache_tokens or '?'} tokens{mem}{note}"
                      f"{warnings_text(res.warnings)}")


class StopAll(BaseModel):
    stopped: list[dict] = Field(description="all=true: each stop's result")


@tool(toolset="serve", title="Stop the vLLM server", params=StopParams, result=StopResult | StopAll,
      destructive=True, idempotent=True, ops="stop")
def stop_vllm_server(app, p: StopParams) -> Reply:
    """Stop a server this project started (all=true: every one). Safe when nothing runs."""
    if p.all:
        if p.instance is not None:
            raise ToolFailure("all and instance exclude each other: pass one")
        results = stop_all(app.config(), grace_s=p.grace_s)
        return Reply(StopAll(stopped=[r.to_dict() for r in results]), "; ".join(r.message for r in results))
    results = service.stop(app.config(instance=p.instance), grace_s=p.grace_s)
    if len(results) > 1:  # the front door and the builds behind it
        return Reply(StopAll(stopped=[r.to_dict() for r in results]), "; ".join(r.message for r in results))
    return Reply(results[0], results[0].message or "stopped")


@tool(toolset="serve", title="vLLM server status", params=StatusParams, result=ServerStatus, read_only=True,
      idempotent=True, extra={"roots": (dict[str, list[str]], "Where tools may read and write paths")},
      ops="status")
def server_status(app, p: StatusParams) -> Reply:
    """What this project's servers serve, whether they answer, and the path roots; call it when unsure."""
    if p.instance is not None:
        res = status(app.config(instance=p.instance))
    else:
        res = fleet_status(app.config())
        if res.instances:
            # The fleet at a glance, within an answer's budget: each instance's engine figures and command line
            # are server_status(instance=...)'s (two whole instances outgrow it, and the guard would drop them all)
            res.instances = [replace(i, argv=None, start_fields=None) for i in res.instances]
            res.message += "; " + ", ".join(f"{i.instance}: {'serving' if i.healthy else 'down'}"
                                            for i in res.instances)
    return Reply(res, res.message, {"roots": app.roots.describe()})


class LogTail(BaseModel):
    log_path: str | None = Field(description="The server's log file")
    lines: list[str] = Field(description="Its last lines")


@tool(toolset="log", title="vLLM server log", params=LogParams, result=LogTail, read_only=True, idempotent=True,
      ops="log")
def server_logs(app, p: LogParams) -> Reply:
    """The vLLM server log's last lines: read it when a start failed or the server misbehaves."""
    cfg = app.config(instance=p.instance)
    out = read_log(cfg, p.lines).splitlines()
    path = log_path(cfg)  # the recorded server's own log, else the newest launch's
    return Reply(LogTail(log_path=str(path), lines=out), f"{len(out)} line(s) of {path}")


@tool(toolset="serve", title="Ask the served model", params=QueryParams, result=QueryResult, read_only=True,
      ops="query")
def query_model(app, p: QueryParams) -> Reply:
    """One greedy chat completion from the running server: a quick check that a build answers."""
    app.managed_base_url(p.instance)  # refuses when no server is recorded, instead of posting to the config's port
    cfg = app.config(instance=p.instance)
    res = query(cfg, p.prompt, max_tokens=p.max_tokens)
    usage = res.usage or {}
    return Reply(res, f"{usage.get('completion_tokens', '?')} tokens in {res.latency_s:.2f} s "
                      f"{app.served_on(p.instance)} ({res.finish_reason}): {res.text[:120]!r}")
