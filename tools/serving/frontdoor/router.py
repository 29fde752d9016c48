"""vLLM's router (`vllm-router`, a Rust load balancer) in front of running instances, as a managed process.

Tracked like a server: its own process session and group, a state file (STATE_DIR/router.json, pid + start time)
and a log (STATE_DIR/router.log); stopped with SIGTERM to the group, SIGKILL after a grace period. It is started
only over instances that run and answer /health, and is ready when its own /health and /v1/models answer.

The API key (tools.core.api_key): the pinned vllm-router (0.1.17) checks none itself (its `--api-key` is only for
data-parallel routing, and it reads no key from its environment); it passes a client's Authorization header on to
the instance it picks, and the instances (vLLM with VLLM_API_KEY) answer /v1 only with the key. So a front door on
a non-loopback host is refused without a key (the instances behind it then have it too), the router is given no
key (neither flag nor environment), and this module's own /v1 calls through it send the key.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import psutil

from tools.core import clock
from tools.core.api_key import API_KEY_ENV, CLIENT_KEY_ENV, api_key, auth_headers, is_loopback
from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.process import end_group, free_port, port_holder
from tools.serving.server import engine_log, health
from tools.serving.records import files, placement
from tools.serving.config import ServeConfig
from tools.serving.frontdoor.door import HOLD_S, hold_args, workers
from tools.serving.records.identity import launch_env, new_launch
from tools.serving.records.state import DamagedState
from tools.serving.records.router_state import (Backend, RouterState, alive, group, load, log_file, recorded,
                                        refuse_while_switching, state_file, write)

Policy = Literal["round_robin", "cache_aware", "power_of_two", "random", "consistent_hash", "kv_aware",
                 "sticky_least_loaded"]
POLICIES: tuple[str, ...] = Policy.__args__  # type: ignore[attr-defined]
DEFAULT_ROUTER_PORT = 8100
# The router checks each build's /health every 2 s, and takes one that fails 3 checks in a row out of routing
# until it answers again: its own GET /readiness (HEALTH_PATH) then answers 503 while no build behind it answers
# (200 with at least one), the URL a load balancer in front of the door checks. Its /health answers 200 whatever.
HEALTH_ARGS = ["--health-check-interval-secs", "2", "--health-failure-threshold", "3", "--health-success-threshold",
               "1"]
HEALTH_PATH = "/readiness"


@dataclass
class RouterStatus:
    alive: bool
    healthy: bool = False
    pid: int | None = None
    base_url: str | None = None
    policy: str | None = None
    backends: list[Backend] = field(default_factory=list)
    backends_healthy: dict[str, bool] = field(default_factory=dict)  # those it routes to now: each answers?
    log_path: str | None = None
    uptime_s: float | None = None
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RouterStartResult:
    pid: int
    pgid: int
    base_url: str
    policy: str
    backends: list[Backend]
    argv: list[str]
    log_path: str
    state_file: str
    startup_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def router_binary() -> str:
    here = Path(sys.executable).parent / "vllm-router"
    found = str(here) if here.is_file() else shutil.which("vllm-router")
    if not found:
        raise ToolFailure("vllm-router is not installed; run ./setup.sh (or pip install -e '.[router]')")
    return found


def _check_request(policy: str, instances: list[str]) -> list[str]:
    if policy not in POLICIES:
        raise BadInput(f"{param('policy')} {policy!r} is not one of {', '.join(POLICIES)}", {"policy": policy},
                       field="policy")
    names = list(dict.fromkeys(instances))
    if not names:
        raise BadInput(f"{param('instances')}: name at least one running instance (e.g. a,b)", {},
                       field="instances")
    return names


def _check_key(cfg: ServeConfig, host: str, given: bool) -> None:
    """A router reachable beyond this machine only with an API key: it forwards requests unchecked, the
    instances behind it check the key."""
    if is_loopback(host) or api_key() is not None:
        return
    where = (param("host") if given else f"HOST in {cfg.env_file}" if cfg.sources.get("host") == "file"
             else "HOST")
    raise BadInput(f"{where} is {host}, reachable beyond this machine: set an API key in ${API_KEY_ENV} (the "
                   f"instances behind the router then answer only requests that send it), or route on "
                   f"HOST=127.0.0.1", {"host": host, "key_env": API_KEY_ENV}, field="host" if given else None)


def _refuse_recorded(cfg: ServeConfig) -> None:
    """Refuses a start over a live router; clears a dead one's state file."""
    old = load(cfg)
    if old is None:
        return
    if alive(old) or group(old):
        raise ToolFailure(f"a router is already running (pid {old.pid} at {old.base_url}); stop it first "
                          f"with {op('router.stop')}", {"pid": old.pid})
    state_file(cfg).unlink(missing_ok=True)


