"""A tracked server's state file (STATE_DIR[/NAME]/vllm.json): what a later command needs to find, check and stop
the server, and whether the processes it names are still the server's."""

from __future__ import annotations

import fcntl
import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Iterator, NamedTuple, TypeVar

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tools.core import process
from tools.core.atomic_files import write_file
from tools.core.errors import ToolFailure, op
from tools.serving.config import ServeConfig
from tools.serving.records.files import RECORD_MAX_BYTES, flocked, holder_text, read_small, stamp_holder
from tools.serving.records.identity import carried_by, carries, lacks, launched

STATE_VERSION = 1
class DamagedState(ToolFailure):
    """A state file that exists but does not hold its record; nothing it may name is signalled."""


class Record(BaseModel):
    """A state file's record: fields a newer version adds are ignored by an older one, and a missing or
    mistyped field makes the file damaged."""

    model_config = ConfigDict(extra="ignore")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


R = TypeVar("R", bound=Record)


def read_record(path: Path, model: type[R]) -> R | None:
    """THE reader of a state file: its record, None when there is no file, DamagedState (one line naming the file
    and the field) when it does not hold one."""
    try:
        text = read_small(path)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise _damaged(path, f"cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if text is None:
        raise _damaged(path, f"not a regular file of at most {RECORD_MAX_BYTES} bytes")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _damaged(path, f"not JSON: {str(exc)[:80]}") from None
    if not isinstance(data, dict):
        raise _damaged(path, f"a JSON {type(data).__name__} where an object is wanted")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(x) for x in err["loc"])
        # a check of the whole record (its group, owner, launch token) names no field: its own words say it
        msg = err["msg"].removeprefix("Value error, ")
        raise _damaged(path, f"field {field!r}: {msg[:1].lower()}{msg[1:]}" if field else msg, field or None) \
            from None


# Linux's largest pid (PID_MAX_LIMIT): a record's pid beyond it, or below 1, names no process.
PID_MAX = 1 << 22
Pid = Annotated[int, Field(ge=1, le=PID_MAX)]
# A process's start (seconds since 1970): NaN would match every live pid's (no difference from it exceeds a bound)
StartTime = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def _damaged(path: Path, why: str, field: str | None = None) -> DamagedState:
    return DamagedState(f"state file {path} is damaged ({why}); no process it may name was signalled: check with "
                        f"ps that none of it runs, then delete the file", {"path": str(path), "field": field})


def write_record(path: Path, record: Record) -> None:
    """Written whole or not at all: never a half-written state file."""
    write_file(path, json.dumps(record.to_dict(), indent=2))


class ProcessRecord(Record):
    """What every record of a process the project started holds, checked the same way for each kind (a server's,
    the router's): the leader's pid, its start time (against a recycled pid), its process group, which is its own
    (every such process is started as the leader of its own session, pgid == pid), its owner, this user, and its
    identity: a live leader carries the record's launch token in its environment (LAUNCH_ENV). A record naming
    another group, another user's process or a process the project did not launch for it would have stop signal
    processes that are not the project's."""

    pid: Pid
    pgid: Pid
    create_time: StartTime      # of the leader process: guards against a recycled pid
    launch: str = ""            # the launch token (LAUNCH_ENV); records written before it have none

    @model_validator(mode="after")
    def _own_group(self) -> "ProcessRecord":
        if self.pgid != self.pid:
            raise ValueError(f"pgid {self.pgid} is not the process's own group (pid {self.pid})")
        # Ownership: a live process of the record (same pid and start time) runs as this user, as everything the
        # project starts does; another user's is no server of ours to signal.
        proc = self.leader()
        try:
            uid = proc.uids().real if proc is not None else os.getuid()
        except psutil.Error:
            uid = os.getuid()
        if uid != os.getuid():
            raise ValueError(f"pid {self.pid} runs as another user (uid {uid}), not as this project's processes do")
        if proc is not None and lacks(proc, self.launch):
            raise ValueError(f"pid {self.pid} ({_name(proc)}) is not the process launched for this record (its "
                             "environment lacks the record's launch token)")
        return self

    def leader(self) -> psutil.Process | None:
        """The leader process if it is still the one started and runs: same pid and creation time, or, for a
        record with a launch token, the same pid carrying that token. The token decides where both are known:
        psutil derives a start time from the wall clock's boot time, which moves when the clock is stepped."""
        proc = process.same_process(self.pid, self.create_time)
        if proc is None and self.launch:
            proc = carried_by(self.pid, self.launch)
        return proc

    def recycled(self) -> bool:
        """Another process now has the record's pid: nothing of that group may be signalled."""
        return self.leader() is None and process.pid_recycled(self.pid, self.create_time)

    def group(self) -> list[psutil.Process]:
        """Live processes of the group; none when the pid was recycled (the group of that number is a
        stranger's). With the leader gone, only those that carry the record's launch token (what the leader started
        inherits it): a dead pid's group may be a stranger's whose leader exited."""
        if self.recycled():
            return []
        members = process.group_members(self.pgid)
        if self.leader() is not None:
            return members
        return [p for p in members if carries(p, self.launch)]


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()[:2])[:60] or proc.name()
    except (psutil.Error, OSError):
        return "?"


