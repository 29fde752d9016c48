"""Cancelling a long job reaches its work at any phase, and a cancelled job never ends `succeeded`.

lm-eval is stood in for by a child that prints nothing (as lm-eval does while it loads or builds contexts) and
ignores nothing: `_run_lm_eval` runs it exactly as it runs lm-eval (own process group, output read, progress
passed on), so the mechanism under test is the one a real eval job uses; no lm-eval run is needed. The 10 s
bound is the promise itself (a heartbeat of a second, a kill grace of five)."""

from __future__ import annotations

import os
import sys
import threading

import psutil
import pytest

from tools.mcp.jobs import JobRegistry, JobState
from tools.measure.evals import run as evals
from tools.measure.evals.results import EvalParams

QUIET_CHILD = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"]


def _child_pid(log, timeout_s: float = 30) -> int:
    """The stand-in's pid once it printed it into the log (it then prints nothing more)."""
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        words = log.read_text().split() if log.exists() else []
        if len(words) > 1 and words[-1].isdigit():
            return int(words[-1])
        time.sleep(0.05)
    raise AssertionError("the stand-in never started")


def test_cancel_reaches_a_quiet_lm_eval_within_seconds(tmp_path):
    reg = JobRegistry()
    log = tmp_path / "lm_eval.log"
    log.write_text("$ stand-in\n")
    job = reg.submit("run_eval", {}, lambda progress: {"rc": evals._run_lm_eval(QUIET_CHILD, tmp_path, log, 600,
                                                                                 progress)[0]})
    pid = _child_pid(log)
    reg.cancel(job.job_id)
    info = reg.wait(job.job_id, timeout=10)
    assert info.state == JobState.cancelled, info
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_job_cancelled_after_its_last_report_does_not_end_succeeded():
    reg = JobRegistry()
    go = threading.Event()

    def work(progress):  # reports once, then finishes whatever happens meanwhile
        progress(1, 2, "half")
        go.wait(30)
        return {"written": True}

    job = reg.submit("run_eval", {}, work)
    reg.cancel(job.job_id)
    go.set()
    info = reg.wait(job.job_id, timeout=30)
    assert info.state == JobState.cancelled and info.result == {"written": True}, info


def test_a_cancelled_eval_writes_no_run_folder(tmp_path, monkeypatch):
    """Cancelled once lm-eval has ended: the last report before publishing refuses, the temporary folder goes."""
    from tools.mcp.jobs import JobCancelled

    cancelled = threading.Event()

    def progress(done, total, msg):
        if cancelled.is_set():
            raise JobCancelled("cancelled")

    def finished_lm_eval(cmd, include, log_path, timeout_s, progress):
        lm = log_path.parent / "lm_eval" / "m"
        lm.mkdir(parents=True)
        (lm / "results_2026-01-01T00-00-00.json").write_text(
            '{"results": {"t": {"acc,none": 1.0, "acc_stderr,none": 0.0}}, "n-samples": {"t": {"effective": 1}}}')
        cancelled.set()  # the cancel arrives while lm-eval's results are read
        return 0, 1.0

    monkeypatch.setattr(evals, "_run_lm_eval", finished_lm_eval)
    monkeypatch.setattr(evals, "_lm_eval_command", lambda plan, lm_dir: ["lm-eval"])
    monkeypatch.setattr(evals, "_plan", lambda params, cfg: _stand_in_plan(params, tmp_path))
    monkeypatch.setattr(evals, "_provenance", lambda *a: {})
    out = tmp_path / "ev"
    with pytest.raises(JobCancelled):
        evals.run_eval(EvalParams(tasks=["t"], out=str(out)), progress)
    assert os.listdir(out) == []


def _stand_in_plan(params, tmp_path):
    fields = {f: None for f in evals._Plan.__dataclass_fields__}
    fields.update(params=params, model="m", base_url="http://x", version="0", include=tmp_path)
    return evals._Plan(**fields)
