"""A detached, tracked vLLM OpenAI server, its whole life in one place: `Server` (start with its checks, wait
until ready, status, query, log, stop; a context manager for a command's own server) and the functions it is made
of (start_server, stop_server, server_status, query, read_log).

The server runs in its own process session and group, writes to a log file, and is described by a JSON state
file in `cfg.state_dir` (tools.serving.records.state): its record. How it is launched, checked first and waited
for is tools.serving.server.launch; everything the GPU or the host would decide goes through a `Hardware` object
(tools.serving.preflight.hardware), so tests can stand in a T4.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import httpx

from tools.core.api_key import auth_headers
from tools.core.errors import ToolFailure, op
from tools.core.paths import inside
from tools.core.process import end_group, group_members
from tools.gpu.vram import host_memory, server_process_pids
from tools.serving.server import engine_log, health, switch_record
from tools.serving.records import placement, router_state, state as replace_state
from tools.serving.config import ServeConfig
from tools.serving.preflight.hardware import Hardware, Vram
from tools.serving.server.guard import owned_server
from tools.serving.server.launch import (checked, end_launched, launch_server, own_log, refuse_recorded,
                                         remember_startup, replace_note, stale_replace, start_result, wait_ready)
from tools.core.progress import Progress
from tools.serving.server.results import QueryResult, ServerStatus, StartResult, StopResult
from tools.serving.records.files import holder, holder_text
from tools.serving.records.state import (DamagedState, ServerState, clear_state, instance_lock, leader, load_state, our_group,
                                 lock_file, pid_recycled, try_instance_lock, unrecorded)


def start_server(cfg: ServeConfig, *, progress: Progress | None = None, hardware: Hardware | None = None,
                 turing_target: Path | None = None, placed: placement.Hold | None = None) -> StartResult:
    """Starts vLLM detached and waits until /health answers and a short greedy completion returns text.

    Refuses (ToolFailure) when this state dir's server is alive, the port is taken, a Turing GPU lacks the
    attention clamp, or host memory cannot hold the checkpoint without swap. On a failed start the process group
    is gone, the state file removed, and the failure carries the log tail and the line that explains it. A
    replace of this instance that did not finish is named in the result (and the failure), then forgotten once
    this start serves. `placed`: the placement lock this thread holds with cfg's plan made under it (a front-door
    switch's), handed over: the start checks and launches under it and releases it once launched; a hold
    released before is not used (the plan is made again under a lock of the start's own).
    """
    hw = hardware or Hardware()
    # The instance's lock for the whole start (no stop, replace or start of it meanwhile); the checks and the
    # launch under the state dir's lock too: two starts at once must not both take one port, core or GPU.
    with instance_lock(cfg, f"start of {cfg.served_name}"):
        return _start_locked(cfg, progress, hw, turing_target, placed)


def _start_locked(cfg: ServeConfig, progress: Progress | None, hw: Hardware, turing_target: Path | None,
                  placed: placement.Hold | None) -> StartResult:
    note, proc = None, None
    try:
        with placement.locked(cfg, placed) as hold:
            stale = stale_replace(cfg)
            note = replace_note(cfg, stale) if stale is not None else None
            refuse_recorded(cfg)
            cfg, max_len_note, platform, warnings = checked(cfg, hw, turing_target, hold=hold)
            argv = cfg.vllm_argv(platform)
            cfg = own_log(cfg)
            t0 = time.monotonic()
            proc = launch_server(cfg, argv, platform)
        if note and progress is not None:
            progress(0.0, 1.0, note)
        first_text = wait_ready(cfg, proc, argv, t0, progress)
    except BaseException as exc:  # failed, interrupted or cancelled once launched (between two steps too): the
        if proc is not None:      # server goes with it (a second time after wait_ready's own: a no-op)
            end_launched(cfg, proc)
        if isinstance(exc, ToolFailure):
            raise _noted(exc, note) from None
        raise
    if stale is not None:
        replace_state.clear_replace(cfg)
    res = start_result(cfg, proc, argv, platform, t0, first_text, max_len_note, warnings)
    remember_startup(cfg, proc, res.startup_s)
    res.note = note
    if progress is not None:
        progress(1.0, 1.0, f"serving {cfg.served_name} at {cfg.base_url}")
    return res


def _noted(exc: ToolFailure, note: str | None) -> ToolFailure:
    if not note:
        return exc
    return type(exc)(f"{exc.message}; note: {note}", {**(exc.detail or {}), "replace_note": note},
                     field=getattr(exc, "field", None))


def stop_server(cfg: ServeConfig, *, grace_s: float = 20) -> StopResult:
    """SIGTERM to the server's process group, SIGKILL after grace_s; idempotent. Raises if a process remains.
    Under the instance's lock: refused (InstanceBusy) while another command starts, stops or replaces it."""
    if not cfg.state_file.exists():
        replace_state.load_replace(cfg)  # a damaged replace record (DamagedState) is said, not passed over
        return StopResult(was_running=False, message=f"no server recorded in {cfg.instance_dir}")
    with instance_lock(cfg, "stop"):
        return _stop_locked(cfg, grace_s)


def _stop_locked(cfg: ServeConfig, grace_s: float) -> StopResult:
    state = load_state(cfg)
    if state is None:
        return StopResult(was_running=False, message=f"no server recorded in {cfg.instance_dir}")
    if pid_recycled(state):
        clear_state(cfg, state)
        return StopResult(was_running=False, pid=state.pid,
                          message=f"server pid {state.pid} is gone (the pid now belongs to another process); "
                                  "its state file was cleared")
    alive = leader(state)
    # With the leader gone, the group is signalled only while members carry the record's launch token: a dead
    # pid's group may be a stranger's.
    last, pids, remaining = end_group(state.pgid, grace_s, leader=state.pid if alive is not None else None) if (
        alive is not None or our_group(state)) else (None, [], [])
    if remaining:
        raise ToolFailure(f"processes {remaining} of the server's group {state.pgid} survived SIGKILL; "
                          "check them with ps and end them by hand", detail={"remaining": remaining})
    clear_state(cfg, state)
    if not pids:
        return StopResult(was_running=False, pid=state.pid,
                          message=f"server pid {state.pid} was no longer running; its state file was cleared")
    how = last if last != "SIGKILL" else f"SIGKILL: still running {grace_s:g} s after SIGTERM"
    return StopResult(was_running=True, pid=state.pid, signal=last, stopped_pids=pids,
                      message=f"stopped {state.served_name} (pid {state.pid}, {len(pids)} processes, {how})")


def stop_each(cfg: ServeConfig, steps: list[Any], folders: list[Path] | None) -> list[Any]:
    """Runs each stop; a failure does not keep the others from running. Then the servers started from `folders`
    that no readable record names are looked for: any failure or such server makes one ToolFailure (what was
    stopped in its detail; a lone failure is raised as it is); else the results."""
    results: list[Any] = []
    failed: list[ToolFailure] = []
    for step in steps:
        try:
            results.append(step())
        except ToolFailure as exc:
            failed.append(exc)
    left = unrecorded(cfg.state_dir, folders)
    if not failed and not left:
        return results
    if len(failed) == 1 and not left and not any(r.was_running for r in results):
        raise failed[0]
    done = "; ".join(r.message for r in results if r.was_running) or "nothing was stopped"
    lines = [*map(str, failed), *(u.line() for u in left)]
    # the first two named, the rest counted: 40 damaged records made a 4,501-character answer
    more = (f"; and {len(lines) - 2} more, each named in detail.failed and detail.unrecorded ({op('status')} shows "
            f"each instance)" if len(lines) > 2 else "")
    raise ToolFailure(f"{done}; {len(lines)} could not be stopped: " + "; ".join(lines[:2]) + more,
                      {"stopped": [r.to_dict() for r in results], "failed": [e.detail for e in failed],
                       "unrecorded": [u._asdict() for u in left]})


def server_status(cfg: ServeConfig, *, hardware: Hardware | None = None) -> ServerStatus:
    """Whether the server of this state dir runs and answers; clears the state file of a server that died. A
    damaged state file is reported (not alive, its one line as the message), not raised: status goes on. A
    replace of this instance in progress, or left unfinished, is added to the message (and `replace`)."""
    st = _server_status(cfg, hardware)
    last = switch_record.load_switch(cfg)
    if last is not None:
        st.last_switch = last.to_dict()
        st.message += f"; {switch_record.describe(last, serving_now=st.alive)}"
    try:
        rec = replace_state.load_replace(cfg)
    except DamagedState as exc:
        st.message += f"; {exc}"
        return st
    if rec is None:
        return st
    running = replace_state.replace_running(rec)
    st.replace = {**rec.to_dict(), "running": running}
    if running:
        st.message += (f"; replacing {rec.a.served_name} by {rec.b_served_name} (pid {rec.owner_pid}, "
                       f"{rec.phase})")
    else:
        st.message += f"; {replace_note(cfg, rec)}"
    return st


def served_memory(cfg: ServeConfig, state: ServerState, vram: Vram | None) -> dict[str, Any] | None:
    """The served model's memory, read as vram_status reads it: on a GPU the VRAM its process group holds (NVML),
    on a CPU its processes' host memory (RSS, and PSS where /proc/PID/smaps_rollup is readable), the method
    named. None when it cannot be read now (the processes ended between the checks)."""
    if vram is not None:
        mib = vram.process_mib if vram.process_mib is not None else vram.used_mib
        how = ("NVML: GPU memory of the server's process group" if vram.process_mib is not None else
               "NVML: the GPU's used memory (no per-process figure reported)")
        return {"kind": "vram", "mib": mib, "total_mib": vram.total_mib, "method": how,
                "line": f"VRAM {mib} MiB of {vram.total_mib} MiB ({how})"}
    try:
        host = host_memory(cfg.instance_name, server_process_pids(state.pid), state.model)
    except Exception:  # noqa: BLE001 - a process gone or unreadable mid-read: status goes on without the figure
        return None
    return {"kind": "host", **host.model_dump(mode="json"), "line": f"host memory {host.line()} ({host.method})"}


def _server_status(cfg: ServeConfig, hardware: Hardware | None) -> ServerStatus:
    try:
        state = load_state(cfg)
    except DamagedState as exc:
        return ServerStatus(alive=False, instance=cfg.instance_name, message=str(exc))
    if state is None:
        return ServerStatus(alive=False, instance=cfg.instance_name,
                            message=f"not running (no server recorded in {cfg.instance_dir})")
    fields = engine_log.recorded_start_fields(Path(state.log_path), state.argv, state.model)
    common = dict(pid=state.pid, model=state.model, served_name=state.served_name, base_url=state.base_url,
                  argv=state.argv, platform=state.platform, log_path=state.log_path, start_fields=fields,
                  instance=cfg.instance_name, gpus=state.gpus, cpu_cores=state.cpu_cores,
                  kv_cache_tokens=fields.kv_cache_tokens)
    busy = holder(lock_file(cfg))  # a command starting or stopping it: its view of the instance, not died
    if leader(state) is None and busy is not None:
        return ServerStatus(alive=False, **common,
                            message=f"{state.served_name} (pid {state.pid}) is not running while another command "
                                    f"changes instance {cfg.instance_name} ({holder_text(lock_file(cfg))})")
    if leader(state) is None:
        leftovers = [p.pid for p in our_group(state)]
        if leftovers:
            return ServerStatus(alive=False, died=True, leftover_pids=leftovers, **common,
                                message=f"server pid {state.pid} died; processes {leftovers} of its group remain: "
                                        "run ./vllm-t4 stop")
        with try_instance_lock(cfg, "status") as free:  # a command changing the instance has its own view of it
            if free:
                clear_state(cfg, state)
        if pid_recycled(state):  # as stop says it: the pid is another process's now, not a server that died
            return ServerStatus(alive=False, died=True, **common,
                                message=f"server pid {state.pid} is gone (the pid now belongs to another process); "
                                        "its state file was cleared")
        why = engine_log.explain_failure(engine_log.read_text(Path(state.log_path)))
        return ServerStatus(alive=False, died=True, **common,
                            message=f"server pid {state.pid} died (killed, or exited"
                                    + (f": {why}" if why else "") + "); its state file was cleared")
    healthy = health.answers(state.base_url)
    vram = None
    if state.platform == "cuda":
        hw = hardware or Hardware()
        vram = hw.vram([p.pid for p in group_members(state.pgid)])
    uptime = round(time.time() - state.started_ts, 1)
    return ServerStatus(alive=True, healthy=healthy, uptime_s=uptime, vram=vram,
                        memory=served_memory(cfg, state, vram), **common,
                        message=f"{'serving' if healthy else 'not answering' if busy else 'running but not healthy'}"
                                f": {state.served_name} at {state.base_url} (pid {state.pid})"
                                + (f", while another command changes instance {cfg.instance_name} "
                                   f"({holder_text(lock_file(cfg))})" if busy is not None and not healthy else ""))


def read_log(cfg: ServeConfig, lines: int = 50) -> str:
    """The last `lines` lines of the server log of this instance: its recorded server's, else the newest; after a
    switch whose new build failed, that build's kept log follows (the live log is the restored build's by then)."""
    path = log_path(cfg)
    failed = switch_record.failed_log_section(cfg, lines)
    # a launch writes its log in STATE_DIR, a file of its own: a link there (or a record naming a file elsewhere)
    # would have this read, and an MCP client shown, a file outside the project's folders
    if path.is_symlink() or not inside(path.absolute(), Path(cfg.state_dir).absolute()):
        raise ToolFailure(f"the server log {path} is {'a link' if path.is_symlink() else 'outside STATE_DIR'}, "
                          f"which a launch never writes: not read; remove it, then {op('start')}")
    if not path.is_file():
        if failed is not None:
            return failed
        raise ToolFailure(f"no server log at {path}; start one with {op('start')}")
    text = engine_log.tail(engine_log.read_text(path), lines)
    return text if failed is None else f"{text}\n{failed}"


def behind_door_state(cfg: ServeConfig) -> ServerState | None:
    """The default instance with a front door on its port: the record of the build the door routes to, when it
    runs."""
    rt = router_state.door_on_port(cfg)
    if rt is None or not rt.backends:
        return None
    b = rt.backends[-1].instance
    try:
        return load_state(replace(cfg, instance="" if b == "default" else b))
    except ToolFailure:
        return None


def log_path(cfg: ServeConfig) -> Path:
    """The instance's server log: the recorded server's own, else the newest launch's (each has one); for the
    default instance, the builds' of the front door (in its slots' folders) count as its launches."""
    state = load_state(cfg) or behind_door_state(cfg)
    if state is not None:
        return Path(state.log_path)
    folders = [cfg.instance_dir, *([] if cfg.instance else
                                   (replace(cfg, instance=s).instance_dir for s in router_state.SLOTS))]
    logs = [f for d in folders if d.is_dir() for f in d.glob("vllm-*.log")]
    return max(logs, key=lambda f: (f.stat().st_mtime, f.name)) if logs else cfg.log_file


def query(cfg: ServeConfig, prompt: str, *, max_tokens: int = 64, base_url: str | None = None,
          model: str | None = None, timeout_s: float = 300.0) -> QueryResult:
    """One chat completion at temperature 0: the text, the usage and the generated token ids."""
    state = load_state(cfg)
    url = base_url or (state.base_url if state else cfg.base_url)
    behind = None if state is not None or base_url else behind_door_state(cfg)
    if behind is not None:  # the front door's port: the name of the build it routes to
        state = behind
    elif state is None and not base_url:  # PORT may be anyone's service: the prompt is not sent there
        which = f"for instance {cfg.instance!r}" if cfg.instance else "here"
        raise ToolFailure(f"no vLLM server is recorded {which} ({cfg.state_file}); start one with {op('start')}")
    name = model or (state.served_name if state and not base_url else cfg.served_name)
    body = {"model": name, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "return_token_ids": True}
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s, headers=auth_headers())
    except httpx.HTTPError as exc:
        raise ToolFailure(f"no answer from {url} ({type(exc).__name__}); check {op('status')}") from None
    if r.status_code != 200:
        raise ToolFailure(f"{url} answered HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    choice = data["choices"][0]
    return QueryResult(text=choice["message"].get("content") or "", usage=data.get("usage") or {},
                       model=data.get("model", name), finish_reason=choice.get("finish_reason"),
                       token_ids=choice.get("token_ids"), latency_s=round(time.monotonic() - t0, 3))


class Server:
    """One instance's vLLM server, its whole life: `start` (every check first, then launched and waited for until
    ready), `wait_ready`, `status`, `query`, `log`, `stop`. The instance's state file is its record, so a Server
    holds a config, not a process: another command's Server of the same config is the same server.

    `start` outside a `with` block is owned until ready: the command gone before then (even by SIGKILL) takes the
    starting server with it, a ready one outlives the command (`./vllm-t4 start`). As a context manager it is the
    command's own server (decode-sweep's, the demo's): what the block starts ends with the block, however the
    command ends (a guard process beside it ends it after a SIGKILL, see tools.serving.server.guard)."""

    def __init__(self, cfg: ServeConfig, *, hardware: Hardware | None = None) -> None:
        self.cfg = cfg
        self.hardware = hardware
        self.started: StartResult | None = None  # this object's start, once ready
        self._owned: Any = None  # the `with` block's guard
        self._guarded = 0  # guarded() blocks open

    def __enter__(self) -> Server:
        guard = owned_server(self.cfg.state_file)
        guard.__enter__()
        self._owned = guard
        return self

    def __exit__(self, *exc: Any) -> None:
        guard, self._owned = self._owned, None
        try:
            if self.started is not None:  # the block's own server; a refused start left nothing to stop
                self.stop()
        finally:
            guard.__exit__(*exc)

    @contextmanager
    def guarded(self) -> Iterator[None]:
        """A block whose starts of this instance (a replace's, or a start and what must follow it) are owned
        until it ends: the command gone before then takes them with it; a block that ends hands them over."""
        with owned_server(self.cfg.state_file):
            self._guarded += 1
            try:
                yield
            finally:
                self._guarded -= 1

    def start(self, *, progress: Progress | None = None, turing_target: Path | None = None,
              placed: placement.Hold | None = None) -> StartResult:
        """Starts it and waits until /health answers and a first completion returns text (start_server; `placed`:
        the placement lock held with its plan, handed over to the launch)."""
        if self._owned is not None or self._guarded:
            self.started = start_server(self.cfg, progress=progress, hardware=self.hardware,
                                        turing_target=turing_target, placed=placed)
        else:
            with self.guarded():
                self.started = start_server(self.cfg, progress=progress, hardware=self.hardware,
                                            turing_target=turing_target, placed=placed)
        return self.started

    @property
    def record(self) -> ServerState | None:
        """Its state file's record; None when none is written."""
        return load_state(self.cfg)

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Whether the recorded server answers /health within timeout_s (the config's start timeout by default):
        one launched and not waited for (a failed replace's way back) is serving once it does. No record: no."""
        rec = self.record
        return rec is not None and health.wait(rec.base_url,
                                               self.cfg.start_timeout_s if timeout_s is None else timeout_s)

    def status(self) -> ServerStatus:
        return server_status(self.cfg, hardware=self.hardware)

    def query(self, prompt: str, **kw: Any) -> QueryResult:
        return query(self.cfg, prompt, **kw)

    def log(self, lines: int = 50) -> str:
        return read_log(self.cfg, lines)

    def stop(self, *, grace_s: float = 20) -> StopResult:
        res = stop_server(self.cfg, grace_s=grace_s)
        self.started = None
        return res


__all__ = ["Server", "behind_door_state", "log_path", "query", "read_log", "server_status", "start_server", "stop_each",
           "stop_server"]
