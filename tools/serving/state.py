"""A tracked server's state file (STATE_DIR[/NAME]/vllm.json): what a later command needs to find, check and stop
the server, and whether the processes it names are still the server's."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from tools.core import process
from tools.core.errors import ToolFailure
from tools.serving.config import ServeConfig

STATE_VERSION = 1


@dataclass
class ServerState:
    """The state file: what a later command needs to find, check and stop the server."""

    pid: int
    pgid: int
    create_time: float          # of the leader process: guards against a recycled pid
    host: str
    port: int
    base_url: str
    model: str
    served_name: str
    argv: list[str]
    platform: str
    started_at: str             # ISO 8601, UTC
    started_ts: float
    log_path: str
    version: int = STATE_VERSION
    # Written since named instances: what the next start must not take again (older files lack them).
    instance: str = ""
    gpus: list[int] | None = None               # CUDA devices (None: the first visible, or all with TP/DP)
    gpu_memory_utilization: float | None = None
    cpu_cores: list[list[int]] | None = None    # CPU cores per rank; None on the CPU: unbound (every core)
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_state(cfg: ServeConfig) -> ServerState | None:
    """The instance's recorded server, None when none is recorded; ToolFailure for a file that does not parse."""
    path = cfg.state_file
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return ServerState(**{k: data[k] for k in ServerState.__dataclass_fields__ if k in data})
    except (ValueError, TypeError, KeyError) as exc:
        raise ToolFailure(f"state file {path} is unreadable ({exc}); check no server of it runs, then delete it")


def write_state(cfg: ServeConfig, state: ServerState) -> None:
    path = cfg.state_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state.to_dict(), indent=2))
    os.replace(tmp, path)  # never a half-written state file


def clear_state(cfg: ServeConfig) -> None:
    cfg.state_file.unlink(missing_ok=True)


def leader(state: ServerState) -> psutil.Process | None:
    """The server's leader process if it is still the one we started (same pid AND creation time)."""
    return process.same_process(state.pid, state.create_time)


def pid_recycled(state: ServerState) -> bool:
    """True when another process now has the server's pid: nothing of that group may be signalled."""
    return process.pid_recycled(state.pid, state.create_time)


def our_group(state: ServerState) -> list[psutil.Process]:
    """Live processes of the server's group, or none when the pid was recycled."""
    return [] if pid_recycled(state) else process.group_members(state.pgid)


__all__ = ["STATE_VERSION", "ServerState", "clear_state", "leader", "load_state", "our_group", "pid_recycled",
           "write_state"]
