"""Child processes: ending a process group, and the environment of a Python child that runs this checkout."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def kill_group(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """Ends a child started with start_new_session=True and everything it started: SIGTERM to its process
    group, SIGKILL after `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def python_child_env(project_root: Path) -> dict[str, str]:
    """The environment of a Python child that runs this checkout's modules (`python -m tools...`) whatever its cwd:
    the caller's, with `project_root` first on PYTHONPATH and unbuffered output."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(project_root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


__all__ = ["kill_group", "python_child_env"]
