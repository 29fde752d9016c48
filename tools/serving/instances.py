"""Every instance at once: their status with the router's, and stopping them all (router first).

Which instances run and what a new start may take (ports, cores, GPU shares) is tools.serving.placement; its
names are offered here too, where the instance commands have always found them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.core.errors import ToolFailure, op
from tools.serving import router, router_state, state, switch_record
from tools.serving.config import INSTANCE_NAME, ServeConfig
from tools.serving.placement import instance_configs, locked, plan, process_owners, resolve, running
from tools.serving.vllm_server import server_status, stop_server


def all_status(cfg: ServeConfig, *, hardware: Any = None) -> list[Any]:
    """ServerStatus of the default instance (when recorded) and every named instance."""
    out = []
    for c in instance_configs(cfg):
        if not c.instance and not c.state_file.is_file():
            continue
        out.append(server_status(c, hardware=hardware))
    return out


def fleet_status(cfg: ServeConfig, *, hardware: Any = None) -> Any:
    """The default instance's ServerStatus (as before instances) with the named instances and the router listed
    (the default instance is the top level, not listed again); all_healthy only when at least one is reported
    and each reported one answers /health."""
    default_cfg = replace(cfg, instance="")
    had_default = default_cfg.state_file.is_file() or state.replace_file(default_cfg).is_file()
    top = server_status(default_cfg, hardware=hardware)
    listed = [server_status(c, hardware=hardware) for c in _configs_with_a_replace(cfg)[1:]]
    r = router.router_status(cfg) if router.state_file(cfg).is_file() else None
    top.instances = listed
    top.router = r.to_dict() if r is not None else None
    reported = ([top] if had_default else []) + listed
    healthy = [i.alive and i.healthy for i in reported] + ([r.alive and r.healthy] if r is not None else [])
    top.all_healthy = bool(healthy) and all(healthy)
    door_up = router_state.door_on_port(default_cfg) is not None and r is not None and r.alive and not had_default
    if door_up:
        # the default service is the door, healthy when it answers and so does a build behind it
        behind = [i for i in listed if i.instance in r.backends_healthy]
        top.message = (f"the front door at {r.base_url} {'answers' if r.healthy else 'does not answer'}, over "
                       + (", ".join(f"{i.served_name} (instance {i.instance}, "
                                    f"{'serving' if i.alive and i.healthy else 'down'})" for i in behind)
                          or "no build"))
        top.all_healthy = r.healthy and bool(behind) and all(i.alive and i.healthy for i in behind)
    elif listed and not had_default:
        top.message = f"{len(listed)} named instance(s); the default instance is not running"
    if (listed or door_up) and not had_default:
        last = switch_record.load_switch(default_cfg)  # the front door's last switch is recorded there
        if last is not None:
            top.message += f"; {switch_record.describe(last)}"
    return top


def _configs_with_a_replace(cfg: ServeConfig) -> list[ServeConfig]:
    """instance_configs, and the named instances with only a replace record (their A stopped, no B recorded)."""
    configs = instance_configs(cfg)
    names = {c.instance for c in configs}
    root = Path(cfg.state_dir)
    extra = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name not in names
                   and (d / "replace.json").is_file()) if root.is_dir() else []
    configs += [replace(cfg, instance=n) for n in extra if INSTANCE_NAME.fullmatch(n)]
    return configs[:1] + sorted(configs[1:], key=lambda c: c.instance)


def stop_all(cfg: ServeConfig, *, grace_s: float = 20) -> list[Any]:
    """Stops the router first (it would route to stopped servers), then every instance. One that cannot be
    stopped (a damaged state file, whose processes are not signalled; a process that survives SIGKILL) does not
    keep the others running: they are stopped, then one ToolFailure names what was not, with what was stopped
    in its detail."""
    results: list[Any] = []
    failed: list[ToolFailure] = []
    try:
        results.append(router.stop_router(cfg, grace_s=grace_s))
    except ToolFailure as exc:
        failed.append(exc)
    for c in instance_configs(cfg):
        if c.state_file.is_file():
            try:
                results.append(stop_server(c, grace_s=grace_s))
            except ToolFailure as exc:
                failed.append(exc)
    if failed:
        stopped = sum(1 for r in results if r.was_running)
        more = (f"; and {len(failed) - 2} more, each named in detail.failed ({op('status')} shows each instance)"
                if len(failed) > 2 else "")
        raise ToolFailure(f"stopped {stopped} of the recorded servers and routers, {len(failed)} could not be: "
                          + "; ".join(map(str, failed[:2])) + more,
                          {"stopped": [r.to_dict() for r in results], "failed": [e.detail for e in failed]})
    return results


__all__ = ["locked", "instance_configs", "running", "resolve", "plan", "all_status", "fleet_status", "stop_all",
           "process_owners"]
