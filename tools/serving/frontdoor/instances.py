"""Every instance at once: their status with the router's, and stopping them all (router first).

Which instances run and what a new start may take (ports, cores, GPU shares) is tools.serving.records.placement; its
names are offered here too, where the instance commands have always found them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.serving.frontdoor import router
from tools.serving.records import files, router_state, state
from tools.serving.server import switch_record
from tools.serving.config import INSTANCE_NAME, ServeConfig
from tools.serving.records.placement import instance_configs, locked, plan, process_owners, resolve, running
from tools.serving.server.server import Server, stop_each


def all_status(cfg: ServeConfig, *, hardware: Any = None) -> list[Any]:
    """ServerStatus of the default instance (when recorded) and every named instance."""
    out = []
    for c in instance_configs(cfg):
        if not c.instance and not files.present(c.state_file):
            continue
        out.append(Server(c, hardware=hardware).status())
    return out


def fleet_status(cfg: ServeConfig, *, hardware: Any = None) -> Any:
    """The default instance's ServerStatus (as before instances) with the named instances and the router listed
    (the default instance is the top level, not listed again); all_healthy only when at least one is reported
    and each reported one answers /health."""
    default_cfg = replace(cfg, instance="")
    had_default = files.present(default_cfg.state_file) or files.present(state.replace_file(default_cfg))
    top = Server(default_cfg, hardware=hardware).status()
    listed = [Server(c, hardware=hardware).status() for c in _configs_with_a_replace(cfg)[1:]]
    r = router.router_status(cfg) if files.present(router.state_file(cfg)) else None
    top.instances = listed
    top.router = r.to_dict() if r is not None else None
    reported = ([top] if had_default else []) + listed
    healthy = [i.alive and i.healthy for i in reported] + ([r.alive and r.healthy] if r is not None else [])
    top.all_healthy = bool(healthy) and all(healthy)
    door_up = router_state.door_on_port(default_cfg) is not None and r is not None and r.alive and not had_default
    if door_up:
        # the default service is the door: alive while it runs, healthy while it answers through a build
        behind = [i for i in listed if i.instance in r.backends_healthy]
        serving = [i for i in behind if i.alive and i.healthy]
        top.alive, top.healthy, top.base_url = True, r.healthy and bool(serving), r.base_url
        top.pid, top.uptime_s = r.pid, r.uptime_s  # the service's process is the door's
        if serving:
            top.served_name, top.model = serving[0].served_name, serving[0].model
        top.message = (f"the front door at {r.base_url} {'answers' if r.healthy else 'does not answer'}, over "
                       + (", ".join(f"{i.served_name or 'an unreadable record'} (instance {i.instance}, "
                                    f"{'serving' if i.alive and i.healthy else 'down'})" for i in behind)
                          or "no build"))
        top.all_healthy = r.healthy and bool(behind) and all(i.alive and i.healthy for i in behind)
    elif listed and not had_default:
        top.message = f"{len(listed)} named instance(s); the default instance is not running"
    if (listed or door_up) and not had_default:
        last = switch_record.load_switch(default_cfg)  # the front door's last switch is recorded there
        if last is not None:
            serving = top.healthy or any(i.alive and i.healthy for i in listed)
            top.message += f"; {switch_record.describe(last, serving_now=serving)}"
    switching = router_state.switch_running(default_cfg)
    if switching is not None:
        top.replace = {**switching, "running": True}
        top.message += f"; a switch of the front door runs ({files.holder_text(router_state.switch_file(cfg))})"
    damaged = [c.instance_name for c in _configs_with_a_replace(cfg) if _damaged(c)]
    if damaged:  # anywhere in STATE_DIR, behind the door or not: what it names is not known to be well
        top.all_healthy = False
        top.message += f"; the record of instance {', '.join(damaged)} is damaged (its line says how to clear it)"
    left = state.unrecorded(cfg.state_dir)
    if left:
        top.unrecorded = [u._asdict() for u in left]
        top.all_healthy = False
        top.message += "; " + "; ".join(u.line() for u in left)
    return top


def _damaged(cfg: ServeConfig) -> bool:
    try:
        state.load_state(cfg)
        state.load_replace(cfg)
    except state.DamagedState:
        return True
    return False


def _configs_with_a_replace(cfg: ServeConfig) -> list[ServeConfig]:
    """instance_configs, and the named instances with only a replace record (their A stopped, no B recorded)."""
    configs = instance_configs(cfg)
    names = {c.instance for c in configs}
    root = Path(cfg.state_dir)
    extra = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name not in names
                   and files.present(d / "replace.json")) if root.is_dir() else []
    configs += [replace(cfg, instance=n) for n in extra if INSTANCE_NAME.fullmatch(n)]
    return configs[:1] + sorted(configs[1:], key=lambda c: c.instance)


def stop_all(cfg: ServeConfig, *, grace_s: float = 20) -> list[Any]:
    """Stops the router first (it would route to stopped servers), then every instance. One that cannot be
    stopped (a damaged state file, whose processes are not signalled; a process that survives SIGKILL) does not
    keep the others running: they are stopped, then one ToolFailure names what was not, and each server of
    STATE_DIR no readable record names, with what was stopped in its detail (vllm_server.stop_each)."""
    steps = [lambda: router.stop_router(cfg, grace_s=grace_s)]
    steps += [lambda c=c: Server(c).stop(grace_s=grace_s) for c in _configs_with_a_replace(cfg)
              if files.present(c.state_file) or files.present(state.replace_file(c))]
    return stop_each(cfg, steps, None)


__all__ = ["locked", "instance_configs", "running", "resolve", "plan", "all_status", "fleet_status", "stop_all",
           "process_owners"]
