"""Which process the project launched: every process it launches (a vLLM server, the router) carries a token of
its own launch in its environment, and its record the same token. That proves that a live pid (with the right
start time, group and user) is the program launched for that record, not a stranger a forged or stale record
names."""

from __future__ import annotations

import secrets
import time

import psutil

from tools.core import process

# SPT_NOENV keeps the environment readable: vLLM retitles its processes with setproctitle, which otherwise
# overwrites the environment that /proc/PID/environ shows.
LAUNCH_ENV = "GEMMA4_T4_LAUNCH"


def new_launch() -> str:
    """A fresh launch token, for the record of a process about to be launched."""
    return secrets.token_hex(16)


def launch_env(token: str) -> dict[str, str]:
    """The variables a launched process gets so that its record's identity check finds it."""
    return {LAUNCH_ENV: token, "SPT_NOENV": "1"}


def _settled_environ(proc: psutil.Process, wait_s: float) -> dict[str, str]:
    """`proc`'s environment, read again for up to `wait_s` while it shows empty: a process caught inside its exec
    shows none until the kernel has set up the new image's (its launcher's Popen may return by then), and so does
    one the kernel is tearing down (then it ends: read no longer). psutil's errors pass through."""
    deadline = time.monotonic() + wait_s
    while True:
        env = proc.environ()
        if env or time.monotonic() > deadline or not process.is_running(proc):
            return env
        time.sleep(0.01)


def carries(proc: psutil.Process, token: str) -> bool:
    """`proc`'s environment holds launch token `token` (False when unreadable or the token is empty)."""
    if not token:
        return False
    try:
        return _settled_environ(proc, 1.0).get(LAUNCH_ENV) == token
    except (psutil.Error, OSError):
        return False


def lacks(proc: psutil.Process, token: str) -> bool:
    """`proc` runs and does not carry launch token `token`. A process that ends meanwhile does not count: a leader
    just killed shows an empty environment, then none, while the kernel tears it down (a record of it is a dead
    server's, not a stranger's); a process that runs on with an empty environment does."""
    try:
        env = _settled_environ(proc, 2.0)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except (psutil.Error, OSError):
        return True  # unreadable: not shown to carry it
    return process.is_running(proc) and (not token or env.get(LAUNCH_ENV) != token)


def launched(proc: psutil.Process) -> bool:
    """`proc` was launched by the project (its environment holds a launch token, whichever)."""
    try:
        return bool(proc.environ().get(LAUNCH_ENV))
    except (psutil.Error, OSError):
        return False


def carried_by(pid: int, token: str) -> psutil.Process | None:
    """The live process of `pid` when it carries launch token `token`."""
    try:
        proc = psutil.Process(pid)
    except psutil.Error:
        return None
    return proc if process.is_running(proc) and carries(proc, token) else None


__all__ = ["LAUNCH_ENV", "carried_by", "carries", "lacks", "launch_env", "launched", "new_launch"]
