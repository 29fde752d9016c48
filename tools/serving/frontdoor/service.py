"""The service on the port clients are told to use (tpu.env's HOST:PORT), as `./vllm-t4 start|stop` and MCP's
start_vllm_server/stop_vllm_server run it for the default instance.

With FRONT_DOOR=1 (tpu.env as shipped) that port is vllm-router's (tools.serving.frontdoor.door) and the build serves
behind it as a named instance on an internal port, `blue` or `green`, whichever is free: a start launches the build,
then the router over it; `start --replace` (replace=true) is a front-door switch to the other slot, run in a
process of its own (tools.serving.frontdoor.switch_process), so that no request fails; `stop` ends the router and the builds
behind it. With FRONT_DOOR=0, or for a named instance, the build serves on the port itself as before, and a
replace leaves the port dead while the new build loads (tools.serving.server.replace). A default instance that already
serves on the port without the front door (started with FRONT_DOOR=0) is replaced that way too, and the result
says so.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from typing import Any

import httpx

from tools.core.api_key import API_KEY_ENV, api_key, auth_headers
from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.process import free_port, signals_deferred
from tools.core.progress import Progress
from tools.serving.frontdoor import door as frontdoor, switch_process
from tools.serving.records import placement, router_state
from tools.serving.records.router_state import RouterRead
from tools.serving.server import switch_record
from tools.serving.config import ServeConfig
from tools.serving.frontdoor.door import SwitchResult
from tools.serving.preflight.hardware import Hardware
from tools.serving.server.results import StartResult
from tools.serving.server.replace import replace_server
from tools.serving.frontdoor.router import check_port, start_router, stop_router
from tools.serving.records.files import holder, holder_text
from tools.serving.records.state import DamagedState, InstanceBusy, instance_lock, load_state, lock_file
from tools.serving.server.server import Server, stop_each

SLOTS = router_state.SLOTS


def behind_door(cfg: ServeConfig, rt: RouterRead = "read") -> bool:
    """Whether this config's start, stop and status go through the front door: the default instance, with
    FRONT_DOOR=1 or a door running on its port (started before FRONT_DOOR=0 was set). `rt`: the front door as
    this command read it (door(cfg)), or "read": read it now."""
    if cfg.instance or cfg.front_door:
        return not cfg.instance
    on_port = router_state.door_on_port(cfg) if isinstance(rt, str) else rt
    return on_port is not None and on_port.port == cfg.port


def door(cfg: ServeConfig) -> router_state.RouterState | None:
    """The front door (the router's recorded state) when it runs."""
    return router_state.recorded(replace(cfg, instance=""))


def _slot(cfg: ServeConfig, rt: router_state.RouterState | None) -> str:
    behind = {b.instance for b in (rt.backends if rt else [])}
    taken = set(placement.running(cfg)) | behind
    free = [s for s in SLOTS if s not in taken]
    if not free:
        outside = [s for s in SLOTS if s not in behind]
        raise ToolFailure(f"instances {' and '.join(SLOTS)} both run and the front door's next build needs one of "
                          f"them; {outside[0]} is not behind the front door: stop it with "
                          f"{op('stop', instance=outside[0])}", {"running": sorted(taken), "behind": sorted(behind)})
    return free[0]


def _live_backends(cfg: ServeConfig, rt: router_state.RouterState) -> list[str]:
    alive = placement.running(cfg)
    return [b.instance for b in rt.backends if b.instance in alive]


def _refuse_door_build(cfg: ServeConfig, what: str) -> None:
    """A named instance that serves behind the front door is changed through the door, not by its name."""
    if not cfg.front_door or not cfg.instance or cfg.instance not in SLOTS:
        return
    rt = door(cfg)
    if rt is not None and cfg.instance in {b.instance for b in rt.backends}:
        raise BadInput(f"{param('instance', cfg.instance)} serves behind the front door at {rt.base_url}: "
                       f"{what} it through the door, {op('start', replace=True) if what == 'replace' else op('stop')} "
                       "without an instance", {"instance": cfg.instance}, field="instance")


def build_config(cfg: ServeConfig, rt: router_state.RouterState | None) -> ServeConfig:
    """The config of the build that serves behind the front door next: a free slot, an internal port."""
    return replace(cfg, instance=_slot(cfg, rt), port=free_port(cfg.host), served_aliases=[], door_port=cfg.port)


def start(cfg: ServeConfig, *, replace_running: bool = False, progress: Progress | None = None,
          hardware: Hardware | None = None, new_key: bool = False,
          rt: RouterRead = "read") -> StartResult | SwitchResult:
    """Serves cfg's build on the port clients use: through the front door when behind_door(cfg) (a
    SwitchResult when it replaced a build there), else on the port itself. Owned until ready: a command or MCP
    server that is gone before then (even by SIGKILL) takes the starting server with it; a front-door switch
    runs in a process of its own and ends alone. A switch that would change the API key clients must send (this
    command's VLLM_API_KEY is not the one the serving build answers to) is refused unless `new_key`. `rt`: the
    front door as this command read it just before (door(cfg)); "read": read it now, once for the whole start."""
    if replace_running:
        _refuse_door_build(cfg, "replace")
    if isinstance(rt, str):
        rt = None if cfg.instance else door(cfg)
    if not behind_door(cfg, rt):
        if not replace_running:
            return Server(cfg, hardware=hardware).start(progress=progress)
        with Server(cfg).guarded():
            return replace_server(cfg, progress=progress, hardware=hardware)
    if rt is None and replace_running and placement.running(cfg).get("default") is not None:
        # served on the port itself, from before the front door: replaced as it was started
        with Server(cfg).guarded():
            res = replace_server(cfg, progress=progress, hardware=hardware)
        return replace(res, note="; ".join(filter(None, [res.note, (
            "served without the front door (it was started with FRONT_DOOR=0): the port was dead while this "
            f"loaded; {op('stop')} and {op('start')} move it behind the front door")])))
    if rt is not None:
        router_state.refuse_while_switching(cfg, "this start")  # before a slot is chosen: the switch holds one
        if not _live_backends(cfg, rt):  # the door answers, nothing behind it: this build is put behind it
            return _refill(cfg, rt, progress, hardware)
        if not replace_running:
            raise ToolFailure(f"the front door at {rt.base_url} already serves {_serving(rt)}; switch builds with "
                              f"{op('start', replace=True)}, or stop it with {op('stop')}", {"base_url": rt.base_url})
        if cfg.given_for_this_start("port") and cfg.port != rt.port:
            raise BadInput(f"{param('port', cfg.port)}: the front door keeps its port {rt.port} across a switch; "
                           f"leave {param('port')} out", {"port": cfg.port}, field="port")
        if not new_key:
            _refuse_key_change(rt)
        return switch_process.switch(cfg, build_config(cfg, rt), progress=progress)
    return _open(cfg, progress, hardware)


def _refuse_key_change(rt: router_state.RouterState) -> None:
    """Refuses a switch whose build would answer to another key than the serving one (BadInput naming
    VLLM_API_KEY): asked with this command's key, the serving build answers 401 when its key is another; asked
    with none, it answers while this command has one (clients send none, and the new build would refuse them)."""
    url = rt.backends[-1].base_url
    try:
        with_ours = httpx.get(f"{url}/v1/models", headers=auth_headers(), timeout=10.0).status_code
        without = httpx.get(f"{url}/v1/models", timeout=10.0).status_code if api_key() else 401
    except httpx.HTTPError:
        return  # the build does not answer now: the switch's own checks say what runs
    if with_ours == 401 or without == 200:
        how = ("is not the key the serving build answers to" if with_ours == 401 else
               "is set, and the serving build answers without a key")
        raise BadInput(f"${API_KEY_ENV} {how}: after this switch every client still sending the old one would be "
                       f"refused (HTTP 401); switch with the serving build's {API_KEY_ENV}, or pass "
                       f"{param('new_key', True)} to change the key clients send", {"key_env": API_KEY_ENV},
                       field="new_key")


def _refill(cfg: ServeConfig, rt: router_state.RouterState, progress: Progress | None,
            hardware: Hardware | None) -> StartResult:
    """A front door whose builds are all gone (a switch that ended with nothing serving, a build stopped or
    killed): the new build starts in a free slot and the door routes to it alone; requests held meanwhile."""
    with router_state.switching(cfg, f"start of {cfg.served_name} behind the front door", "this start"):
        b = build_config(cfg, router_state.RouterState.model_validate({**rt.model_dump(), "backends": []}))
        res = Server(replace(b, served_aliases=[n for n in rt.names if n != b.served_name]),
                     hardware=hardware).start(progress=progress)
        try:
            for url in frontdoor.workers(rt):
                frontdoor.remove_worker(rt, url)
            frontdoor.add_worker(rt, res.base_url)
        except BaseException:
            with signals_deferred():
                Server(b).stop(grace_s=5)
            raise
        router_state.write(cfg, rt.model_copy(update={
            "backends": [router_state.Backend(instance=b.instance, base_url=res.base_url)],
            "names": list(dict.fromkeys([*rt.names, cfg.served_name]))}))
    return _through(res, rt.base_url, rt.pid, b.instance, rt.hold_s)


def _open(cfg: ServeConfig, progress: Progress | None, hardware: Hardware | None) -> StartResult:
    """The build on an internal port, then the router on the port clients use, over it."""
    # Under the door's switch lock from the first check: a start that loses a race to another is refused naming
    # the winner, never told that the winner's build, still starting, was left by a door that is gone.
    with router_state.switching(cfg, f"start of the front door with {cfg.served_name}", "this start"):
        router_state.load(cfg)  # a damaged record (DamagedState) refuses now, not once a build has loaded
        alive = placement.running(cfg)
        orphans = [s for s in SLOTS if s in alive and alive[s].door_port == cfg.port]
        for s in orphans:  # a stop (or another command) ending it now: wait for that, then start
            lock = lock_file(replace(cfg, instance=s))
            if holder(lock) is not None:
                raise InstanceBusy(f"instance {s} ({alive[s].served_name}) of the front door is being changed by "
                                   f"another command ({holder_text(lock)}); nothing was done: wait for it to end, "
                                   f"then {op('start')}", {"instance": s, "lock": str(lock)})
        if orphans:  # a door that is gone left its builds: they would hold the cores the new one needs
            names = ", ".join(alive[s].served_name for s in orphans)
            raise ToolFailure(f"instance {' and '.join(orphans)} ({names}) still runs without the front door (its "
                              f"router is gone): {op('stop')} ends it, then {op('start')}", {"running": orphans})
        # before anything starts: the door's port (after the builds a door that is gone left, the likelier cause
        # of a refusal, whose port may be a moment from free while its router dies)
        check_port(cfg, cfg.host, cfg.port)
        b = build_config(cfg, None)
        build = Server(b, hardware=hardware)
        with build.guarded():
            res = build.start(progress=progress)
            try:
                rt = start_router(cfg, [b.instance], port=cfg.port, hold_s=cfg.front_door_hold_s)
            except BaseException:
                with signals_deferred():  # no build left serving beside a door that did not open
                    build.stop(grace_s=5)
                raise
        # the name clients are given: every build switched in later answers to it too
        router_state.write(cfg, router_state.load(cfg).model_copy(update={"names": [b.served_name]}))
        switch_record.switch_file(replace(cfg, instance="")).unlink(missing_ok=True)  # a switch of an earlier door
    return _through(res, rt.base_url, rt.pid, b.instance, cfg.front_door_hold_s)


def _through(res: StartResult, door_url: str, door_pid: int, instance: str, hold_s: float | None) -> StartResult:
    """The build's start result as clients see it: the front door's URL, the build's own named beside it."""
    return replace(res, base_url=door_url, front_door={"base_url": door_url, "pid": door_pid, "instance": instance,
                                                       "backend_url": res.base_url, "hold_s": hold_s})


def _serving(rt: router_state.RouterState) -> str:
    return ", ".join(f"instance {b.instance} ({b.base_url})" for b in rt.backends) or "no build"


def stop(cfg: ServeConfig, *, grace_s: float = 20.0) -> list[Any]:
    """Stops the service on the port: the front door and the builds behind it (and any build a door that is gone
    left in its slots: one whose record names the door's port, never a user's own instance of that name), else the
    server itself; each stop's result (a StopResult, the router's RouterStopResult first). Refused while a switch
    or a front-door start runs. What it cannot prove is the project's (a damaged record, a server no readable
    record names) is not signalled: once the rest is stopped, one ToolFailure names each such thing and how to end
    it, with what was stopped in its detail."""
    _refuse_door_build(cfg, "stop")
    if not behind_door(cfg):
        return stop_each(cfg, [lambda: Server(cfg).stop(grace_s=grace_s)], [cfg.instance_dir])
    # Under the door's switch lock, and each build's own lock taken before anything stops: a second stop, a switch
    # or a start meanwhile is refused, and a lock that cannot be taken (a folder in its place) stops nothing.
    with router_state.switching(cfg, "stop of the front door", "this stop"), ExitStack() as held:
        try:
            rt = router_state.load(cfg)
        except DamagedState as exc:
            rt, damaged = None, exc
        else:
            damaged = None
        steps: list[Any] = [lambda: stop_router(cfg, grace_s=grace_s)] if rt is not None else []
        if damaged is not None:
            steps.append(lambda: _raise(damaged))
        behind = [b.instance for b in (rt.backends if rt else [])]
        for name in dict.fromkeys([*behind, *SLOTS]):
            one = replace(cfg, instance="" if name == "default" else name)
            if one.state_file.exists() and (name in behind or _door_build(one, cfg.port)):
                held.enter_context(instance_lock(one, "stop of the front door"))
                steps.append(lambda one=one: Server(one).stop(grace_s=grace_s))
        if not steps:
            steps.append(lambda: Server(cfg).stop(grace_s=grace_s))
        return stop_each(cfg, steps, [cfg.instance_dir, *(replace(cfg, instance=n).instance_dir for n in SLOTS)])


def _raise(exc: Exception) -> Any:
    raise exc


def _door_build(one: ServeConfig, door_port: int) -> bool:
    """A slot's recorded build was started behind the front door of `door_port` (a damaged record counts: stop
    then reports it rather than pass it by)."""
    try:
        st = load_state(one)
    except DamagedState:
        return True
    return st is not None and st.door_port == door_port


def describe(res: StartResult | SwitchResult) -> str:
    """One line for either result of start."""
    if isinstance(res, SwitchResult):
        f = res.figures
        return (f"{res.outcome} at {res.base_url} in place of {res.replaced} ({res.mode}, {res.wall_s:.0f} s): "
                f"{f.requests if f.requests is not None else '?'} requests through the front door, "
                f"{f.failed if f.failed is not None else '?'} failed, longest wait for a build "
                f"{f.longest_wait_s:g} s" + (f"; builds: {res.replaced_model} -> {res.model}" if res.model else ""))
    line = f"Serving at {res.base_url} (pid {res.pid}), model {res.served_name}, ready in {res.startup_s:g} s"
    if res.front_door:
        fd = res.front_door
        line = (f"Serving at {res.base_url} (the front door, pid {fd['pid']}), model {res.served_name} on "
                f"instance {fd['instance']} at {fd['backend_url']} (pid {res.pid}), ready in {res.startup_s:g} s")
    if res.replaced:
        line += f", in place of {res.replaced['served_name']} ({res.replaced['model']})"
    return line


__all__ = ["SLOTS", "behind_door", "build_config", "describe", "door", "start", "stop"]
