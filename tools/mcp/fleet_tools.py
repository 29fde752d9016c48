"""Fleet tools: vllm-router in front of named instances (tools/serving/router.py does the work)."""

from __future__ import annotations

from tools.mcp.registry import Reply, tool
from tools.serving.ops import RouterStartParams, RouterStopParams
from tools.serving.router import (RouterStartResult, RouterStatus, RouterStopResult, router_status as status,
                                  start_router as start, stop_router as stop)


@tool(toolset="fleet", title="Start vllm-router", params=RouterStartParams, result=RouterStartResult,
      open_world=True, ops="router.start")
def start_router(app, p: RouterStartParams) -> Reply:
    """Start vLLM's router over running instances (start_vllm_server with `instance`), one URL for all of them;
    measure through it with run_sweep router=true. Refused when an instance is not running."""
    res = start(app.config(), p.instances, policy=p.policy, port=p.port)
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
