"""Processes: which one a recorded pid still is, ending a process group (the project's one group killer), who
holds a port, the environment of a Python child that runs this checkout, signals held over a block that must
not be cut short, and this process's stdout once its reader is gone."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import psutil

# A recorded start time matches when within this many seconds (psutil's clock and a state file's float).
_SAME_START_S = 1.0


def reap(pid: int) -> None:
    """Collects the exit status of a child of this process, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def is_running(proc: psutil.Process) -> bool:
    """Alive and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def same_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process of `pid` if it is still the one recorded (same pid AND start time) and alive; None when it is
    gone or the pid was recycled by an unrelated process."""
    reap(pid)
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > _SAME_START_S:
            return None
        return proc if is_running(proc) else None
    except psutil.Error:
        return None


def pid_recycled(pid: int, create_time: float) -> bool:
    """True when another process now has the recorded pid. Linux does not hand out a pid that is still some
    group's id, so the group of that number is then the newcomer's: nothing of it may be signalled."""
    try:
        return abs(psutil.Process(pid).create_time() - create_time) > _SAME_START_S
    except psutil.Error:
        return False


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of a process group. A pgid is not reused while any member lives, so these are ours."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and is_running(proc):
                members.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


class GroupEnd(NamedTuple):
    signal: str | None          # the last signal needed: SIGTERM, or SIGKILL after the grace period; None: none ran
    pids: list[int]             # the group's processes when it was asked to end
    remaining: list[int]        # those still there after SIGKILL (a process in uninterruptible sleep)


def end_group(pgid: int, grace_s: float = 10, *, leader: subprocess.Popen | int | None = None) -> GroupEnd:
    """SIGTERM to process group `pgid`, SIGKILL after `grace_s` to what is left. `leader`: the group's leader
    when this process started it (its Popen, or its pid), reaped on the way so it does not count as alive."""
    def collect() -> None:
        if isinstance(leader, subprocess.Popen):
            leader.poll()  # through Popen, so it keeps the exit status
        elif leader is not None:
            reap(leader)

    collect()
    members = group_members(pgid)
    pids = [p.pid for p in members]
    if not members:
        return GroupEnd(None, [], [])
    last = "SIGTERM"
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        collect()
        if not group_members(pgid):
            break
        time.sleep(0.1)
    else:
        last = "SIGKILL"
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        end = time.monotonic() + 10
        while time.monotonic() < end and group_members(pgid):
            collect()
            time.sleep(0.1)
    collect()
    return GroupEnd(last, pids, [p.pid for p in group_members(pgid)])


def kill_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """Ends a child started with start_new_session=True and everything it started (end_group on its group),
    and waits for it."""
    end_group(proc.pid, grace_s, leader=proc)
    proc.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing holds now, below the kernel's ephemeral range where it can be: a port
    from that range can become the local end of any process's outgoing connection before the server meant to
    listen on it binds it (a vLLM server binds tens of seconds after it is started)."""
    low = _ephemeral_low()
    if low > _FIRST_CHOSEN_PORT:
        for port in random.sample(range(_FIRST_CHOSEN_PORT, low), k=min(64, low - _FIRST_CHOSEN_PORT)):
            if port_holder(host, port) is None:
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_FIRST_CHOSEN_PORT = 10000


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; BSD and macOS use 49152


def port_holder(host: str, port: int) -> str | None:
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


def python_child_env(project_root: Path) -> dict[str, str]:
    """The environment of a Python child that runs this checkout's modules (`python -m tools...`) whatever its cwd:
    the caller's, with `project_root` first on PYTHONPATH and unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(project_root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


_DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
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


def stdout_gone() -> None:
    """This process's stdout once its reader has gone (a closed pipe): pointed at /dev/null, so that no later
    write, nor the interpreter's last flush, raises BrokenPipeError again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):  # stdout is no file descriptor (captured in-process): nothing to redirect
        pass


__all__ = ["GroupEnd", "end_group", "group_members", "is_running", "kill_group", "pid_recycled", "port_holder",
           "python_child_env", "reap", "same_process", "signals_deferred", "stdout_gone"]
