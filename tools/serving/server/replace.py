"""Replacing the server of an instance with another build (start with replace=true) without losing the one it had.

B is checked before A is touched (the start's checks, the model folder, the port); then A is stopped and B
started; when B does not become ready, A is started again with its own recorded command line and environment.
What serves afterwards is the result's `outcome`, or the failure's `detail["outcome"]`, naming the builds by
their served names: "serving B", "restored A", "unchanged (A serves)" (B was refused before A was stopped) or
"unavailable (nothing serves)" (neither started; both failures in the detail). Every switch's end is recorded
(tools.serving.server.switch_record): `status` says it, and the log readers show B's kept log after a rollback. While
it runs, a replace record (state.ReplaceRecord) names A, so that a replace killed between A's stop and B's
readiness is reported by the next status and start, with the way to bring A back.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from tools.core import clock
from tools.core.errors import ToolFailure
from tools.core.process import signals_deferred
from tools.core.progress import Progress
from tools.serving.records import state
from tools.serving.server import switch_record
from tools.serving.config import ServeConfig
from tools.serving.preflight.hardware import Hardware
from tools.serving.server.launch import checked, relaunch
from tools.serving.server.results import StartResult
from tools.serving.records.state import ReplaceRecord, ServerState
from tools.serving.server.server import start_server, stop_server

UNAVAILABLE = "unavailable (nothing serves)"


def _serving(cfg: ServeConfig) -> ServerState | None:
    """The instance's recorded server when it is alive (a damaged state file is the start's to refuse)."""
    rec = state.load_state(cfg)
    if rec is None or state.leader(rec) is None:
        return None
    return rec


def _who(st: ServerState | ServeConfig) -> dict[str, Any]:
    d = {"model": st.model, "served_name": st.served_name, "base_url": st.base_url}
    if isinstance(st, ServerState):
        d["pid"] = st.pid
    return d


def _failure(exc: ToolFailure, outcome: str, tail: str, **detail: Any) -> ToolFailure:
    """`exc` with what serves now appended: the same class (bad input stays bad input), one line."""
    return type(exc)(f"{exc.message}; {tail}", {**(exc.detail or {}), "outcome": outcome, **detail},
                     field=getattr(exc, "field", None))


def target(cfg: ServeConfig) -> ServeConfig:
    """`cfg` as a replace serves it: on the running server's port unless a port was given for this start."""
    try:
        a = _serving(cfg)
    except ToolFailure:
        return cfg
    return replace(cfg, port=a.port) if a is not None and not cfg.given_for_this_start("port") else cfg


def replace_server(cfg: ServeConfig, *, progress: Progress | None = None, hardware: Hardware | None = None,
                   turing_target: Path | None = None, grace_s: float = 20.0) -> StartResult:
    """Serves `cfg`'s build (B) in place of the instance's running server (A); a plain start when none runs.

    Raises ToolFailure with `detail["outcome"]` when B does not serve; A then serves again ("restored A"),
    still serves ("unchanged (A serves)"), or could not be started again either ("unavailable (nothing
    serves)"); A and B are the builds' served names. The instance's lock is held from reading A to the end of the
    rollback: a second start, stop or replace of it is refused meanwhile."""
    with state.instance_lock(cfg, f"replace by {cfg.served_name}"):
        return _replace_locked(cfg, progress, hardware or Hardware(), turing_target, grace_s)


def _replace_locked(cfg: ServeConfig, progress: Progress | None, hw: Hardware, turing_target: Path | None,
                    grace_s: float) -> StartResult:
    a = _serving(cfg)
    began = time.time()
    try:
        res = _replace(cfg, a, hw, turing_target, grace_s, progress)
    except ToolFailure as exc:
        _record_switch(cfg, a, (exc.detail or {}).get("outcome") or UNAVAILABLE, str(exc), began)
        raise
    _record_switch(cfg, a, res.outcome, f"serving {res.served_name} at {res.base_url} (pid {res.pid})", began)
    return res


def _replace(cfg: ServeConfig, a: ServerState | None, hw: Hardware, turing_target: Path | None, grace_s: float,
             progress: Progress | None) -> StartResult:
    if a is None:
        res = start_server(cfg, progress=progress, hardware=hw, turing_target=turing_target)
        res.outcome = f"serving {cfg.served_name}"
        return res
    if not cfg.given_for_this_start("port"):
        cfg = replace(cfg, port=a.port)  # B takes A's place
    try:
        checked(cfg, hw, turing_target, held_by=a)
    except ToolFailure as exc:
        raise _failure(exc, f"unchanged ({a.served_name} serves)", f"{a.served_name} still serves (unchanged)",
                       serving=_who(a)) from None
    record = _record(cfg, a)
    state.write_replace(cfg, record)
    try:
        return _switch(cfg, a, record, hw, turing_target, grace_s, progress)
    except ToolFailure:
        raise
    except BaseException:  # Ctrl-C, SIGTERM, a cancelled job: A is launched again (not waited for), then it stands
        with signals_deferred():  # a second Ctrl-C waits until A is launched again
            _bring_back_detached(cfg, a, record)
        raise


