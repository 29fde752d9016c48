"""`./vllm-t4` or the switch process (tools.serving.frontdoor.switch_process) with the stand-in builds patched in, for tests
that run them as processes of their own:

    python -m tests.helpers.stand_ins.switch cli ARGS...      ./vllm-t4 ARGS, whose switch process is this module's
    python -m tests.helpers.stand_ins.switch switch REQUEST   the switch process

In both, vLLM is tests/helpers/stand_ins/vllm_server.py, the machine a CPU of two cores (as
tests.helpers.serving.TwoCores), and each
phase of the switch (frontdoor._step) that is reached leaves a file of its name in $STAND_IN_PHASES (when set);
at $STAND_IN_PAUSE_AT the switch waits $STAND_IN_PAUSE_S seconds, long enough for a test to signal it there, or
until the file $STAND_IN_GO exists."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tools.serving.frontdoor import door as frontdoor, switch_process
from tools.serving.config import ServeConfig
from tools.serving.preflight.hardware import Hardware

SWITCH = [sys.executable, "-m", "tests.helpers.stand_ins.switch", "switch"]


def _step(name: str) -> None:
    phases = os.environ.get("STAND_IN_PHASES")
    if phases:
        (Path(phases) / name.replace(" ", "-")).touch()
    if name == os.environ.get("STAND_IN_PAUSE_AT"):
        go = os.environ.get("STAND_IN_GO")  # a file: wait until the test creates it (at most a minute)
        deadline = time.monotonic() + (60 if go else float(os.environ.get("STAND_IN_PAUSE_S", "1")))
        while time.monotonic() < deadline and not (go and os.path.exists(go)):
            time.sleep(0.05)


def patch() -> None:
    ServeConfig.vllm_argv = lambda self, platform: stand_in_vllm.argv(  # type: ignore
        self.port, self.model, [self.served_name, *self.served_aliases])
    Hardware.platform = lambda self: "cpu"  # type: ignore[method-assign]
    Hardware.cpu_cores = lambda self: [0, 1]  # type: ignore[method-assign]
    frontdoor._step = _step
    switch_process.PROGRAM = SWITCH


if __name__ == "__main__":
    patch()
    if sys.argv[1] == "switch":
        raise SystemExit(switch_process.main(sys.argv[2:]))
    from tools import cli

    raise SystemExit(cli.main(sys.argv[2:]))
