"""A detached, tracked vLLM OpenAI server: start, stop, status, log, query.

The server runs in its own process session (so it outlives the command that started it, and the API server and
its engine core form one process group that stop can end together), writes to a log file, and is described by
a JSON state file in `cfg.state_dir`. Everything the GPU or the host would decide (platform, compute capability,
VRAM, memory) goes through a `Hardware` object, so tests can stand in a T4.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil

from tools.serving import engine_log, turing_patch
from tools.serving.config import Platform, ServeConfig, looks_like_path
from tools.serving.engine_log import EngineStartFields
from tools.core.errors import ToolFailure

Progress = Callable[[float, str], None]
STATE_VERSION = 1
# Readiness is a completion of several tokens from a prompt of several tokens: a one-token probe can pass on an
# engine whose traced graphs were specialised on the warm-up's shape and fail every real prompt.
READINESS_PROMPT = "The quick brown fox jumps over the lazy dog."


# ----------------------------------------------------------------------------------------------------------------
# Hardware: what the machine is. The default reads NVML (nvidia-ml-py) and psutil; tests pass their own.

@dataclass
class Vram:
    used_mib: int
    total_mib: int
    utilization_pct: int | None = None
    process_mib: int | None = None  # what the server's process group holds, when NVML says

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Hardware:
    """The machine as the serving tools see it. Subclass and override to simulate a GPU in tests.

    GPUs are read through tools.gpu.vram, the project's one NVML reader, over every GPU the driver lists.
    """

    def platform(self) -> Platform:
        return "cuda" if self._capabilities() else "cpu"

    def compute_capability(self) -> tuple[int, int] | None:
        """The oldest GPU's: it decides whether the Turing attention clamp is needed."""
        caps = self._capabilities()
        return min(caps) if caps else None

    def vram(self, pids: list[int]) -> Vram | None:
        from tools.gpu import vram

        st = vram.vram_status(server_pids=set(pids))
        if not st.available or not st.gpus:
            return None
        utils = [g.utilization_gpu_pct for g in st.gpus if g.utilization_gpu_pct is not None]
        # vLLM's memory belongs to its engine subprocess, not the API server: the whole group is counted.
        return Vram(used_mib=sum(g.used_mib for g in st.gpus), total_mib=sum(g.total_mib for g in st.gpus),
                    utilization_pct=max(utils) if utils else None, process_mib=st.server_used_mib)

    def host_memory(self) -> tuple[int, int]:
        """(RAM bytes, swap bytes enabled)."""
        return int(psutil.virtual_memory().total), int(psutil.swap_memory().total)

    def gpu_count(self) -> int:
        """GPUs NVML lists (0 without a driver); a platform that reports CUDA has at least one."""
        return len(self._capabilities()) or (1 if self.platform() == "cuda" else 0)

    def cpu_cores(self) -> list[int]:
        """The cores this process may run on: what instances are bound to."""
        try:
            return sorted(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return list(range(os.cpu_count() or 1))

    _caps: list[tuple[int, int]] | None = None

    def _capabilities(self) -> list[tuple[int, int]]:
        if self._caps is None:
            from tools.gpu import vram

            self._caps = vram.compute_capabilities()
        return self._caps


# ----------------------------------------------------------------------------------------------------------------
# Results

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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["start_fields"] = self.start_fields.to_dict()
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
    died: bool = False                 # a state file was left by a server that is gone
    leftover_pids: list[int] = field(default_factory=list)
    gpus: list[int] | None = None
    cpu_cores: list[list[int]] | None = None
    kv_cache_tokens: int | None = None
    message: str = ""
    # `status` without an instance: the fields above describe the default instance, these every instance
    instances: list["ServerStatus"] | None = None
    router: dict[str, Any] | None = None
    all_healthy: bool | None = None    # every instance (and router) reported is alive and answers /health

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


# ----------------------------------------------------------------------------------------------------------------
# State file and process bookkeeping

def _load_state(cfg: ServeConfig) -> ServerState | None:
    path = cfg.state_file
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return ServerState(**{k: data[k] for k in ServerState.__dataclass_fields__ if k in data})
    except (ValueError, TypeError, KeyError) as exc:
        raise ToolFailure(f"state file {path} is unreadable ({exc}); check no server of it runs, then delete it")


def _write_state(cfg: ServeConfig, state: ServerState) -> None:
    path = cfg.state_file
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state.to_dict(), indent=2))
    os.replace(tmp, path)  # never a half-written state file