def _healthy_backends(cfg: ServeConfig, names: list[str]) -> list[Backend]:
    """The named instances as backends; refused unless each runs and answers /health."""
    backends = []
    states = {name: placement.resolve(cfg, name) for name in names}  # every name running, before any probe
    for name, st in states.items():
        if not health.answers(st.base_url):
            raise ToolFailure(f"instance {name!r} at {st.base_url} does not answer /health; check "
                              f"{op('status', instance=name)}", {"instance": name})
        backends.append(Backend(instance=st.instance or "default", base_url=st.base_url))
    return backends


def check_port(cfg: ServeConfig, host: str, port: int) -> None:
    """Refuses a port an instance or another process holds (BadInput naming `port`)."""
    taken = {n: st.port for n, st in placement.running(cfg).items()}
    if port in taken.values():
        owner = next(n for n, p in taken.items() if p == port)
        raise BadInput(f"{param('port', port)} is held by instance {owner!r}; pass another {param('port')}",
                       {"port": port}, field="port")
    holder = port_holder(host, port)
    if holder is not None:
        raise BadInput(f"{param('port', port)} on {host} is already in use by {holder}; pass another "
                       f"{param('port')}", {"port": port, "holder": holder}, field="port")


def _launch(cfg: ServeConfig, argv: list[str], host: str, port: int, policy: str,
            backends: list[Backend], hold_s: float) -> tuple[subprocess.Popen, RouterState]:
    log_path = log_file(cfg)
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, CLIENT_KEY_ENV)}  # it uses neither
    token = new_launch()
    env.update(launch_env(token))
    with files.open_log(log_path) as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(cfg.state_dir), start_new_session=True, env=env)
    try:
        create_time = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        create_time = time.time()
    now = clock.utc_now()
    st = RouterState(pid=proc.pid, pgid=proc.pid, create_time=create_time, launch=token, host=host, port=port,
                     base_url=f"http://{host}:{port}", policy=policy, backends=backends, argv=argv,
                     started_at=clock.iso(now), started_ts=now.timestamp(),
                     log_path=str(log_path), hold_s=hold_s)
    write(cfg, st)
    return proc, st


def _wait_ready(cfg: ServeConfig, proc: subprocess.Popen, st: RouterState, t0: float, timeout_s: float) -> None:
    """Waits for /health and /v1/models; on a failure or an interrupt ends the router and clears its state."""
    def fail(reason: str) -> ToolFailure:
        end_group(proc.pid, grace_s=5, leader=proc)
        state_file(cfg).unlink(missing_ok=True)
        tail = engine_log.read_text(Path(st.log_path)).strip().splitlines()[-5:]
        return ToolFailure(f"vllm-router {reason} (log: {st.log_path})", {"log_tail": tail, "argv": st.argv})

    try:
        with httpx.Client(timeout=3.0, headers=auth_headers()) as client:  # /v1 is the instances': keyed
            while True:
                code = proc.poll()
                if code is not None:
                    raise fail(f"exited with code {code} while starting")
                if time.monotonic() - t0 > timeout_s:
                    raise fail(f"did not answer /health and /v1/models within {timeout_s:g} s")
                try:
                    if (health.answers(st.base_url, client=client)
                            and client.get(f"{st.base_url}/v1/models").status_code == 200):
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
    except ToolFailure:
        raise
    except BaseException:  # interrupted or cancelled: leave no router behind
        fail("start was cancelled")
        raise