class ServerState(ProcessRecord):
    """The state file: what a later command needs to find, check and stop the server."""

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
    # Written since replace: the environment vLLM was launched with (what of it is vLLM's, CUDA's or OpenMP's,
    # and the server's own variables; no tokens), so that a failed replace relaunches this server as it was.
    env: dict[str, str] | None = None
    # Written since the front door: seconds from launch to ready, as this start measured them (None until
    # ready): how long a build takes to start on this machine, the wait a switch that stops it first announces.
    startup_s: float | None = None
    # Written since stop tells the front door's builds from a user's own instance of the same name: the port of
    # the front door this build was started behind (None: a build started by its name, not the door's).
    door_port: int | None = None


class ReplaceRecord(Record):
    """A replace in progress (STATE_DIR[/NAME]/replace.json): which server it stopped, so that a replace killed
    between stopping A and B's readiness leaves what is needed to say so and to bring A back."""

    owner_pid: Pid
    owner_create_time: StartTime
    started_at: str             # ISO 8601, UTC
    phase: str                  # "stopping A", "starting B", "restoring A", "failed" (neither serves)
    a: ServerState              # A's record as it was before the stop: its command line and environment
    b_model: str
    b_served_name: str


def load_state(cfg: ServeConfig) -> ServerState | None:
    """The instance's recorded server, None when none is recorded; DamagedState for a file that does not hold
    one."""
    return read_record(cfg.state_file, ServerState)


def write_state(cfg: ServeConfig, state: ServerState) -> None:
    write_record(cfg.state_file, state)


def clear_state(cfg: ServeConfig, own: ServerState) -> bool:
    """Removes the state file while it still records `own` (same pid and start time): a record another command
    wrote since names a server that is not this command's to forget. True when removed."""
    try:
        now = load_state(cfg)
    except DamagedState:
        return False
    if now is None or now.pid != own.pid or now.create_time != own.create_time:
        return False
    cfg.state_file.unlink(missing_ok=True)
    return True


class InstanceBusy(ToolFailure):
    """Another command (or another call of this process) is changing the instance: nothing was done."""


class _Held:
    def __init__(self) -> None:
        self.rlock = threading.RLock()  # one thread of this process at a time; reentrant for a replace's steps
        self.depth = 0
        self.fh: Any = None


_HELD: dict[str, _Held] = {}
_HELD_GUARD = threading.Lock()


def lock_file(cfg: ServeConfig) -> Path:
    return cfg.instance_dir / "vllm.lock"


@contextmanager
def instance_lock(cfg: ServeConfig, what: str) -> Iterator[None]:
    """Holds the instance's lock (vllm.lock beside its state file) for a command that changes the instance: start,
    stop, replace and its rollback. Not waited for: while another command holds it, InstanceBusy names that
    command (one winner, never two changes interleaved). Reentrant in the thread that holds it (a replace stops
    A, starts B and may start A again under one hold)."""
    path = lock_file(cfg)
    with _HELD_GUARD:
        held = _HELD.setdefault(str(path), _Held())
    if not held.rlock.acquire(blocking=False):
        raise _busy(cfg, path, "another call of this server")
    try:
        if held.depth == 0:
            fh = _take(cfg, path)
            stamp_holder(fh, {"pid": os.getpid(), "what": what})
            held.fh = fh
        held.depth += 1
        try:
            yield
        finally:
            held.depth -= 1
            if held.depth == 0:
                fh, held.fh = held.fh, None
                _tidy(cfg, path)
                fcntl.flock(fh, fcntl.LOCK_UN)
                fh.close()
    finally:
        held.rlock.release()


def _take(cfg: ServeConfig, path: Path) -> Any:
    """The instance's lock file, open and flocked; InstanceBusy when another process holds it."""
    created = not cfg.instance_dir.exists()
    cfg.instance_dir.mkdir(parents=True, exist_ok=True)
    fh = flocked(path)
    if fh is None:
        if created:
            _remove_empty(cfg)
        raise _busy(cfg, path, None)
    return fh


def _tidy(cfg: ServeConfig, path: Path) -> None:
    """On release, with the lock still held: an instance that records nothing keeps no lock file (and a named
    one no folder of its own), so a refused or finished command leaves what it found."""
    if cfg.state_file.exists() or replace_file(cfg).exists():
        return
    path.unlink(missing_ok=True)
    _remove_empty(cfg)


def _remove_empty(cfg: ServeConfig) -> None:
    if cfg.instance:
        try:
            cfg.instance_dir.rmdir()
        except OSError:  # not empty (a log, another file): kept
            pass