def _clear_state(cfg: ServeConfig) -> None:
    cfg.state_file.unlink(missing_ok=True)


def _reap(pid: int) -> None:
    """Collects the exit status of a server this process started, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _is_running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _leader(state: ServerState) -> psutil.Process | None:
    """The server's leader process if it is still the one we started (same pid AND creation time)."""
    _reap(state.pid)
    try:
        proc = psutil.Process(state.pid)
        if abs(proc.create_time() - state.create_time) > 1.0:
            return None  # the pid was recycled by an unrelated process
        return proc if _is_running(proc) else None
    except psutil.Error:
        return None


def _pid_recycled(state: ServerState) -> bool:
    """True when another process now has the server's pid. Linux does not hand out a pid that is still some
    group's id, so the group of that number is then the newcomer's: nothing of it may be signalled."""
    try:
        return abs(psutil.Process(state.pid).create_time() - state.create_time) > 1.0
    except psutil.Error:
        return False


def _our_group(state: ServerState) -> list[psutil.Process]:
    """Live processes of the server's group, or none when the pid was recycled."""
    return [] if _pid_recycled(state) else _group_members(state.pgid)


def _group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of a process group. A pgid is not reused while any member lives, so these are ours."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and _is_running(proc):
                members.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def _kill_group(pgid: int, leader_pid: int | None, grace_s: float) -> tuple[str | None, list[int], list[int]]:
    """SIGTERM to the group, SIGKILL after grace_s. Returns (last signal, pids that were there, pids remaining)."""
    members = _group_members(pgid)
    pids = [p.pid for p in members]
    if not members:
        return None, [], []
    last = "SIGTERM"
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if leader_pid is not None:
            _reap(leader_pid)
        if not _group_members(pgid):
            break
        time.sleep(0.2)
    else:
        last = "SIGKILL"
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        end = time.monotonic() + 10
        while time.monotonic() < end and _group_members(pgid):
            if leader_pid is not None:
                _reap(leader_pid)
            time.sleep(0.1)
    if leader_pid is not None:
        _reap(leader_pid)
    return last, pids, [p.pid for p in _group_members(pgid)]


def _port_holder(host: str, port: int) -> str | None:
    """None when (host, port) can be bound; otherwise who holds it, as 'pid N (name)' when psutil can tell."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return None
        except OSError:
            pass
    try:
        for conn in psutil.net_connections(kind="inet"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN:
                if conn.pid:
                    try:
                        name = " ".join(psutil.Process(conn.pid).cmdline()[:3]) or psutil.Process(conn.pid).name()
                    except psutil.Error:
                        name = "?"
                    return f"pid {conn.pid} ({name})"
                return "a process this user cannot see"
    except (psutil.Error, PermissionError):
        pass
    return "an unknown process"


def _checkpoint_bytes(model: str) -> int | None:
    """Size of a local checkpoint's weight files; None for a hub id (not downloaded here)."""
    path = Path(model)
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) or None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# ----------------------------------------------------------------------------------------------------------------
# Public API

_DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_deferred():
    """Holds SIGINT, SIGTERM and SIGHUP for the block and delivers them, to the handlers they had, when it ends.
    Python handlers, not a blocked signal mask: a child started in the block would inherit the mask and ignore
    SIGTERM, while a handler reverts to the default at exec. Main thread only (where Python runs handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old = {}
    for sig in _DEFERRED_SIGNALS:
        if signal.getsignal(sig) is not None:  # None: a handler not set from Python, left as it is
            old[sig] = signal.signal(sig, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(pending):
            signal.raise_signal(sig)


def _end_launched(cfg: ServeConfig, proc: subprocess.Popen) -> None:
    """Ends a server this start launched, with its group, and removes its state file: a start that fails or is
    interrupted leaves nothing behind."""
    _kill_group(proc.pid, proc.pid, grace_s=5)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    _clear_state(cfg)


def start_server(cfg: ServeConfig, *, progress: Progress | None = None, hardware: Hardware | None = None,
                 turing_target: Path | None = None) -> StartResult:
    """Starts vLLM detached and waits until /health answers and a one-token greedy completion returns text.

    Refuses (ToolFailure) when this state dir's server is alive, the port is taken, a Turing GPU lacks the
    attention clamp, or host memory cannot hold the checkpoint without swap. On a failed start the process group
    is gone, the state file removed, and the failure carries the log tail and the line that explains it.
    """
    from tools.serving import instances

    hw = hardware or Hardware()
    # Checks and launch under the state dir's lock: two starts at once must not both take one port, core or GPU.
    with instances.locked(cfg):
        state = _load_state(cfg)
        if state is not None:
            if _leader(state) is not None:
                which = f" --instance {cfg.instance}" if cfg.instance else ""
                raise ToolFailure(f"a server started from {cfg.instance_dir} is already running (pid {state.pid}, "
                                  f"{state.served_name} at {state.base_url}); stop it first with ./vllm-t4 stop"
                                  + which, detail={"state": state.to_dict()})
            if _our_group(state):
                raise ToolFailure(f"processes of a previous server (group {state.pgid}) are still running; "
                                  "run ./vllm-t4 stop to end them")
            _clear_state(cfg)  # left by a server that died: not an obstacle

        # Ports, cores and GPU memory other instances hold, and TP/DP against the GPUs: refused before launching.
        cfg = instances.plan(cfg, hw)
        # The port, the model folder and its length limit, the Turing clamp, host memory, the vLLM build and the
        # GPU's free memory: refused here with the failing check's line rather than by vLLM a minute into the start.
        from tools.serving.preflight import ensure

        ensure("start", cfg=cfg, hardware=hw, turing_target=turing_target)
        platform = hw.platform()
        cfg, max_len_note = _fit_to_model(cfg)

        argv = cfg.vllm_argv(platform)
        env = dict(os.environ)
        env.update(cfg.server_env(platform))
        cfg.instance_dir.mkdir(parents=True, exist_ok=True)
        log_path = cfg.log_file
        t0 = time.monotonic()
        proc: subprocess.Popen | None = None
        try:
            # Ctrl-C / SIGTERM wait until the state file names the new group (they are raised on leaving the
            # block, and the except below ends the group): between the launch and that write, an interrupt
            # would leave a server that no state file points at.
            with _signals_deferred():
                with open(log_path, "wb") as log:  # one log per start: the parser reads this start only
                    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, cwd=str(cfg.instance_dir), start_new_session=True)
                try:
                    create_time = psutil.Process(proc.pid).create_time()
                except psutil.Error:
                    create_time = time.time()
                now = datetime.now(timezone.utc)
                state = ServerState(pid=proc.pid, pgid=proc.pid, create_time=create_time, host=cfg.host,
                                    port=cfg.port, base_url=cfg.base_url, model=cfg.model,
                                    served_name=cfg.served_name, argv=argv, platform=platform,
                                    started_at=now.isoformat(timespec="seconds"), started_ts=now.timestamp(),
                                    log_path=str(log_path), instance=cfg.instance, gpus=cfg.gpus,
                                    gpu_memory_utilization=cfg.gpu_memory_utilization, cpu_cores=cfg.cpu_cores,
                                    tensor_parallel_size=cfg.tensor_parallel_size,
                                    data_parallel_size=cfg.data_parallel_size)
                _write_state(cfg, state)
        except BaseException:
            if proc is not None:
                _end_launched(cfg, proc)
            raise

    def fail(reason: str) -> ToolFailure:
        _end_launched(cfg, proc)
        text = _read_text(log_path)
        why = engine_log.explain_failure(text)
        msg = f"vLLM {reason}" + (f": {why}" if why else "") + f" (log: {log_path})"
        return ToolFailure(msg, detail={"reason": reason, "explanation": why, "pid": proc.pid, "pgid": proc.pid, "log_tail": engine_log.tail(text, 40),
                                        "log_path": str(log_path), "argv": argv})

    first_text: str | None = None
    deadline = t0 + cfg.start_timeout_s
    healthy = False
    last_line = "launching"
    with httpx.Client(timeout=5.0) as client:
        try:
            while True:
                code = proc.poll()
                if code is not None:
                    raise fail(f"exited with code {code} while starting")
                if time.monotonic() > deadline:
                    raise fail(f"did not become ready within {cfg.start_timeout_s:g} s")
                if not healthy:
                    try:
                        healthy = client.get(f"{cfg.base_url}/health").status_code == 200
                    except httpx.HTTPError:
                        healthy = False
                if healthy:
                    try:
                        r = client.post(f"{cfg.base_url}/v1/completions", timeout=60.0, json={
                            "model": cfg.served_name, "prompt": READINESS_PROMPT, "max_tokens": 4,
                            "temperature": 0})
                        if r.status_code == 200:
                            choice = r.json()["choices"][0]
                            if isinstance(choice.get("text"), str):
                                first_text = choice["text"]
                                break
                        else:
                            last_line = f"first completion answered HTTP {r.status_code}: {r.text[:200]}"
                    except (httpx.HTTPError, ValueError, KeyError, IndexError):
                        pass
                if progress is not None:
                    lines = [ln for ln in _read_text(log_path).splitlines() if ln.strip()]
                    if lines:
                        last_line = engine_log.strip_prefix(lines[-1])[:200]
                    progress(min(0.99, (time.monotonic() - t0) / cfg.start_timeout_s), last_line)
                time.sleep(1.0)
        except ToolFailure:
            raise
        except BaseException:  # Ctrl-C, SIGTERM, a cancelled job: leave no server behind, keep the exit status
            fail("start was interrupted")
            raise

    startup_s = time.monotonic() - t0
    fields = engine_log.parse_engine_log(_read_text(log_path))
    if fields.embedding_method is None:
        fields.embedding_method = _embedding_method_from_config(cfg.model)
    fields.eager = "--enforce-eager" in argv
    if progress is not None:
        progress(1.0, f"serving {cfg.served_name} at {cfg.base_url}")
    return StartResult(pid=proc.pid, pgid=proc.pid, base_url=cfg.base_url, model=cfg.model,
                       served_name=cfg.served_name, platform=platform, argv=argv, log_path=str(log_path),
                       state_file=str(cfg.state_file), startup_s=round(startup_s, 2), first_completion=first_text,
                       start_fields=fields, max_model_len=cfg.max_model_len, max_model_len_note=max_len_note)


def model_position_limit(model: str) -> int | None:
    """The longest context a local checkpoint's config allows (max_position_embeddings, top level or in
    text_config); None for a hub id or a config that does not say."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, RecursionError, OSError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    for source in ((text if isinstance(text, dict) else {}), cfg):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _fit_to_model(cfg: ServeConfig) -> tuple[ServeConfig, str | None]:
    """Refuses a local model folder that does not exist; fits MAX_MODEL_LEN to the model's own limit.

    vLLM refuses a max_model_len above the model's max_position_embeddings, a minute into the start and behind
    a pydantic header. A value given for this start (option or environment) is a demand: refuse it now. A value
    from tpu.env is the deployment's preference for the real model: serve at the model's limit and say so.
    """
    if looks_like_path(cfg.model) and not Path(cfg.model).is_dir():
        where = "MODEL_NAME in " + str(cfg.env_file) if cfg.sources.get("model") == "file" else "--model"
        raise ToolFailure(
            f"model folder {cfg.model} does not exist ({where}): build it with `./vllm-t4 demo` or "
            f"`python -m repack build SOURCE {cfg.model} --text-only --embed-int4 --embed-tokens`, "
            "or point MODEL_NAME at a build or a Hugging Face id", detail={"model": cfg.model})
    limit = model_position_limit(cfg.model)
    if limit is None or cfg.max_model_len <= limit:
        return cfg, None
    if cfg.given_for_this_start("max_model_len"):
        raise ToolFailure(f"max_model_len {cfg.max_model_len} is above the model's own limit "
                          f"(max_position_embeddings={limit} in {cfg.model}/config.json): pass at most {limit}",
                          detail={"max_model_len": cfg.max_model_len, "model_limit": limit})
    note = (f"MAX_MODEL_LEN {cfg.max_model_len} from {cfg.env_file} is above this model's limit: "
            f"serving at max_position_embeddings={limit}")
    return replace(cfg, max_model_len=limit), note