def start_router(cfg: ServeConfig, instances: list[str], *, policy: str = "round_robin", port: int | None = None,
                 host: str | None = None, timeout_s: float = 60.0, hold_s: float | None = None) -> RouterStartResult:
    """Starts vllm-router over the named running instances and waits until it answers /health and /v1/models.
    It is the front door (tools.serving.frontdoor.door): a request that finds no backend answering is held and retried
    for up to `hold_s` (default frontdoor.HOLD_S), so that a switch of the build behind it fails none.

    Refused (nothing launched, no state written) when a router runs, an instance is not running or not healthy,
    the policy is unknown or the port is taken.
    """
    names = _check_request(policy, instances)
    _check_key(cfg, host or cfg.host, host is not None)
    host = host or cfg.host
    port = port or DEFAULT_ROUTER_PORT
    with placement.locked(cfg):
        _refuse_recorded(cfg)
        backends = _healthy_backends(cfg, names)
        check_port(cfg, host, port)
        # vllm-router always serves its own metrics, on 29000 unless told: a second router would die on that port
        hold = HOLD_S if hold_s is None else hold_s
        argv = [router_binary(), "--host", host, "--port", str(port), "--policy", policy,
                "--prometheus-host", host, "--prometheus-port", str(free_port(host)), *hold_args(hold), *HEALTH_ARGS,
                "--worker-urls", *[b.base_url for b in backends]]
        t0 = time.monotonic()
        proc, st = _launch(cfg, argv, host, port, policy, backends, hold)
    _wait_ready(cfg, proc, st, t0, timeout_s)
    return RouterStartResult(pid=proc.pid, pgid=proc.pid, base_url=st.base_url, policy=policy, backends=backends,
                             argv=argv, log_path=st.log_path, state_file=str(state_file(cfg)),
                             startup_s=round(time.monotonic() - t0, 2))


def router_status(cfg: ServeConfig) -> RouterStatus:
    """Whether the router runs and answers /health, and which of its backends do; a damaged state file is
    reported as its one line."""
    try:
        st = load(cfg)
    except DamagedState as exc:
        return RouterStatus(alive=False, message=str(exc))
    if st is None:
        return RouterStatus(alive=False, message="no router running")
    if not alive(st):
        if group(st):
            return RouterStatus(alive=False, pid=st.pid, base_url=st.base_url, log_path=st.log_path,
                                message=f"router pid {st.pid} died; processes of its group remain: run "
                                        "./vllm-t4 router stop")
        state_file(cfg).unlink(missing_ok=True)
        return RouterStatus(alive=False, pid=st.pid, base_url=st.base_url, log_path=st.log_path,
                            message=f"router pid {st.pid} died; its state file was cleared")

    ok = health.answers(st.base_url)
    try:  # what the router routes to now (in a hold, none while the old build stops and the new one loads)
        live = set(workers(st))
    except (httpx.HTTPError, ValueError, AttributeError):
        live = {b.base_url for b in st.backends}
    back = {b.instance: health.answers(b.base_url) for b in st.backends if b.base_url in live}
    over = [f"{b.instance} {b.base_url}" + ("" if back[b.instance] else " (not answering)")
            for b in st.backends if b.instance in back]
    word = "routing" if ok else "running but not healthy"
    return RouterStatus(alive=True, healthy=ok, pid=st.pid, base_url=st.base_url, policy=st.policy,
                        backends=st.backends, backends_healthy=back, log_path=st.log_path,
                        uptime_s=round(time.time() - st.started_ts, 1),
                        message=f"{word}: {st.base_url} ({st.policy}) over "
                                + (", ".join(over) or f"no build (a request is held up to {st.hold_s or 0:g} s)"))


@dataclass
class RouterStopResult:
    was_running: bool
    pid: int | None = None
    signal: str | None = None
    stopped_pids: list[int] = field(default_factory=list)
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def stop_router(cfg: ServeConfig, *, grace_s: float = 10) -> RouterStopResult:
    """SIGTERM to the router's group, SIGKILL after grace_s; idempotent. Raises if a process remains. Refused
    (InstanceBusy, nothing done) while a switch of the front door is under way."""
    refuse_while_switching(cfg, "the router's stop")
    st = load(cfg)
    if st is None:
        return RouterStopResult(was_running=False, message="no router recorded")
    members = group(st)
    if not members:
        state_file(cfg).unlink(missing_ok=True)
        return RouterStopResult(was_running=False, pid=st.pid,
                                message=f"router pid {st.pid} was no longer running; its state file was cleared")
    last, pids, remaining = end_group(st.pgid, grace_s, leader=st.pid if alive(st) else None)
    if remaining:
        raise ToolFailure(f"processes {remaining} of the router's group {st.pgid} survived SIGKILL; end them by "
                          "hand", {"remaining": remaining})
    state_file(cfg).unlink(missing_ok=True)
    return RouterStopResult(was_running=True, pid=st.pid, signal=last, stopped_pids=pids,
                            message=f"stopped the router (pid {st.pid}, {last})")


__all__ = ["DEFAULT_ROUTER_PORT", "POLICIES", "Backend", "Policy", "RouterStartResult", "RouterState", "RouterStatus",
           "RouterStopResult", "log_file", "recorded", "router_binary", "router_status",
           "start_router", "state_file", "stop_router"]
