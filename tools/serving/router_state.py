"""The router's state file (STATE_DIR/router.json): the process to find, check and stop, and its backends."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil

from tools.core import process
from tools.serving.config import ServeConfig
from tools.serving.state import DamagedState, Record, read_record, write_record


@dataclass
class Backend:  # a dataclass: the router's results (dataclasses) hold it and asdict() them
    instance: str
    base_url: str


class RouterState(Record):
    pid: int
    pgid: int
    create_time: float
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
    return process.same_process(st.pid, st.create_time) is not None


def group(st: RouterState) -> list[psutil.Process]:
    """Live processes of the router's group; none when the pid was recycled (its group is a stranger's)."""
    return [] if process.pid_recycled(st.pid, st.create_time) else process.group_members(st.pgid)


def recorded(cfg: ServeConfig) -> RouterState | None:
    """The router's state when its process (group) is still there; None otherwise."""
    try:
        st = load(cfg)
    except DamagedState:
        return None
    return st if st is not None and (alive(st) or group(st)) else None


__all__ = ["Backend", "RouterState", "alive", "group", "load", "log_file", "recorded", "state_file", "write"]