def _switch(cfg: ServeConfig, a: ServerState, record: ReplaceRecord, hw: Hardware, turing_target: Path | None,
            grace_s: float, progress: Progress | None) -> StartResult:
    if progress is not None:
        progress(0.0, 1.0, f"stopping {a.served_name} (pid {a.pid}) for {cfg.served_name}")
    try:
        stop_server(cfg, grace_s=grace_s)
    except ToolFailure as exc:
        outcome = f"unchanged ({a.served_name} serves)" if _serving(cfg) is not None else UNAVAILABLE
        state.clear_replace(cfg)
        raise _failure(exc, outcome, f"stopping {a.served_name} for {cfg.served_name} failed") from None
    state.write_replace(cfg, record.model_copy(update={"phase": "starting B"}))
    try:
        res = start_server(cfg, progress=progress, hardware=hw, turing_target=turing_target)
    except ToolFailure as b_exc:
        raise _restore(cfg, a, record, b_exc, progress) from None
    state.clear_replace(cfg)
    res.outcome = f"serving {cfg.served_name}"
    res.replaced = _who(a)
    return res


def _restore(cfg: ServeConfig, a: ServerState, record: ReplaceRecord, b_exc: ToolFailure,
             progress: Progress | None) -> ToolFailure:
    """Starts A again after B failed; the failure to raise, saying what serves now."""
    state.write_replace(cfg, record.model_copy(update={"phase": "restoring A"}))
    if progress is not None:
        progress(0.0, 1.0, f"{cfg.served_name} did not start: starting {a.served_name} again")
    b = f"{cfg.served_name} did not start"
    try:
        back = relaunch(cfg, a, progress=progress)
    except ToolFailure as a_exc:
        state.write_replace(cfg, record.model_copy(update={"phase": "failed"}))
        return ToolFailure(f"{b} ({b_exc.message}); starting {a.served_name} again failed too ({a_exc.message}): "
                           "nothing serves on this instance",
                           {"outcome": UNAVAILABLE, "b_failure": b_exc.to_dict(), "a_failure": a_exc.to_dict(),
                            "a": _who(a)})
    except BaseException:  # interrupted while A starts again: A stays launched and recorded (status says when it
        with signals_deferred():  # serves), so the record of a stopped A would no longer be true
            again = _serving(cfg)
            if again is not None and again.served_name == a.served_name:
                state.clear_replace(cfg)
        raise
    state.clear_replace(cfg)
    return ToolFailure(f"{b} ({b_exc.message}); restored {a.served_name} (pid {back.pid}) at {back.base_url}",
                       {"outcome": f"restored {a.served_name}", "serving": {**_who(a), "pid": back.pid},
                        "b_failure": b_exc.to_dict()})


def _bring_back_detached(cfg: ServeConfig, a: ServerState, record: ReplaceRecord) -> None:
    """After an interrupt: what of A or B is left is ended, A launched again without waiting; the replace record
    stays when even that fails (status then says how to bring A back)."""
    with contextlib.suppress(ToolFailure):
        stop_server(cfg, grace_s=5)
    try:
        relaunch(cfg, a, wait=False)
    except ToolFailure:
        state.write_replace(cfg, record.model_copy(update={"phase": "failed"}))
        return
    state.clear_replace(cfg)


def _record_switch(cfg: ServeConfig, a: ServerState | None, outcome: str, message: str, began: float) -> None:
    """The switch's end, for `status` and the log readers (B's kept log when B's start failed in this switch)."""
    try:
        after = state.load_state(cfg)
    except ToolFailure:
        after = None
    failed = switch_record.newest_failed_log(cfg, cfg.served_name)
    if failed is not None and failed.stat().st_mtime < began:
        failed = None  # an earlier start's
    switch_record.write_switch(cfg, switch_record.SwitchRecord(
        at=clock.iso(), outcome=outcome,
        from_build=a.served_name if a is not None else None, to_build=cfg.served_name,
        from_model=a.model if a is not None else None, to_model=cfg.model,
        serving=after.served_name if after is not None and state.leader(after) is not None else None,
        message=message, failed_log=str(failed) if failed else None))


def _record(cfg: ServeConfig, a: ServerState) -> ReplaceRecord:
    me = psutil.Process(os.getpid())
    return ReplaceRecord(owner_pid=me.pid, owner_create_time=me.create_time(), phase="stopping A", a=a,
                         started_at=clock.iso(),
                         b_model=cfg.model, b_served_name=cfg.served_name)


__all__ = ["replace_server", "target"]
