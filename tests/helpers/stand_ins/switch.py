"""`./vllm-t4` or the switch process (tools.serving.frontdoor.switch_process) with the stand-in builds patched in, for tests
that run them as processes of their own:

    python -m tests.helpers.stand_ins.switch cli ARGS...      ./vllm-t4 ARGS, whose switch process is this module's
    python -m tests.helpers.stand_ins.switch switch REQUEST   the switch process

In both, vLLM is tests/helpers/stand_ins/vllm_server.py, the machine a CPU of two cores (as
tests.helpers.serving.TwoCores), and each
phase of the switch (frontdoor._step) that is reached leaves a file of its name in $STAND_IN_PHASES (when set);
at $STAND_IN_PAUSE_AT the switch waits $STAND_IN_PAUSE_S seconds, long enough for a test to signal it there, or
until the file $STAND_IN_GO exists. With $STAND_IN_COUNTS set, the process writes there at its exit (JSON) how
many times it planned a build's place (placement.plan) and read the router's state file (router_state.load)."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tools.serving.frontdoor import door as frontdoor, switch_process
from tools.serving.records import placement, router_state
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


def count_calls(into: dict[str, int], put: Any = setattr) -> None:
    """Counts into `into` each plan of a build's place ("plan") and each read of the router's state file
    ("router_load") in this process from now on (`put`: a test's monkeypatch.setattr, undone after it)."""
    plan, load = placement.plan, router_state.load

    def counted_plan(*args: Any, **kw: Any) -> Any:
        into["plan"] = into.get("plan", 0) + 1
        return plan(*args, **kw)

    def counted_load(*args: Any, **kw: Any) -> Any:
        into["router_load"] = into.get("router_load", 0) + 1
        return load(*args, **kw)

    put(placement, "plan", counted_plan)
    put(router_state, "load", counted_load)


def patch() -> None:
    ServeConfig.vllm_argv = lambda self, platform: stand_in_vllm.argv(  # type: ignore
        self.port, self.model, [self.served_name, *self.served_aliases])
    Hardware.platform = lambda self: "cpu"  # type: ignore[method-assign]
    Hardware.cpu_cores = lambda self: [0, 1]  # type: ignore[method-assign]
    frontdoor._step = _step
    switch_process.PROGRAM = SWITCH
    if os.environ.get("STAND_IN_COUNTS"):
        counts = {"plan": 0, "router_load": 0}
        count_calls(counts)
        atexit.register(lambda: Path(os.environ["STAND_IN_COUNTS"]).write_text(json.dumps(counts)))


if __name__ == "__main__":
    patch()
    if sys.argv[1] == "switch":
        raise SystemExit(switch_process.main(sys.argv[2:]))
    from tools import cli

    raise SystemExit(cli.main(sys.argv[2:]))
