"""A front end's switch (`./vllm-t4 router switch`, MCP switch_build) in a process of its own:
`python -m tools.serving.frontdoor.switch_process REQUEST`, started in a session of its own and tied to nothing of its
parent's, so that the switch ends as frontdoor.switch ends it whatever happens to the front end.

A front end killed with SIGKILL (a closed terminal, an MCP client that drops its server) runs no clean-up; had the
switch run inside it, the front door would be left half-switched: in hold mode nothing behind the router, beside
it a new build serving outside the router or an old one never stopped. Run here, the switch carries on to its end
alone (B serving, or A back if B fails) and the front door is left with one build behind the router, the router's
state naming it. Ctrl-C or SIGTERM of the front end (an MCP cancellation) is passed on as one SIGINT, the switch
rolls back as it does in-process, and the front end waits for that; a second Ctrl-C does not cut the wait short.

REQUEST is a JSON object {"cfg": ServeConfig.to_dict(), "b": ..., "from_instance": ...}. The process writes one
JSON object a line on stdout: {"progress": [fraction, message]} as the switch reports, then one of
{"result": SwitchResult}, {"failure": {"message", "detail", "field", "module", "class"}} (the ToolFailure, so that
the front end raises the same kind) or {"interrupted": true}. Its stderr goes to STATE_DIR/switch.log. While it
runs, STATE_DIR/switch.lock names it (router_state.switching): another switch or `router stop` is refused.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

from tools.core.commands import CLI
from tools.core.errors import ToolFailure, op, render
from tools.core.jsonout import dumps, object_of
from tools.core.process import python_child_env
from tools.core.progress import Progress
from tools.core.root import PROJECT_ROOT
from tools.serving.frontdoor import door as frontdoor
from tools.serving.config import ServeConfig
from tools.serving.frontdoor.door import Figures, SwitchResult
from tools.core.process import signals_deferred
from tools.serving.records import files
from tools.serving.server import switch_record

# The command that runs the switch (REQUEST appended); tests run it with their stand-in builds patched in.
PROGRAM = [sys.executable, "-m", "tools.serving.frontdoor.switch_process"]


def log_file(cfg: ServeConfig) -> Path:
    return Path(cfg.state_dir) / "switch.log"


def switch(cfg: ServeConfig, b: ServeConfig, *, from_instance: str | None = None,
           progress: Progress | None = None) -> SwitchResult:
    """frontdoor.switch run by a switch process: its progress passed to `progress`, its result returned, its
    ToolFailure raised again (same class, message, detail and field). An exception here (KeyboardInterrupt,
    Terminated, a cancellation raised by `progress`) sends the process one SIGINT, waits until its rollback is
    done and is raised again."""
    request = dumps({"cfg": cfg.to_dict(), "b": b.to_dict(), "from_instance": from_instance})
    log = log_file(cfg)
    log.parent.mkdir(parents=True, exist_ok=True)
    with files.open_log(log, "ab") as err:
        proc = subprocess.Popen([*PROGRAM, request], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                env=python_child_env(PROJECT_ROOT), start_new_session=True)
    last: dict[str, Any] | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            msg = object_of(line)
            if "progress" in msg:
                if progress is not None:
                    progress(*msg["progress"])
            elif msg:
                last = msg
        proc.wait()
    except BaseException as exc:
        with signals_deferred():  # a second Ctrl-C does not cut the rollback's wait short
            if isinstance(exc, KeyboardInterrupt):  # a person at a terminal: told at once what happens
                _say(interrupted_line(proc.pid))
            _interrupt(proc)
            if isinstance(exc, KeyboardInterrupt):
                _say(ended_line(cfg))
        raise
    return _outcome(last, proc, log)


def interrupted_line(pid: int) -> str:
    """What an interrupted switch does, said when the interrupt comes (the rollback may take minutes)."""
    return (f"vllm-t4: interrupt received: the switch (pid {pid}) ends safely, the build that served before keeps "
            "or takes back the front door (unless the new one already has the traffic); waiting for it to finish, "
            f"a second Ctrl-C does not cut this short; then check {op('status')}")


def ended_line(cfg: ServeConfig) -> str:
    """How the interrupted switch ended, as its record says."""
    try:
        rec = switch_record.load_switch(replace(cfg, instance=""))
    except ToolFailure:
        rec = None
    said = switch_record.describe(rec) if rec is not None else "no switch record was written"
    return f"vllm-t4: the switch ended: {said}"


def _say(line: str) -> None:
    """A line for the person at the terminal whose Ctrl-C interrupted the switch: commands spelled as they type
    them (`./vllm-t4 status`)."""
    try:
        print(render(line, CLI), file=sys.stderr, flush=True)
    except (OSError, ValueError):  # no terminal left to tell: the switch still ends as it does
        pass


def _interrupt(proc: subprocess.Popen) -> None:
    """One SIGINT to the switch process, then its output read to the end (it must not block on a full pipe) and
    its exit waited for."""
    try:
        proc.send_signal(signal.SIGINT)
    except ProcessLookupError:
        pass
    assert proc.stdout is not None
    for _ in proc.stdout:
        pass
    proc.wait()


def _outcome(last: dict[str, Any] | None, proc: subprocess.Popen, log: Path) -> SwitchResult:
    if last is not None and "result" in last:
        data = dict(last["result"])
        data["figures"] = Figures(**data["figures"])
        return SwitchResult(**data)
    if last is not None and "failure" in last:
        raise _failure(last["failure"])
    if last is not None and last.get("interrupted"):
        raise KeyboardInterrupt
    raise ToolFailure(f"the switch process (pid {proc.pid}) ended with status {proc.returncode} and no result "
                      f"(its log: {log}); check what serves with {op('router.status')}",
                      {"pid": proc.pid, "returncode": proc.returncode, "log": str(log)})


def _failure(f: dict[str, Any]) -> ToolFailure:
    """The switch's ToolFailure as the same class where it can be found; ToolFailure otherwise."""
    cls: Any = ToolFailure
    try:
        found = getattr(importlib.import_module(str(f.get("module"))), str(f.get("class")))
        if isinstance(found, type) and issubclass(found, ToolFailure):
            cls = found
    except (ImportError, AttributeError, ValueError):
        pass
    try:
        return cls(f["message"], f.get("detail"), field=f.get("field"))
    except TypeError:  # a class of another signature
        return ToolFailure(f["message"], f.get("detail"), field=f.get("field"))


