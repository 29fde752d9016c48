"""What a switch leaves behind for later: the log of every start that failed, kept beside the state
(STATE_DIR[/NAME]/logs/<build>-<UTC time>.log, the newest KEEP_FAILED of them), and the last switch's outcome
(STATE_DIR[/NAME]/last_switch.json), which `status` reports and the log readers follow to the failed build's log
after a rollback has started the old build again (and so rewritten the instance's live log)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from tools.core import clock
from tools.core.errors import ToolFailure
from tools.serving.server import engine_log
from tools.serving.config import ServeConfig
from tools.serving.records import files
from tools.serving.records.state import Record, read_record, write_record

KEEP_FAILED = 10  # failed starts' logs kept per instance; older ones are removed when a new one is kept


class SwitchRecord(Record):
    """The last switch (start with replace=true) of an instance and how it ended."""

    at: str                          # ISO 8601, UTC, when it ended
    outcome: str                     # the result's `outcome`: which build serves, named
    from_build: str | None = None    # the served name that served before (None: nothing served)
    to_build: str                    # the served name the switch was to serve
    from_model: str | None = None    # their model folders (or hub ids): a served name kept across builds hides
    to_model: str | None = None      # which build serves
    serving: str | None = None       # the served name serving after it (None: nothing)
    message: str = ""                # the switch's one line (its result, or its failure)
    failed_log: str | None = None    # the kept log of the start that failed, where one did
    figures: dict[str, Any] | None = None  # requests seen/failed and the longest wait, where a front door counted


def logs_dir(cfg: ServeConfig) -> Path:
    return cfg.instance_dir / "logs"


def switch_file(cfg: ServeConfig) -> Path:
    return cfg.instance_dir / "last_switch.json"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "build"


_STAMPED = r"-\d{8}T[\d.]+Z-failed\.log"  # what follows the build's _safe name in a kept log's name
_KEPT = re.compile(r"[A-Za-z0-9._-]+" + _STAMPED)  # any build's kept log


def keep_failed_log(cfg: ServeConfig, log_path: Path, served_name: str) -> Path | None:
    """Copies a failed start's log beside the state, named by build and time; None when there was no log or it
    could not be copied (the failure it belongs to is reported either way)."""
    if not log_path.is_file():
        return None
    folder = logs_dir(cfg)
    stamp = clock.file_stamp()
    dest = folder / f"{_safe(served_name)}-{stamp}-failed.log"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if folder.is_symlink():  # a link would take the copy, and the pruning below, out of STATE_DIR
            return None
        with open(log_path, "rb") as src, files.open_log(dest) as out:
            shutil.copyfileobj(src, out)
    except (OSError, ToolFailure):
        return None
    # only the logs kept here (build, time stamp, -failed.log), never another file that folder may hold
    kept = [p for p in folder.iterdir() if _KEPT.fullmatch(p.name) and p.is_file() and not p.is_symlink()]
    for old in sorted(kept, key=lambda p: p.stat().st_mtime)[:-KEEP_FAILED]:
        old.unlink(missing_ok=True)
    return dest


def newest_failed_log(cfg: ServeConfig, served_name: str) -> Path | None:
    own = re.compile(re.escape(_safe(served_name)) + _STAMPED)
    logs = sorted(p for p in logs_dir(cfg).glob("*-failed.log") if own.fullmatch(p.name))
    return logs[-1] if logs else None


def write_switch(cfg: ServeConfig, record: SwitchRecord) -> None:
    cfg.instance_dir.mkdir(parents=True, exist_ok=True)
    write_record(switch_file(cfg), record)


def load_switch(cfg: ServeConfig) -> SwitchRecord | None:
    """The last switch, None when none was made (or its record is damaged: a report, never an obstacle)."""
    try:
        return read_record(switch_file(cfg), SwitchRecord)
    except ToolFailure:
        return None


def describe(rec: SwitchRecord, serving_now: bool = True) -> str:
    """The last switch in one clause, for `status`; `serving_now` False (nothing serves any more: stopped since,
    or died) tells its outcome as the past it is."""
    stopped = rec.message.startswith("interrupted")  # stopped by a signal or a cancel: B did not fail
    outcome = rec.outcome if serving_now else (
        f"{rec.serving or 'nothing'} served after it; nothing serves now")
    text = (f"last switch ({rec.at}) from {rec.from_build or 'nothing'} to {rec.to_build}: "
            f"{'interrupted; ' if stopped else ''}{outcome}")
    if rec.from_model or rec.to_model:
        text += f"; builds: {rec.from_model or 'none'} -> {rec.to_model or '?'}"
    if rec.failed_log:
        text += f"; {rec.to_build}'s {'interrupted' if stopped else 'failed'} start log: {rec.failed_log}"
    return text


def failed_log_section(cfg: ServeConfig, lines: int) -> str | None:
    """After a switch that failed: its failed start's log tail under a header line, for the log readers (the
    instance's live log is the restored build's by then). None when the last switch did not fail."""
    rec = load_switch(cfg)
    if rec is None or not rec.failed_log:
        return None
    path = Path(rec.failed_log)
    text = engine_log.read_text(path)
    if not text:
        return None
    how = "interrupted" if rec.message.startswith("interrupted") else "failed"
    return (f"--- the {how} start of {rec.to_build} in the last switch ({rec.at}), kept at {path} ---\n"
            + engine_log.tail(text, lines))


__all__ = ["KEEP_FAILED", "SwitchRecord", "describe", "failed_log_section", "keep_failed_log", "load_switch",
           "logs_dir", "newest_failed_log", "switch_file", "write_switch"]
