"""How a detached, tracked vLLM server is started (tools.serving.server.server.start_server puts these steps
together): every check of a start, refused before launching when it cannot work, launched in its own process
session with its state file written, and ready when /health answers and a completion returns text; a failed
replace's way back (relaunch).

The server runs in its own process session (so it outlives the command that started it, and the API server and
its engine core form one process group that stop can end together) and writes to a log file.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
import httpx
import psutil

from tools.core import clock
from tools.core.api_key import API_KEY_ENV, api_key, auth_headers
from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.process import end_group, signals_deferred
from tools.core.progress import Progress
from tools.gpu.vram import host_memory, server_process_pids
from tools.serving.server import engine_log, health, readiness, switch_record
from tools.serving.records import files, identity, placement, state
from tools.serving.config import DEFAULT_ENV_FILE, ServeConfig, looks_like_path
from tools.serving.preflight.hardware import Hardware
from tools.serving.preflight.model_files import model_position_limit
from tools.serving.preflight.model_files import missing_model_fix
from tools.serving.preflight.steps import checks_for, ensure, refusal
from tools.serving.server.readiness import READINESS_PROMPT, Refusal
from tools.serving.server.results import StartResult
from tools.serving.server.guard import hand_over
from tools.serving.server.start_progress import StartProgress
from tools.serving.records.state import ReplaceRecord, ServerState
# The caller's variables that shape vLLM, recorded with the server so that a relaunch gets them again (tokens and
# the rest of the environment are not written to the state file).
_RECORDED_ENV = ("VLLM_", "CUDA_", "OMP_", "PYTORCH_", "TORCH", "KMP_", "LD_PRELOAD")
# The launched process waits for one byte on a pipe before it becomes vLLM (exec, same pid): written once the
# state file names it. A launching command killed before that (even by SIGKILL) closes the pipe, and the process
# exits instead of serving with nothing recording it.
_GATE = ("import os, signal, sys\n"
         "fd = int(sys.argv[1])\n"
         "go = os.read(fd, 1)\n"
         "os.close(fd)\n"
         "if go != b'1':\n"
         "    os._exit(1)\n"
         # the instance's cores (see _launch_cores): kept across exec, inherited by every process vLLM starts
         "if sys.argv[2]:\n"
         "    os.sched_setaffinity(0, {int(c) for c in sys.argv[2].split(',')})\n"
         # what Python ignores at its start, as Popen(restore_signals=True) gives it back before exec
         "for name in ('SIGPIPE', 'SIGXFZ', 'SIGXFSZ'):\n"
         "    if hasattr(signal, name):\n"
         "        signal.signal(getattr(signal, name), signal.SIG_DFL)\n"
         "os.execvp(sys.argv[3], sys.argv[3:])\n")
# OpenMP's own placement variables. libgomp (loaded with torch in vLLM's API server and engine core) binds the
# process's first thread to OMP_PLACES' first place when it loads: a caller's placement would put a bound
# instance's API server and engine core on those cores, whatever VLLM_CPU_OMP_THREADS_BIND says. vLLM sets them
# itself for its model worker, from VLLM_CPU_OMP_THREADS_BIND.
_OMP_PLACEMENT = ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY")




def end_launched(cfg: ServeConfig, proc: subprocess.Popen) -> None:
    """Ends a server this start launched, with its group, and removes its state file while it still names that
    server (read before the leader is reaped, when its pid cannot be another's): a start that fails or is
    interrupted leaves nothing behind, and forgets no other command's server. A second Ctrl-C waits for it."""
    with signals_deferred():
        try:
            own = state.load_state(cfg)
        except state.DamagedState:
            own = None
        end_group(proc.pid, grace_s=5, leader=proc)
        if own is not None and own.pid == proc.pid:
            state.clear_state(cfg, own)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


def refuse_recorded(cfg: ServeConfig) -> None:
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
    state.clear_state(cfg, recorded)  # left by a server that died: not an obstacle


def fit_to_model(cfg: ServeConfig, platform: str = "cuda") -> tuple[ServeConfig, str | None]:
    """Refuses a local model folder that does not exist; fits MAX_MODEL_LEN to the model's own limit.

    vLLM refuses a max_model_len above the model's max_position_embeddings, a minute into the start and behind
    a pydantic header. A value given for this start (option or environment) is a demand: refuse it now. A value
    from tpu.env is the deployment's preference for the real model: serve at the model's limit and say so.
    """
    if looks_like_path(cfg.model) and not Path(cfg.model).is_dir():
        where = "MODEL_NAME in " + str(cfg.env_file) if cfg.sources.get("model") == "file" else param("model")
        raise BadInput(f"model folder {cfg.model} does not exist ({where}): "
                       f"{missing_model_fix(cfg.model, platform)}", detail={"model": cfg.model})
    limit = model_position_limit(cfg.model)
    if limit is None or cfg.max_model_len <= limit:
        return cfg, None
    if cfg.given_for_this_start("max_model_len"):
        raise BadInput(f"max_model_len {cfg.max_model_len} is above the model's own limit "
                       f"(max_position_embeddings={limit} in {cfg.model}/config.json): pass at most {limit}",
                       detail={"max_model_len": cfg.max_model_len, "model_limit": limit})
    note = (f"MAX_MODEL_LEN {cfg.max_model_len} from {cfg.env_file} is above this model's limit: "
            f"serving at max_position_embeddings={limit}")
    return replace(cfg, max_model_len=limit), note


def recorded_env(cfg: ServeConfig, platform: str) -> dict[str, str]:
    """What of the launch environment the state file keeps: the caller's vLLM/CUDA/OpenMP variables and the
    server's own."""
    env = {k: v for k, v in os.environ.items() if k.startswith(_RECORDED_ENV) and k != API_KEY_ENV}
    env.update(cfg.server_env(platform))
    return _without_caller_placement(env, cfg, platform)


def _launch_cores(cfg: ServeConfig, platform: str) -> list[int] | None:
    """The cores a bound CPU instance's processes are confined to (all its ranks'), None for a server vLLM binds
    itself (the default instance alone, a GPU). vLLM binds only its model worker's OpenMP threads; its API server
    and engine core keep the affinity they inherit: launched from a process confined to the running instance's
    core, a beside start on 2 cores ran there and barely progressed under that instance's traffic. Every process
    of the instance gets the instance's cores instead, whatever its launcher runs on."""
    if platform != "cpu" or not cfg.cpu_cores:
        return None
    return sorted({c for rank in cfg.cpu_cores for c in rank})


def _without_caller_placement(env: dict[str, str], cfg: ServeConfig, platform: str) -> dict[str, str]:
    """`env` without OpenMP placement variables where the instance is bound to cores of its own (_OMP_PLACEMENT)."""
    if _launch_cores(cfg, platform) is None:
        return env
    return {k: v for k, v in env.items() if k not in _OMP_PLACEMENT}


def launch_server(cfg: ServeConfig, argv: list[str], platform: str,
                  env: dict[str, str] | None = None) -> subprocess.Popen:
    """Launches vLLM in its own session and writes the state file that names its group. `env`: a recorded
    environment (a relaunch) instead of this start's."""
    recorded = env if env is not None else recorded_env(cfg, platform)
    child_env = {k: v for k, v in os.environ.items() if not (env is not None and k.startswith(_RECORDED_ENV))}
    child_env.update(recorded)
    child_env = _without_caller_placement(child_env, cfg, platform)
    child_env.pop(API_KEY_ENV, None)
    if api_key():  # the key is this command's (never recorded): vLLM reads it from its environment
        child_env[API_KEY_ENV] = api_key() or ""
    token = identity.new_launch()
    child_env.update(identity.launch_env(token))
    cfg.instance_dir.mkdir(parents=True, exist_ok=True)
    proc: subprocess.Popen | None = None
    gate_r, gate_w = os.pipe()
    try:
        # Ctrl-C / SIGTERM wait until the state file names the new group (they are raised on leaving the
        # block, and the except below ends the group); a SIGKILL there closes the gate's pipe (see _GATE).
        with signals_deferred():
            with files.open_log(cfg.log_file) as log:  # one log per start: the parser reads this start only
                cores = ",".join(map(str, _launch_cores(cfg, platform) or []))
                proc = subprocess.Popen([sys.executable, "-c", _GATE, str(gate_r), cores, *argv], stdout=log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=child_env,
                                        cwd=str(cfg.instance_dir), start_new_session=True, pass_fds=(gate_r,))
            os.close(gate_r)
            gate_r = -1
            try:
                create_time = psutil.Process(proc.pid).create_time()
            except psutil.Error:
                create_time = time.time()
            now = clock.utc_now()
            state.write_state(cfg, ServerState(
                pid=proc.pid, pgid=proc.pid, create_time=create_time, launch=token, host=cfg.host, port=cfg.port,
                base_url=cfg.base_url, model=cfg.model, served_name=cfg.served_name, argv=argv, platform=platform,
                started_at=clock.iso(now), started_ts=now.timestamp(),
                log_path=str(cfg.log_file), instance=cfg.instance, gpus=cfg.gpus,
                gpu_memory_utilization=cfg.gpu_memory_utilization, cpu_cores=cfg.cpu_cores,
                tensor_parallel_size=cfg.tensor_parallel_size, data_parallel_size=cfg.data_parallel_size,
                env=recorded, door_port=cfg.door_port))
            os.write(gate_w, b"1")
    except BaseException:
        if proc is not None:
            end_launched(cfg, proc)
        raise
    finally:
        for fd in (gate_r, gate_w):
            if fd >= 0:
                os.close(fd)
    return proc


_KEPT_LOGS = 8  # an instance keeps the logs of its last launches (a failed B's beside the A started again)


def own_log(cfg: ServeConfig) -> ServeConfig:
    """`cfg` with a log file of this launch's own (created exclusively: never another server's), the oldest logs
    beyond the last _KEPT_LOGS removed unless the state file names them."""
    cfg.instance_dir.mkdir(parents=True, exist_ok=True)
    stamp = clock.file_stamp()
    for n in range(1, 1000):
        name = f"vllm-{stamp}-{os.getpid()}" + (f"-{n}" if n > 1 else "") + ".log"
        try:
            os.close(os.open(cfg.instance_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            break
        except FileExistsError:
            continue
    else:
        raise ToolFailure(f"no free log file name in {cfg.instance_dir}; remove its old vllm-*.log files")
    try:
        named = state.load_state(cfg)
    except state.DamagedState:
        named = None
    keep = {name, Path(named.log_path).name if named is not None else ""}
    logs = sorted(cfg.instance_dir.glob("vllm-*.log"), key=lambda f: f.name)
    for old in logs[:-_KEPT_LOGS]:
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return replace(cfg, log_name=name)


def wait_ready(cfg: ServeConfig, proc: subprocess.Popen, argv: list[str], t0: float,
               progress: Progress | None, *, keep_on_interrupt: bool = False) -> str:
    """Waits for /health and a first completion; on a failure or an interrupt ends the server it launched
    (keep_on_interrupt: an interrupt leaves it starting, recorded)."""
    log_path = cfg.log_file

    def fail(reason: str, refused: Refusal | None = None) -> ToolFailure:
        end_launched(cfg, proc)
        text = engine_log.read_text(log_path)
        kept = switch_record.keep_failed_log(cfg, log_path, cfg.served_name)  # a rollback rewrites log_path
        # A server that refused a request said why itself: its answer is the cause, not a line of its log.
        why = refused.line() if refused is not None else engine_log.explain_failure(text)
        msg = f"vLLM {reason}" + (f": {why}" if why else "") + f" (log: {kept or log_path})"
        return ToolFailure(msg, detail={"reason": reason, "explanation": why, "pid": proc.pid, "pgid": proc.pid,
                                        "log_tail": engine_log.tail(text, 40), "log_path": str(log_path),
                                        "argv": argv, "refusal": refused.to_dict() if refused else None,
                                        "parameter": refused.parameter if refused else None,
                                        "kept_log": str(kept) if kept else None})

    deadline = t0 + cfg.start_timeout_s
    healthy = False
    phases = StartProgress(progress)
    polls = 0
    with httpx.Client(timeout=5.0, headers=auth_headers()) as client:
        try:
            while True:
                code = proc.poll()
                if code is not None:
                    raise fail(f"exited with code {code} while starting")
                if time.monotonic() > deadline:
                    raise fail(f"did not become ready within {cfg.start_timeout_s:g} s")
                healthy = healthy or health.answers(cfg.base_url, client=client)
                if healthy:
                    text, refused = readiness.first_completion(client, cfg.base_url, cfg.served_name)
                    if text is not None and readiness.has_chat_template(cfg.model):
                        answered, refused = readiness.chat_warm_up(client, cfg.base_url, cfg.served_name)
                        text = text if answered else None
                    if refused is not None:  # it answers, and says no: waiting longer changes nothing
                        raise fail("answered but refused what clients send", refused)
                    if text is not None:
                        return text
                if progress is not None:
                    phases.poll(engine_log.read_text(log_path), healthy)
                polls += 1
                time.sleep(0.25 if polls < 8 else 1.0)  # a server up within seconds is not kept waiting
        except ToolFailure:
            raise
        except BaseException:  # Ctrl-C, SIGTERM, a cancelled job: leave no server behind, keep the exit status
            if not keep_on_interrupt:
                fail("start was interrupted")
            raise


def checked(cfg: ServeConfig, hw: Hardware, turing_target: Path | None, *,
            held_by: ServerState | None = None,
            hold: placement.Hold | None = None) -> tuple[ServeConfig, str | None, str, list[str]]:
    """Every check of a start, in its order: (the config as it will launch, the MAX_MODEL_LEN note, platform, the
    line of each check that warns: the start goes on, and its result says them as preflight would).
    `held_by`: the server this start is to replace, whose port and GPU memory are not obstacles (they are freed
    before the launch, and checked again then). `hold`: the placement lock the launch follows under, whose plan
    for cfg (made by a switch before) stands."""
    # Ports, cores and GPU memory other instances hold, and TP/DP against the GPUs: refused before launching.
    cfg = hold.plan(cfg, hw) if hold is not None else placement.plan(cfg, hw)
    # The API key beyond the loopback, the port, the model folder and its length limit, the Turing clamp, host memory, the vLLM build and the
    # GPU's free memory: refused here with the failing check's line rather than by vLLM a minute into the start.
    if held_by is None:
        checks = ensure("start", cfg=cfg, hardware=hw, turing_target=turing_target, placed=True)
    else:
        freed = {"gpu_memory"} | ({"port"} if held_by.port == cfg.port else set())
        checks = checks_for("start", cfg=cfg, hardware=hw, turing_target=turing_target, placed=True)
        for c in checks:
            if c.status == "fail" and c.name not in freed:
                raise refusal(c, {**(c.detail or {}), "check": c.name})
    platform = hw.platform()
    cfg, max_len_note = fit_to_model(cfg, platform)
    return cfg, max_len_note, platform, [c.line() for c in checks if c.status == "warn"]


def replace_note(cfg: ServeConfig, rec: ReplaceRecord) -> str:
    """What an unfinished replace did, and how to bring its A back (status and the next start say it)."""
    a = rec.a
    # --replace: a plain start where nothing serves, and A in B's place where B does; --env-file: the same
    # STATE_DIR and settings as the replace had
    env_file = {"env_file": str(cfg.env_file)} if cfg.env_file not in (None, DEFAULT_ENV_FILE.resolve()) else {}
    again = op("start", **env_file, **({"instance": cfg.instance} if cfg.instance else {}), model=a.model,
               served_name=a.served_name, port=a.port, replace=True)
    what = ("ended with neither build serving" if rec.phase == "failed"
            else f"was interrupted while {rec.phase}")
    return (f"a replace of {a.served_name} ({a.model}) by {rec.b_served_name} (pid {rec.owner_pid}, "
            f"{rec.started_at}) {what}; {a.served_name} was stopped: bring it back with {again} (its recorded "
            f"command line is in {state.replace_file(cfg)})")


def stale_replace(cfg: ServeConfig) -> ReplaceRecord | None:
    """This instance's replace record when its command is gone; refuses a start while another command's replace
    of this instance runs."""
    try:
        rec = state.load_replace(cfg)
    except ToolFailure:
        return None  # damaged: the start goes on, and replaces it when it succeeds
    if rec is None or (rec.phase != "failed" and rec.owner_pid == os.getpid()):
        return None  # none, or this process's own replace starting its B
    if state.replace_running(rec):
        raise ToolFailure(f"a replace of {rec.a.served_name} by {rec.b_served_name} runs on this instance (pid "
                          f"{rec.owner_pid}, {rec.phase}): wait for it, then check {op('status')}",
                          detail={"replace": rec.to_dict()})
    return rec


def remember_startup(cfg: ServeConfig, proc: subprocess.Popen, startup_s: float | None) -> None:
    """The start's time to ready in its record (a front door's hold is bounded by it), while the record is still
    this start's (the instance lock is held)."""
    own = state.load_state(cfg)
    if own is not None and own.pid == proc.pid and startup_s is not None:
        state.write_state(cfg, own.model_copy(update={"startup_s": startup_s}))


def start_result(cfg: ServeConfig, proc: subprocess.Popen, argv: list[str], platform: str, t0: float,
                 first_text: str, max_len_note: str | None, warnings: list[str]) -> StartResult:
    """What a start that is ready reports: its times, the fields its log recorded, its memory."""
    startup_s = time.monotonic() - t0
    fields = engine_log.recorded_start_fields(cfg.log_file, argv, cfg.model)
    # After load and a first completion: the weights and the engine's buffers are resident.
    memory = host_memory(cfg.instance or "default", server_process_pids(proc.pid), cfg.model)
    return StartResult(pid=proc.pid, pgid=proc.pid, base_url=cfg.base_url, model=cfg.model,
                       served_name=cfg.served_name, platform=platform, argv=argv, log_path=str(cfg.log_file),
                       state_file=str(cfg.state_file), startup_s=round(startup_s, 2), first_completion=first_text,
                       start_fields=fields, max_model_len=cfg.max_model_len, max_model_len_note=max_len_note,
                       host_memory=memory, warnings=warnings)


def config_of(cfg: ServeConfig, a: ServerState) -> ServeConfig:
    """The config `a` was started with, as far as its launch and readiness need it (its argv holds the rest)."""
    return replace(cfg, model=a.model, served_name=a.served_name, host=a.host, port=a.port, gpus=a.gpus,
                   gpu_memory_utilization=a.gpu_memory_utilization or cfg.gpu_memory_utilization,
                   cpu_cores=a.cpu_cores, tensor_parallel_size=a.tensor_parallel_size,
                   data_parallel_size=a.data_parallel_size)


def relaunch(cfg: ServeConfig, a: ServerState, *, progress: Progress | None = None,
             wait: bool = True) -> StartResult | None:
    """Starts `a` again with its own recorded command line and environment (a failed replace's way back), under
    the instance's lock (the replace's own hold). wait=False: launched and recorded, not waited for (an
    interrupted replace: status tells when it serves). An interrupt while it is waited for leaves it starting:
    the way back is not undone by a second Ctrl-C. It is the service that was running: handed over at its launch
    (the command's death, a SIGKILL included, does not end it, see server_guard.hand_over), and a replace record
    saying it was stopped goes once it is launched."""
    cfg_a = config_of(cfg, a)
    with state.instance_lock(cfg_a, f"start of {a.served_name} again"):
        with placement.locked(cfg_a):
            refuse_recorded(cfg_a)
            cfg_a = own_log(cfg_a)
            t0 = time.monotonic()
            hand_over(cfg_a.state_file)
            proc = launch_server(cfg_a, a.argv, a.platform,
                           env=a.env if a.env is not None else recorded_env(cfg_a, a.platform))
            _forget_replace_of(cfg_a, a)
            # the same build and command line: its last time to ready stands until this start has its own
            remember_startup(cfg_a, proc, a.startup_s)
        if not wait:
            return None
        first_text = wait_ready(cfg_a, proc, a.argv, t0, progress, keep_on_interrupt=True)
        res = start_result(cfg_a, proc, a.argv, a.platform, t0, first_text, None, [])
        remember_startup(cfg_a, proc, res.startup_s)
    return res


def _forget_replace_of(cfg: ServeConfig, a: ServerState) -> None:
    """Removes the instance's replace record when it names `a` as stopped: `a` is launched again (a failure of
    this start writes the record again, as "failed")."""
    try:
        rec = state.load_replace(cfg)
    except ToolFailure:
        return
    if rec is not None and rec.a.pid == a.pid and rec.a.create_time == a.create_time:
        state.clear_replace(cfg)


__all__ = ["READINESS_PROMPT", "checked", "config_of", "end_launched", "fit_to_model", "launch_server", "own_log",
           "recorded_env", "refuse_recorded", "relaunch", "remember_startup", "replace_note", "stale_replace",
           "start_result", "wait_ready"]
