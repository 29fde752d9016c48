"""Ends what a test run started, however the run ends.

A vLLM server or router a test starts leads a session of its own (as the product's do: `./vllm-t4 start` hands
its server over), so a test runner killed by SIGTERM or SIGKILL runs no fixture teardown and leaves them
running, reparented to init. `start(config)` (from tests/conftest.py's pytest_configure, or `-p tests.helpers.reaper`)
adds this run's id to RUN_ENV in the runner's environment, which every process the run starts inherits (xdist
workers, commands, vLLM's own processes, daemons that left the process tree), and starts a watcher in a
session of its own: `python -m tests.helpers.reaper RUN PID CREATE_TIME`. Once the runner's process is gone, by
whatever end, the watcher kills every process whose environment names the run, and exits. A process started
with an environment of its own that drops RUN_ENV is not the run's: it is left alone, as a stranger would be.
SPT_NOENV=1 in the run's environment keeps setproctitle from writing a process title over the environment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

RUN_ENV = "GEMMA4_T4_TEST_RUN"  # space-separated ids: a run started inside a test run carries both
_ROOT = Path(__file__).resolve().parents[2]


def start(config) -> None:
    """Marks this run and starts its watcher. In an xdist worker nothing: the controller's watcher covers it."""
    if hasattr(config, "workerinput"):
        return
    run = uuid.uuid4().hex[:16]
    os.environ[RUN_ENV] = " ".join(filter(None, (os.environ.get(RUN_ENV, ""), run)))
    # setproctitle (vllm-router, vLLM's engine) writes a long title over the environment, the mark with it, unless
    # SPT_NOENV is set: as the product sets it for what it launches (tools.serving.records.identity.launch_env)
    os.environ["SPT_NOENV"] = "1"
    me = os.getpid()
    env = {k: v for k, v in os.environ.items() if k != RUN_ENV}  # the watcher is not a process of the run
    env["PYTHONPATH"] = str(_ROOT)
    subprocess.Popen([sys.executable, "-m", "tests.helpers.reaper", run, str(me), str(start_ticks(me))],
                     cwd=str(_ROOT), env=env, start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_configure(config) -> None:  # as a plugin: `pytest -p tests.helpers.reaper`
    start(config)


def runs_of(proc) -> list[str]:
    """The run ids in a process's environment ([] where it has none, or cannot be read)."""
    import psutil

    try:
        return proc.environ().get(RUN_ENV, "").split()
    except (psutil.Error, OSError):
        return []


def reap(run: str) -> list[int]:
    """SIGKILL to every process of `run` (its process group where it leads one); the pids signalled."""
    import psutil

    killed: list[int] = []
    # A process being killed can start another in between, and one whose environment could not be read a moment
    # (exec, load) is found on a later look: look again until two looks a second apart find none, for up to 30 s.
    deadline, quiet = time.monotonic() + 30, 0
    while quiet < 2 and time.monotonic() < deadline:
        try:
            victims = [p for p in psutil.process_iter() if p.pid != os.getpid() and run in runs_of(p)]
        except Exception:  # noqa: BLE001 - a table changing under the scan: scan again
            victims = [None]
        quiet = 0 if victims else quiet + 1
        for p in victims:
            if p is None:
                continue
            try:
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
            except OSError:
                pass
        time.sleep(0.2 if victims else 1.0)
    return killed


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat): unlike psutil's create_time, which is
    derived from the wall clock's boot time, a step of the wall clock does not move it. None: no such process, or
    a zombie (its runner has ended)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[19])


def watch(run: str, pid: int, ticks: int, interval_s: float = 0.5) -> None:
    while start_ticks(pid) == ticks:
        time.sleep(interval_s)
    reap(run)


if __name__ == "__main__":
    watch(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
