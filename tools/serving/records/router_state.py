"""The router's state file (STATE_DIR/router.json): the process to find, check and stop, and its backends."""

from __future__ import annotations

import fcntl
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

import psutil

from tools.core.errors import op
from tools.serving.config import ServeConfig
from tools.serving.records.files import flocked, holder, holder_text, stamp_holder
from tools.serving.records.state import DamagedState, InstanceBusy, ProcessRecord, read_record, write_record


SLOTS = ("blue", "green")  # the front door's builds take turns: the new one starts beside the old one


class _Held(threading.local):
    """The switch locks this thread holds (their paths): what it does under one is not refused as another's
    switch."""

    def __init__(self) -> None:
        self.paths: set[str] = set()


_HELD = _Held()


@dataclass
class Backend:  # a dataclass: the router's results (dataclasses) hold it and asdict() them
    instance: str
    base_url: str


class RouterState(ProcessRecord):
    """The router's record: its process checked as every process record is (pid, start time, own group)."""

    host: str
    port: int
    base_url: str
    policy: str
    backends: list[Backend]
    argv: list[str]
    started_at: str
    started_ts: float
    log_path: str
    # Written since the front door: how long the router holds a request while no backend answers (its retries)
    hold_s: float | None = None
    # The model names clients were given through the front door (each switch's build answers to all of them)
    names: list[str] = []


# The router's state as the caller read it (None: no router runs), or "read": read it now. One command reads it
# once and passes it on; another command or process reads its own (it may have changed the file since).
RouterRead = RouterState | None | Literal["read"]


def state_file(cfg: ServeConfig) -> Path:
    return Path(cfg.state_dir) / "router.json"


def log_file(cfg: ServeConfig) -> Path:
    return Path(cfg.state_dir) / "router.log"


def load(cfg: ServeConfig) -> RouterState | None:
    """The recorded router, None when none is; DamagedState for a file that does not hold one."""
    return read_record(state_file(cfg), RouterState)


def write(cfg: ServeConfig, st: RouterState) -> None:
    write_record(state_file(cfg), st)


def alive(st: RouterState) -> bool:
    """The recorded router process is still the one started (same pid and start time) and runs."""
    return st.leader() is not None


def group(st: RouterState) -> list[psutil.Process]:
    """Live processes of the router's group; none when the pid was recycled (its group is a stranger's)."""
    return st.group()


def recorded(cfg: ServeConfig) -> RouterState | None:
    """The router's state when its process (group) is still there; None otherwise."""
    try:
        st = load(cfg)
    except DamagedState:
        return None
    return st if st is not None and (alive(st) or group(st)) else None


def door_on_port(cfg: ServeConfig) -> RouterState | None:
    """The front door of cfg's port: a running router that listens on PORT, for the default instance. It is the
    service on that port whatever FRONT_DOOR says now (a door started under FRONT_DOOR=1 is still read, switched
    and stopped as the door after FRONT_DOOR=0 is set)."""
    if cfg.instance:
        return None
    rt = recorded(cfg)
    return rt if rt is not None and rt.port == cfg.port else None


def switch_file(cfg: ServeConfig) -> Path:
    return Path(cfg.state_dir) / "switch.lock"


@contextmanager
def switching(cfg: ServeConfig, what: str, refused: str = "another switch") -> Iterator[None]:
    """Holds the front door's switch lock (STATE_DIR/switch.lock) for the block: one switch at a time, and no
    `router stop` meanwhile. The file names the process that holds it (pid, start time, what); the kernel drops
    the lock with that process, however it ends, so a killed switch never leaves the door locked. Not waited
    for: while another process holds it, InstanceBusy names that one (and says `refused` was not done)."""
    path = switch_file(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = flocked(path)
    if fh is None:
        raise _switch_busy(cfg, path, refused)
    held = _HELD.paths
    try:
        me = psutil.Process()
        stamp_holder(fh, {"pid": me.pid, "create_time": me.create_time(), "what": what})
        held.add(str(path))
        yield
    finally:
        held.discard(str(path))
        path.unlink(missing_ok=True)  # under the lock: no switch runs, no file says one does
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def switch_running(cfg: ServeConfig) -> dict | None:
    """The switch under way (the lock file's pid, create_time, what, since), None when none is."""
    return holder(switch_file(cfg))


def refuse_while_switching(cfg: ServeConfig, what: str) -> None:
    """Refuses `what` (one line, nothing done) while a switch of the front door is under way (in another thread or
    process: this thread's own is what `what` is part of)."""
    if str(switch_file(cfg)) not in _HELD.paths and switch_running(cfg) is not None:
        raise _switch_busy(cfg, switch_file(cfg), what)


def _switch_busy(cfg: ServeConfig, path: Path, what: str = "another switch") -> InstanceBusy:
    who = holder_text(path)
    return InstanceBusy(f"the front door is being changed ({who}); {what} was not done: wait for that to end, then "
                        f"check {op('router.status')}", {"lock": str(path)})


__all__ = ["SLOTS", "Backend", "RouterRead", "RouterState", "alive", "group", "load", "log_file", "recorded",
           "refuse_while_switching", "state_file", "switch_file", "switch_running", "switching", "write"]
