"""What every `./vllm-t4` subcommand shares: one JSON object or text on stdout, one-line failures."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import subprocess
    from pathlib import Path

from tools.errors import ToolFailure


def emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    """Prints `obj` as one JSON object under --json, else the human-readable `text`."""
    if getattr(args, "json", False):
        print(json.dumps(obj.to_dict() if hasattr(obj, "to_dict") else obj, default=str))
    else:
        print(text)


def guard(name: str, func: Callable[[argparse.Namespace], int],
          status: Callable[[ToolFailure], int] = lambda exc: 1) -> Callable[[argparse.Namespace], int]:
    """Turns a ToolFailure into `vllm-t4 NAME: reason` on stderr (and the JSON error under --json); the exit
    status is `status(exc)` (1 unless the command says otherwise, e.g. 2 for bad input)."""
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ToolFailure as exc:
            if getattr(args, "json", False):
                print(json.dumps(exc.to_dict(), default=str))
            print(f"vllm-t4 {name}: {exc}", file=sys.stderr)
            return status(exc)
    return run


def kill_group(proc: "subprocess.Popen") -> None:
    """Ends a child started with start_new_session=True and everything it started: SIGTERM to its process
    group, SIGKILL after 10 s."""
    import os
    import signal
    import subprocess

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def python_child_env(project_root: "Path") -> dict[str, str]:
    """The environment of a Python child that runs this checkout's modules (`python -m tools...`) whatever its cwd:
    the caller's, with `project_root` first on PYTHONPATH and unbuffered output."""
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = str(project_root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