# ---------------------------------------------------------------------------------------------- the process itself

class _Out:
    """The protocol's lines on the stdout this process was given; once the front end is gone (a broken pipe),
    nothing more is written and the switch goes on."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    def send(self, obj: dict[str, Any]) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, (dumps(obj) + "\n").encode())
        except OSError:
            self.fd = None


def _signals() -> None:
    """SIGINT and SIGTERM interrupt the switch once (it rolls back); later ones, and SIGHUP, are let go: whatever
    the front end was started with ignored, this process takes its own."""
    interrupted = []

    def on_signal(signum: int, frame: object) -> None:
        if not interrupted:
            interrupted.append(signum)
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGHUP, lambda signum, frame: None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _signals()
    out = _Out(os.dup(1))
    os.dup2(2, 1)  # anything printed goes to the log, never into the protocol
    req = json.loads(argv[0])
    cfg = ServeConfig.from_dict(req["cfg"])
    try:
        res = frontdoor.switch(cfg, ServeConfig.from_dict(req["b"]), from_instance=req.get("from_instance"),
                               progress=lambda done, total, msg: out.send({"progress": [done, total, msg]}))
    except ToolFailure as exc:
        out.send({"failure": {"message": exc.message, "detail": exc.detail, "field": exc.field,
                              "module": type(exc).__module__, "class": type(exc).__qualname__}})
        return 1
    except KeyboardInterrupt:
        out.send({"interrupted": True})
        return 130
    except Exception as exc:  # a fault of the switch itself: its traceback in the log
        traceback.print_exc()
        out.send({"failure": {"message": f"the switch failed ({type(exc).__name__}: {exc}); its traceback is in "
                                         f"{log_file(cfg)}", "detail": None, "field": None,
                              "module": "tools.core.errors", "class": "ToolFailure"}})
        return 1
    out.send({"result": res.to_dict()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