def _embedding_method_from_config(model: str) -> str | None:
    """On CUDA vLLM does not log the embedding method: read it from a local checkpoint's quantization config."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        qc = json.loads(path.read_text()).get("quantization_config") or {}
    except ValueError:
        return None
    for group in (qc.get("config_groups") or {}).values():
        if any(t == "Embedding" or "embed" in str(t).lower() for t in group.get("targets", [])):
            return "CompressedTensorsEmbeddingWNA16Int"
    return "VocabParallelEmbedding (unquantized)"


def stop_server(cfg: ServeConfig, *, grace_s: float = 20) -> StopResult:
    """SIGTERM to the server's process group, SIGKILL after grace_s; idempotent. Raises if a process remains."""
    state = _load_state(cfg)
    if state is None:
        return StopResult(was_running=False, message=f"no server recorded in {cfg.instance_dir}")
    if _pid_recycled(state):
        _clear_state(cfg)
        return StopResult(was_running=False, pid=state.pid,
                          message=f"server pid {state.pid} is gone (the pid now belongs to another process); "
                                  "its state file was cleared")
    leader = _leader(state)
    last, pids, remaining = _kill_group(state.pgid, state.pid if leader is not None else None, grace_s)
    if remaining:
        raise ToolFailure(f"processes {remaining} of the server's group {state.pgid} survived SIGKILL; "
                          "check them with ps and end them by hand", detail={"remaining": remaining})
    _clear_state(cfg)
    if not pids:
        return StopResult(was_running=False, pid=state.pid,
                          message=f"server pid {state.pid} was no longer running; its state file was cleared")
    return StopResult(was_running=True, pid=state.pid, signal=last, stopped_pids=pids,
                      message=f"stopped {state.served_name} (pid {state.pid}, {len(pids)} processes, {last})")


