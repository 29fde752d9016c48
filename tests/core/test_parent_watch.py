"""A child run under tools.core.parent_watch ends when the process that started it is killed (SIGKILL: no
clean-up of its own), as lm-eval and the sweep's benchmark worker do; it runs as `python -m MODULE ARGS` would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]

SLEEPER = '''
import json, os, sys, time
with open(os.environ["SLEEPER_OUT"], "w") as f:
    json.dump({"pid": os.getpid(), "argv": sys.argv[1:], "name": __name__}, f)
time.sleep(600)
'''

HOLDER = '''
import subprocess, sys, time
subprocess.Popen([sys.executable, "-m", "tools.core.parent_watch", "sleeper", "run", "--x", "1"],
                 start_new_session=True)
time.sleep(600)
'''


def test_the_child_ends_when_its_parent_is_killed(tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    out = tmp_path / "sleeper.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}", SLEEPER_OUT=str(out))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=str(tmp_path), env=env)
    child = None
    try:
        deadline = time.monotonic() + 60
        while not (out.is_file() and out.stat().st_size):
            assert holder.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        seen = json.loads(out.read_text())
        assert seen["argv"] == ["run", "--x", "1"] and seen["name"] == "__main__"
        child = psutil.Process(seen["pid"])
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        child.wait(30)  # raises TimeoutExpired when the child outlives its parent
    finally:
        if holder.poll() is None:
            holder.kill()
        if child is not None and child.is_running():
            child.kill()
