"""Starting a detached, tracked vLLM server: refused before launching when it cannot work, launched in its own
process session with its state file written, and ready when /health answers and a completion returns text.

The server runs in its own process session (so it outlives the command that started it, and the API server and
its engine core form one process group that stop can end together) and writes to a log file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import httpx
import psutil

from tools.core.errors import ToolFailure, op, param
from tools.core.process import end_group
from tools.gpu.vram import host_memory, server_process_pids
from tools.serving import engine_log, placement, state
from tools.serving.config import ServeConfig, looks_like_path
from tools.serving.hardware import Hardware
from tools.serving.model_files import embedding_method, model_position_limit
from tools.serving.model_files import missing_model_fix
from tools.serving.preflight import ensure
from tools.serving.records import StartResult
from tools.serving.state import ServerState

Progress = Callable[[float, str], None]
# Readiness is a completion of several tokens from a prompt of several tokens: a one-token probe can pass on an
# engine whose traced graphs were specialised on the warm-up's shape and fail every real prompt.
READINESS_PROMPT = "The quick brown fox jumps over the lazy dog."
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
    end_group(proc.pid, grace_s=5, leader=proc)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    state.clear_state(cfg)


def _refuse_recorded(cfg: ServeConfig) -> None:
    """Refuses a start over this instance's live server or its leftover processes; clears a dead one's file."""
    recorded = state.load_state(cfg)
    if recorded is None:
        return
    if state.leader(recorded) is not None:
        stop = op("stop", instance=cfg.instance) if cfg.instance else op("stop")
        raise ToolFailure(f"a server started from {cfg.instance_dir} is already running (pid {recorded.pid}, "
                          f"{recorded.served_name} at {recorded.base_url}); stop it first with {stop}",
                          detail={"state": recorded.to_dict()})
    if state.our_group(recorded):
        raise ToolFailure(f"processes of a previous server (group {recorded.pgid}) are still running; "
                          f"run {op('stop')} to end them")
    state.clear_state(cfg)  # left by a server that died: not an obstacle


def fit_to_model(cfg: ServeConfig, platform: str = "cuda") -> tuple[ServeConfig, str | None]:
    """Refuses a local model folder that does not exist; fits MAX_MODEL_LEN to the model's own limit.

    vLLM refuses a max_model_len above the model's max_position_embeddings, a minute into the start and behind
    a pydantic header. A value given for this start (option or environment) is a demand: refuse it now. A value
    from tpu.env is the deployment's preference for the real model: serve at the model's limit and say so.
    """
    if looks_like_path(cfg.model) and not Path(cfg.model).is_dir():
        where = "MODEL_NAME in " + str(cfg.env_file) if cfg.sources.get("model") == "file" else param("model")
        raise ToolFailure(f"model folder {cfg.model} does not exist ({where}): "
                          f"{missing_model_fix(cfg.model, platform)}", detail={"model": cfg.model})
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


def _launch(cfg: ServeConfig, argv: list[str], platform: str) -> subprocess.Popen:
    """Launches vLLM in its own session and writes the state file that names its group."""
    env = dict(os.environ)
    env.update(cfg.server_env(platform))
    cfg.instance_dir.mkdir(parents=True, exist_ok=True)
    proc: subprocess.Popen | None = None
    try:
        # Ctrl-C / SIGTERM wait until the state file names the new group (they are raised on leaving the
        # block, and the except below ends the group): between the launch and that write, an interrupt
        # would leave a server that no state file points at.
        with _signals_deferred():
            with open(cfg.log_file, "wb") as log:  # one log per start: the parser reads this start only
                proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, cwd=str(cfg.instance_dir), start_new_session=True)
            try:
                create_time = psutil.Process(proc.pid).create_time()
            except psutil.Error:
                create_time = time.time()
            now = datetime.now(timezone.utc)
            state.write_state(cfg, ServerState(
                pid=proc.pid, pgid=proc.pid, create_time=create_time, host=cfg.host, port=cfg.port,
                base_url=cfg.base_url, model=cfg.model, served_name=cfg.served_name, argv=argv, platform=platform,
                started_at=now.isoformat(timespec="seconds"), started_ts=now.timestamp(),
                log_path=str(cfg.log_file), instance=cfg.instance, gpus=cfg.gpus,
                gpu_memory_utilization=cfg.gpu_memory_utilization, cpu_cores=cfg.cpu_cores,
                tensor_parallel_size=cfg.tensor_parallel_size, data_parallel_size=cfg.data_parallel_size))
    except BaseException:
        if proc is not None:
            _end_launched(cfg, proc)
        raise
    return proc


def _first_completion(client: httpx.Client, cfg: ServeConfig) -> tuple[str | None, str | None]:
    """(the text of a short greedy completion, or None; what the server answered instead, when it answered)."""
    try:
        r = client.post(f"{cfg.base_url}/v1/completions", timeout=60.0, json={
            "model": cfg.served_name, "prompt": READINESS_PROMPT, "max_tokens": 4, "temperature": 0})
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            if isinstance(choice.get("text"), str):
                return choice["text"], None
            return None, None
        return None, f"first completion answered HTTP {r.status_code}: {r.text[:200]}"
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None, None


def _wait_ready(cfg: ServeConfig, proc: subprocess.Popen, argv: list[str], t0: float,
                progress: Progress | None) -> str:
    """Waits for /health and a first completion; on a failure or an interrupt ends the server it launched."""
    log_path = cfg.log_file

    def fail(reason: str) -> ToolFailure:
        _end_launched(cfg, proc)
        text = engine_log.read_text(log_path)
        why = engine_log.explain_failure(text)
        msg = f"vLLM {reason}" + (f": {why}" if why else "") + f" (log: {log_path})"
        return ToolFailure(msg, detail={"reason": reason, "explanation": why, "pid": proc.pid, "pgid": proc.pid,
                                        "log_tail": engine_log.tail(text, 40), "log_path": str(log_path),
                                        "argv": argv})

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
                    text, answered = _first_completion(client, cfg)
                    if text is not None:
                        return text
                    last_line = answered or last_line
                if progress is not None:
                    lines = [ln for ln in engine_log.read_text(log_path).splitlines() if ln.strip()]
                    if lines:
                        last_line = engine_log.strip_prefix(lines[-1])[:200]
                    progress(min(0.99, (time.monotonic() - t0) / cfg.start_timeout_s), last_line)
                time.sleep(1.0)
        except ToolFailure:
            raise
        except BaseException:  # Ctrl-C, SIGTERM, a cancelled job: leave no server behind, keep the exit status
            fail("start was interrupted")
            raise


def start_server(cfg: ServeConfig, *, progress: Progress | None = None, hardware: Hardware | None = None,
                 turing_target: Path | None = None) -> StartResult:
    """Starts vLLM detached and waits until /health answers and a short greedy completion returns text.

    Refuses (ToolFailure) when this state dir's server is alive, the port is taken, a Turing GPU lacks the
    attention clamp, or host memory cannot hold the checkpoint without swap. On a failed start the process group
    is gone, the state file removed, and the failure carries the log tail and the line that explains it.
    """
    hw = hardware or Hardware()
    # Checks and launch under the state dir's lock: two starts at once must not both take one port, core or GPU.
    with placement.locked(cfg):
        _refuse_recorded(cfg)
        # Ports, cores and GPU memory other instances hold, and TP/DP against the GPUs: refused before launching.
        cfg = placement.plan(cfg, hw)
        # The port, the model folder and its length limit, the Turing clamp, host memory, the vLLM build and the
        # GPU's free memory: refused here with the failing check's line rather than by vLLM a minute into the start.
        ensure("start", cfg=cfg, hardware=hw, turing_target=turing_target)
        platform = hw.platform()
        cfg, max_len_note = fit_to_model(cfg, platform)
        argv = cfg.vllm_argv(platform)
        t0 = time.monotonic()
        proc = _launch(cfg, argv, platform)

    first_text = _wait_ready(cfg, proc, argv, t0, progress)
    startup_s = time.monotonic() - t0
    fields = engine_log.parse_engine_log(engine_log.read_text(cfg.log_file))
    if fields.embedding_method is None:
        fields.embedding_method = embedding_method(cfg.model)
    fields.eager = "--enforce-eager" in argv
    # After load and a first completion: the weights and the engine's buffers are resident.
    memory = host_memory(cfg.instance or "default", server_process_pids(proc.pid), cfg.model)
    if progress is not None:
        progress(1.0, f"serving {cfg.served_name} at {cfg.base_url}")
    return StartResult(pid=proc.pid, pgid=proc.pid, base_url=cfg.base_url, model=cfg.model,
                       served_name=cfg.served_name, platform=platform, argv=argv, log_path=str(cfg.log_file),
                       state_file=str(cfg.state_file), startup_s=round(startup_s, 2), first_completion=first_text,
                       start_fields=fields, max_model_len=cfg.max_model_len, max_model_len_note=max_len_note,
                       host_memory=memory)


__all__ = ["READINESS_PROMPT", "fit_to_model", "start_server"]
