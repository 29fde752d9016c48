"""The router's state file (STATE_DIR/router.json): the process to find, check and stop, and its backends."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from tools.core import process
from tools.core.errors import ToolFailure
from tools.serving.config import ServeConfig


@dataclass
class Backend:
    instance: str
    base_url: str


@dataclass
class RouterState:
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RouterState":
        d = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        d["backends"] = [Backend(**b) for b in d.get("backends", [])]
        return cls(**d)


def state_file(cfg: ServeConfig) -> Path:
    return Path(cfg.state_dir) / "router.json"


def log_file(cfg: ServeConfig) -> Path:
    return Path(cfg.state_dir) / "router.log"


def load(cfg: ServeConfig) -> RouterState | None:
    path = state_file(cfg)
    if not path.is_file():
        return None
    try:
        return RouterState.from_dict(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError) as exc:
        raise ToolFailure(f"router state file {path} is unreadable ({exc}); check no router of it runs, then "
                          "delete it")


def write(cfg: ServeConfig, st: RouterState) -> None:
    path = state_file(cfg)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(st.to_dict(), indent=2))
    os.replace(tmp, path)


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
    except ToolFailure:
        return None
    return st if st is not None and (alive(st) or group(st)) else None


__all__ = ["Backend", "RouterState", "alive", "group", "load", "log_file", "recorded", "state_file", "write"]