def server_status(cfg: ServeConfig, *, hardware: Hardware | None = None) -> ServerStatus:
    """Whether the server of this state dir runs and answers; clears the state file of a server that died."""
    state = _load_state(cfg)
    if state is None:
        return ServerStatus(alive=False, instance=cfg.instance_name,
                            message=f"not running (no server recorded in {cfg.instance_dir})")
    fields = engine_log.parse_engine_log(_read_text(Path(state.log_path)))
    common = dict(pid=state.pid, model=state.model, served_name=state.served_name, base_url=state.base_url,
                  argv=state.argv, platform=state.platform, log_path=state.log_path, start_fields=fields,
                  instance=cfg.instance_name, gpus=state.gpus, cpu_cores=state.cpu_cores,
                  kv_cache_tokens=fields.kv_cache_tokens)
    leader = _leader(state)
    if leader is None:
        leftovers = [p.pid for p in _our_group(state)]
        if leftovers:
            return ServerStatus(alive=False, died=True, leftover_pids=leftovers, **common,
                                message=f"server pid {state.pid} died; processes {leftovers} of its group remain: "
                                        "run ./vllm-t4 stop")
        _clear_state(cfg)
        why = engine_log.explain_failure(_read_text(Path(state.log_path)))
        return ServerStatus(alive=False, died=True, **common,
                            message=f"server pid {state.pid} died (killed, or exited"
                                    + (f": {why}" if why else "") + "); its state file was cleared")
    healthy = False
    try:
        healthy = httpx.get(f"{state.base_url}/health", timeout=3.0).status_code == 200
    except httpx.HTTPError:
        pass
    vram = None
    if state.platform == "cuda":
        hw = hardware or Hardware()
        vram = hw.vram([p.pid for p in _group_members(state.pgid)])
    uptime = round(time.time() - state.started_ts, 1)
    return ServerStatus(alive=True, healthy=healthy, uptime_s=uptime, vram=vram, **common,
                        message=f"{'serving' if healthy else 'running but not healthy'}: {state.served_name} at "
                                f"{state.base_url} (pid {state.pid})")


def read_log(cfg: ServeConfig, lines: int = 50) -> str:
    """The last `lines` lines of the server log of this instance."""
    state = _load_state(cfg)
    path = Path(state.log_path) if state else cfg.log_file
    if not path.is_file():
        raise ToolFailure(f"no server log at {path}; start a server first")
    return engine_log.tail(_read_text(path), lines)


def query(cfg: ServeConfig, prompt: str, *, max_tokens: int = 64, base_url: str | None = None,
          model: str | None = None, timeout_s: float = 300.0) -> QueryResult:
    """One chat completion at temperature 0: the text, the usage and the generated token ids."""
    state = _load_state(cfg)
    url = base_url or (state.base_url if state else cfg.base_url)
    name = model or (state.served_name if state and not base_url else cfg.served_name)
    body = {"model": name, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens, "return_token_ids": True}
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise ToolFailure(f"no answer from {url} ({type(exc).__name__}); check ./vllm-t4 status") from None
    if r.status_code != 200:
        raise ToolFailure(f"{url} answered HTTP {r.status_code}: {r.text[:300]}")
    data = r.json()
    choice = data["choices"][0]
    return QueryResult(text=choice["message"].get("content") or "", usage=data.get("usage") or {},
                       model=data.get("model", name), finish_reason=choice.get("finish_reason"),
                       token_ids=choice.get("token_ids"), latency_s=round(time.monotonic() - t0, 3))
