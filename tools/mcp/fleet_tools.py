"""Fleet tools: vllm-router in front of named instances (tools/serving/frontdoor/router.py does the work)."""

from __future__ import annotations

from tools.core.errors import ToolFailure
from tools.core.paths import PathNotAllowed
from tools.core.process import free_port
from tools.core.progress import percent
from tools.mcp.registry import Reply, tool
from tools.mcp.wording import on_platform, warnings_text
from tools.serving import (RouterStartResult, RouterStatus, RouterStopResult, SwitchResult, load_state,
                           missing_model_fix, router_status as status, start_router as start, stop_router as stop,
                           switch_process)
from tools.serving.ops import RouterStartParams, RouterStopParams, RouterSwitchParams


@tool(toolset="fleet", title="Start vllm-router", params=RouterStartParams, result=RouterStartResult,
      open_world=True, ops="router.start")
def start_router(app, p: RouterStartParams) -> Reply:
    """Start vLLM's router over running instances (start_vllm_server with `instance`), one URL for all of them;
    measure through it with run_sweep router=true. Refused when an instance is not running."""
    res = start(app.config(), p.instances, policy=p.policy, port=p.port, hold_s=p.hold_s)
    return Reply(res, f"routing at {res.base_url} ({res.policy}) over "
                      + ", ".join(f"{b.instance} {b.base_url}" for b in res.backends))


@tool(toolset="fleet", title="vllm-router status", result=RouterStatus, read_only=True, idempotent=True,
      ops="router.status")
def router_status(app, p) -> Reply:
    """Whether the router runs and answers /health, its policy and which backends answer."""
    res = status(app.config())
    return Reply(res, res.message)


@tool(toolset="fleet", title="Stop vllm-router", params=RouterStopParams, result=RouterStopResult,
      destructive=True, idempotent=True, ops="router.stop")
def stop_router(app, p: RouterStopParams) -> Reply:
    """Stop the router (SIGTERM to its process group, SIGKILL after grace_s); the instances keep running."""
    res = stop(app.config(), grace_s=p.grace_s)
    return Reply(res, res.message)


def _switch_config(app, p: RouterSwitchParams):
    """The new build's instance config, its model confined to the roots, on an internal port of its own."""
    base = app.config(instance=p.instance)
    try:
        model = app.roots.confine_model(p.model, what="model", also_relative_to=(base.state_dir, base.instance_dir))
    except PathNotAllowed as exc:
        if exc.detail["problem"] != "missing":
            raise
        raise ToolFailure(f"{exc}: {missing_model_fix(exc.detail['input'], app.platform())}",
                          detail=exc.detail) from None
    cfg = app.config(**{**p.overrides(), "model": model})
    return cfg if p.port is not None else app.config(**{**p.overrides(), "model": model,
                                                        "port": free_port(cfg.host)})


@tool(toolset="fleet", title="Switch the build behind the router", params=RouterSwitchParams,
      result=SwitchResult, long=True, destructive=True, open_world=True, check=_switch_config)
def switch_build(app, p: RouterSwitchParams, progress, checked) -> Reply:
    """Serve another build behind the router (start_router) in place of the one it routes to, with no failed
    request: beside it where the machine holds both (then it drains and stops), else it stops first and the
    router holds requests up to its hold_s while the new one loads (said before anything stops). A new build
    that fails or refuses requests leaves or gives the traffic back to the old one. It runs in a process of its
    own: a client that goes away leaves it to end alone; a cancellation rolls it back. Long."""
    # In a process of its own: a client that drops this server (SIGKILL) leaves the switch to end alone
    res = switch_process.switch(app.config(), checked, from_instance=p.from_instance,
                                progress=percent(progress))
    f = res.figures
    return Reply(res, f"{res.outcome} at {res.base_url} in place of {res.replaced} ({res.mode}): {f.requests} "
                      f"requests through the router, {f.failed} failed, longest wait for a build "
                      f"{f.longest_wait_s:g} s {on_platform(getattr(load_state(checked), 'platform', None))}; "
                      f"builds: {res.replaced_model} -> {res.model}{warnings_text(res.warnings)}")
