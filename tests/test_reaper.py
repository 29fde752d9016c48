"""A test run killed by SIGTERM leaves no server of its own running (tests/helpers/reaper.py), and signals no stranger.

A run of pytest (in a process of its own, with the reaper as its plugin) starts a test that launches a stand-in vLLM
server and the real vllm-router over it the way the product does (each a session of its own) and a daemon that left
the process tree (double fork, reparented to init), then sleeps. The test here sends that pytest SIGTERM, as a CI
service or a user's `kill` would: no fixture teardown runs. Every process of the run is gone afterwards (the router
too once it has set its process title, which wrote over its environment and the run's mark in it); a stranger
started beside it (without the run's environment) still runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers import reaper
from tests.helpers.fixtures import ROOT, default_signals, free_port

INNER = '''
import os, subprocess, sys, time
from pathlib import Path
from tests.helpers.stand_ins import vllm_server as stand_in_vllm

def test_leaves_servers_behind(tmp_path):
    model = tmp_path / "build"
    model.mkdir()
    stand_in_vllm.build(model)
    server = subprocess.Popen(stand_in_vllm.argv(int(os.environ["PROBE_PORT"]), str(model)),
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # the real vllm-router over it, launched as the front door launches it (a session of its own)
    router = subprocess.Popen([str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1",
                               "--port", os.environ["PROBE_ROUTER_PORT"], "--prometheus-host", "127.0.0.1",
                               "--prometheus-port", os.environ["PROBE_METRICS_PORT"],
                               "--worker-urls", "http://127.0.0.1:" + os.environ["PROBE_PORT"]],
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    # once it has set its title (setproctitle), which may write over its environment: the run's mark with it
    while not Path(f"/proc/{router.pid}/cmdline").read_bytes().startswith(b"vllm::router"):
        time.sleep(0.05)
    # a daemon: fork, new session, fork again; the grandchild writes its pid and sleeps, reparented to init
    daemon = subprocess.run([sys.executable, "-c",
        "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    if os.fork() == 0:\\n"
        "        open(os.environ['PROBE_DAEMON'], 'w').write(str(os.getpid()))\\n        time.sleep(600)\\n"
        "    os._exit(0)\\n"])
    while not Path(os.environ["PROBE_DAEMON"]).exists():
        time.sleep(0.05)
    daemon_pid = Path(os.environ["PROBE_DAEMON"]).read_text()
    Path(os.environ["PROBE_PIDS"]).write_text(f"{server.pid} {router.pid} {daemon_pid}")
    time.sleep(600)
'''


def _wait_for(path: Path, proc: subprocess.Popen, limit_s: float = 120.0) -> str:
    deadline = time.monotonic() + limit_s
    while not (path.exists() and path.read_text().strip()):
        assert proc.poll() is None, f"the inner pytest ended first: {proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, f"the inner test did not start its servers within {limit_s} s"
        time.sleep(0.1)
    time.sleep(0.1)  # the writer's last byte
    return path.read_text()


def _gone(pid: int, limit_s: float = 30.0) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def _described(pid: int) -> str:
    try:
        p = psutil.Process(pid)
        return f"{pid} {p.cmdline()[:3]} runs {reaper.runs_of(p)} in session {os.getsid(pid)}"
    except (psutil.Error, OSError) as exc:
        return f"{pid} ({type(exc).__name__})"


def test_sigterm_of_a_test_run_leaves_none_of_its_servers_running(tmp_path):
    inner = tmp_path / "test_inner.py"
    inner.write_text(INNER)
    pids_file, daemon_file = tmp_path / "pids", tmp_path / "daemon"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PROBE_PORT=str(free_port()), PROBE_ROUTER_PORT=str(free_port()),
               PROBE_METRICS_PORT=str(free_port()), PROBE_PIDS=str(pids_file), PROBE_DAEMON=str(daemon_file))
    stranger_env = {k: v for k, v in env.items() if k != reaper.RUN_ENV}
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=stranger_env,
                                start_new_session=True)
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                            "-p", "tests.helpers.reaper", "-c", os.devnull, "--rootdir", str(tmp_path),
                            "--basetemp", str(tmp_path / "inner-tmp"), str(inner)],
                           cwd=str(ROOT), env=env, preexec_fn=default_signals, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    left: list[int] = []
    try:
        left = [int(p) for p in _wait_for(pids_file, run).split()]
        assert all(psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in left)  # all three running
        run.send_signal(signal.SIGTERM)
        run.wait(timeout=60)
        still = [p for p in left if not _gone(p)]
        assert not still, f"processes of the killed run still running: {[_described(p) for p in still]}"
        assert stranger.poll() is None, "the reaper signalled a process that was not the run's"
    finally:
        for p in [*left, stranger.pid]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        stranger.wait()
        if run.poll() is None:
            run.kill()
            run.wait()


def test_the_watcher_waits_for_its_runner_whatever_the_wall_clock_does(monkeypatch):
    """psutil's create_time moves when the wall clock is stepped (seen here: 66 s): the watcher, which reaped the
    run at once when it did (before the run's servers had started, so they were left running), identifies its
    runner by its start in ticks since boot, and reaps only once the runner has ended."""
    import threading

    calls = iter(range(10**6))
    monkeypatch.setattr(psutil.Process, "create_time", lambda self: 1.0e9 + next(calls))  # a clock stepping
    runner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    reaped: list[str] = []
    monkeypatch.setattr(reaper, "reap", lambda run: reaped.append(run) or [])
    try:
        ticks = reaper.start_ticks(runner.pid)
        assert ticks is not None and reaper.start_ticks(runner.pid) == ticks
        watcher = threading.Thread(target=reaper.watch, args=("run-1", runner.pid, ticks, 0.05), daemon=True)
        watcher.start()
        time.sleep(1.0)
        assert watcher.is_alive() and reaped == []  # its runner still runs
    finally:
        runner.kill()
        runner.wait()
    watcher.join(timeout=10)
    assert not watcher.is_alive() and reaped == ["run-1"]
    assert reaper.start_ticks(runner.pid) is None
