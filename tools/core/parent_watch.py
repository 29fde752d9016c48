"""`python -m tools.core.parent_watch MODULE [ARGS...]`: MODULE run as `python -m MODULE ARGS...`, ended with
its process group when the process that started it is gone.

A child started in a session of its own (so that it can be stopped with everything it started) outlives a parent
killed with SIGKILL, which can run no clean-up: lm-eval would go on sending its requests to the server for the
rest of its task, the sweep's benchmark worker would finish its cell into a folder a resumed sweep measures again.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import threading
import time


def end_with_parent(interval_s: float = 0.5) -> None:
    """Watches the parent from a daemon thread; SIGKILL to this process's group once it is gone. Call it in a
    process that leads its own group (start_new_session=True), first thing, while the parent is surely alive."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m tools.core.parent_watch MODULE [ARGS...]")
    end_with_parent()
    module = sys.argv[1]
    del sys.argv[1]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
