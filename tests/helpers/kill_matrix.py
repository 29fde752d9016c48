"""What every kill-matrix test shares: the three signals and the exit status each must give, running a command
until a phase and signalling it there, how a command signalled with SIGINT or SIGTERM must end, and whether the
processes it owned ended with it. The stand-in servers the matrices run commands against are
tests/helpers/stand_ins/measure.py's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import psutil

from tests.helpers.fixtures import ROOT, default_signals
from tools.measure import evidence

SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143), "SIGKILL": (signal.SIGKILL, -9)}


def all_gone(pids: list[int], wait_s: float = 20) -> bool:
    """Whether every process in `pids` ended (a zombie counts) within `wait_s`; those still running are killed, so
    that a failing test leaves none."""
    left = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            proc.wait(wait_s)
        except psutil.NoSuchProcess:
            continue
        except psutil.TimeoutExpired:
            if proc.status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
                proc.kill()
    return not left


def cli(argv: list[str], env: dict[str, str] | None = None, *, driver: list[str] | None = None) -> subprocess.Popen:
    """`./vllm-t4 ARGV` started (or `python -c DRIVER... ARGV`), stderr captured as text."""
    head = driver or ["-m", "tools.cli"]
    return subprocess.Popen([sys.executable, *head, *argv], cwd=ROOT,
                            env=env or dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)


def signal_when(proc: subprocess.Popen, reached: Callable[[], bool], sig: str, what: str, *,
                timeout_s: float = 90, settle: Callable[[], None] | None = None) -> str:
    """Waits until `reached()` (the command still running), calls `settle`, sends `sig`; returns the command's
    stderr once it has ended. The command is killed if the test fails first."""
    try:
        deadline = time.monotonic() + timeout_s
        while not reached():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, f"the command never reached {what}"
            time.sleep(0.02)
        if settle is not None:
            settle()
        proc.send_signal(SIGNALS[sig][0])
        return proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def assert_ended(sig: str, rc: int, err: str) -> None:
    """The exit status of `sig`, no traceback, and after SIGINT or SIGTERM one last line saying how it ended."""
    assert rc == SIGNALS[sig][1], err
    assert "Traceback" not in err, err
    if sig != "SIGKILL":
        last = err.strip().splitlines()[-1]  # after the progress lines
        assert last == f"vllm-t4: {'interrupted' if sig == 'SIGINT' else 'terminated'}", err


def assert_swept_by_the_next_write(out: Path) -> None:
    """A SIGKILL runs no clean-up: its `.partial` folder is in `out`, and the next write there sweeps it."""
    assert [p.name for p in out.iterdir() if ".partial" in p.name]
    evidence.write_json(out / "next.json", {"ok": True})
    assert os.listdir(out) == ["next.json"]