@contextmanager
def try_instance_lock(cfg: ServeConfig, what: str) -> Iterator[bool]:
    """The instance's lock when it is free (True), else nothing held (False): for a reader that would tidy a dead
    server's record only while no command is changing the instance."""
    try:
        cm = instance_lock(cfg, what)
        cm.__enter__()
    except InstanceBusy:
        yield False
        return
    try:
        yield True
    finally:
        cm.__exit__(None, None, None)


def _busy(cfg: ServeConfig, path: Path, who: str | None) -> InstanceBusy:
    if who is None:
        who = holder_text(path)
    return InstanceBusy(f"instance {cfg.instance_name} is being changed by another command ({who}); nothing was "
                        f"done: wait for it to end, then check {op('status', **_inst(cfg))}",
                        {"instance": cfg.instance_name, "lock": str(path)})


def _inst(cfg: ServeConfig) -> dict[str, str]:
    return {"instance": cfg.instance} if cfg.instance else {}


class Unrecorded(NamedTuple):
    pid: int
    folder: str                 # the folder it was started from: STATE_DIR, or an instance's in it
    ports: list[int]            # where it listens
    command: str

    def line(self) -> str:
        """What it is and how to end it, in one clause."""
        return (f"pid {self.pid} ({self.command}) listens on port {', '.join(map(str, self.ports))}, started from "
                f"{self.folder}, and no readable record names it: nothing of it was signalled; if it is not "
                f"yours, end it with kill -TERM -- -{self.pid}")


def unrecorded(state_dir: Path, folders: list[Path] | None = None) -> list[Unrecorded]:
    """Servers of this STATE_DIR that no readable record names (their record damaged or deleted): processes that
    lead their own session, as every launch here starts them, whose working folder is STATE_DIR or an instance's
    folder in it (a server's launch and the router's run there), that carry a launch token (a user's own server
    started there is not the project's) and that listen on a port. For status and stop to report, never to signal:
    what no record proves is the project's is not ended by it. `folders`: only those started from these (default:
    STATE_DIR and every folder in it)."""
    root = Path(state_dir).resolve()
    if not root.is_dir():
        return []
    only = None if folders is None else {Path(f).resolve() for f in folders}
    names: set[int] = set()
    for path in [root / "router.json", root / "vllm.json", *root.glob("*/vllm.json")]:
        try:
            rec = read_record(path, ProcessRecord)
        except DamagedState:
            continue
        if rec is not None:
            names.add(rec.pid)
    found = []
    for proc in psutil.process_iter(["pid", "cwd"]):
        cwd = proc.info.get("cwd")
        if not cwd or proc.pid in names or (Path(cwd) != root and Path(cwd).parent != root) or (
                only is not None and Path(cwd) not in only):
            continue
        try:
            if os.getsid(proc.pid) != proc.pid or not process.is_running(proc) or not launched(proc):
                continue
            ports = sorted({c.laddr.port for c in proc.net_connections(kind="inet")
                            if c.status == psutil.CONN_LISTEN})
            command = " ".join(proc.cmdline()[:3])[:120]
        except (OSError, psutil.Error):
            continue
        if ports:
            found.append(Unrecorded(proc.pid, cwd, ports, command))
    return found


def replace_file(cfg: ServeConfig) -> Path:
    return cfg.instance_dir / "replace.json"


def load_replace(cfg: ServeConfig) -> ReplaceRecord | None:
    return read_record(replace_file(cfg), ReplaceRecord)


def write_replace(cfg: ServeConfig, record: ReplaceRecord) -> None:
    cfg.instance_dir.mkdir(parents=True, exist_ok=True)
    write_record(replace_file(cfg), record)


def clear_replace(cfg: ServeConfig) -> None:
    replace_file(cfg).unlink(missing_ok=True)


def replace_running(record: ReplaceRecord) -> bool:
    """The replace is still under way: not over, and the command that wrote the record still runs (same pid
    AND start time)."""
    return record.phase != "failed" and process.same_process(record.owner_pid, record.owner_create_time) is not None


def leader(state: ServerState) -> psutil.Process | None:
    """The server's leader process if it is still the one we started (same pid AND creation time)."""
    return state.leader()


def pid_recycled(state: ServerState) -> bool:
    """True when another process now has the server's pid: nothing of that group may be signalled."""
    return state.recycled()


def our_group(state: ServerState) -> list[psutil.Process]:
    """Live processes of the server's group, or none when the pid was recycled."""
    return state.group()


__all__ = ["STATE_VERSION", "DamagedState", "InstanceBusy", "Pid", "ProcessRecord", "Record", "Unrecorded", "unrecorded",
           "ReplaceRecord", "ServerState", "clear_replace", "clear_state", "instance_lock", "leader", "load_replace",
           "load_state", "lock_file", "our_group",
           "pid_recycled", "read_record", "replace_file", "replace_running", "try_instance_lock", "write_record",
           "write_replace", "write_state"]
