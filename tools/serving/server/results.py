"""What the serving operations return: a start, a stop, a status, a query."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tools.gpu.vram import HostMemory
from tools.serving.server.engine_log import EngineStartFields
from tools.serving.preflight.hardware import Vram


@dataclass
class StartResult:
    pid: int
    pgid: int
    base_url: str
    model: str
    served_name: str
    platform: str
    argv: list[str]
    log_path: str
    state_file: str
    startup_s: float
    first_completion: str
    start_fields: EngineStartFields
    max_model_len: int | None = None
    max_model_len_note: str | None = None   # set when tpu.env's MAX_MODEL_LEN was above the model's limit
    # The server's processes' host memory after load, on every platform (start_fields has the GPU's figures)
    host_memory: HostMemory | None = None
    note: str | None = None              # what an unfinished replace of this instance had done
    # replace=true: "serving NAME" (a plain start when nothing served) and the server it replaced
    outcome: str | None = None
    replaced: dict[str, Any] | None = None
    # FRONT_DOOR=1: base_url is the front door's; this names it and the build's own (instance, backend_url, pid)
    front_door: dict[str, Any] | None = None
    # The start's checks that warn (preflight's lines): it serves, and this says what it may not do as checked
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["start_fields"] = self.start_fields.to_dict()
        d["host_memory"] = self.host_memory.model_dump() if self.host_memory else None
        return d


@dataclass
class StopResult:
    was_running: bool
    pid: int | None = None
    signal: str | None = None          # the last signal needed: SIGTERM, or SIGKILL after the grace period
    stopped_pids: list[int] = field(default_factory=list)
    remaining_pids: list[int] = field(default_factory=list)
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ServerStatus:
    alive: bool
    instance: str = "default"
    pid: int | None = None
    uptime_s: float | None = None
    healthy: bool = False
    model: str | None = None
    served_name: str | None = None
    base_url: str | None = None
    argv: list[str] | None = None
    platform: str | None = None
    start_fields: EngineStartFields | None = None
    log_path: str | None = None
    vram: Vram | None = None
    # The served model's memory as vram_status reads it: VRAM of its processes on a GPU, host RSS/PSS on a CPU;
    # `method` says which and how.
    memory: dict[str, Any] | None = None
    died: bool = False                 # a state file was left by a server that is gone
    leftover_pids: list[int] = field(default_factory=list)
    gpus: list[int] | None = None
    cpu_cores: list[list[int]] | None = None
    kv_cache_tokens: int | None = None
    message: str = ""
    # a replace of this instance in progress or left unfinished; with the front door, its switch under way
    # (the switch lock's pid, what, since, and running: true)
    replace: dict[str, Any] | None = None
    last_switch: dict[str, Any] | None = None  # the last switch (replace=true) and how it ended
    # `status` without an instance: the fields above describe the default instance, these every instance
    instances: list["ServerStatus"] | None = None
    router: dict[str, Any] | None = None
    all_healthy: bool | None = None    # every instance (and router) reported is alive and answers /health
    # The servers of STATE_DIR that no readable record names (a damaged or deleted record): pid, folder, ports,
    # command; never signalled
    unrecorded: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["start_fields"] = self.start_fields.to_dict() if self.start_fields else None
        d["vram"] = self.vram.to_dict() if self.vram else None
        if self.instances is not None:
            d["instances"] = [i.to_dict() for i in self.instances]
        return d


@dataclass
class QueryResult:
    text: str
    usage: dict[str, Any]
    model: str
    finish_reason: str | None
    token_ids: list[int] | None
    latency_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["QueryResult", "ServerStatus", "StartResult", "StopResult"]
