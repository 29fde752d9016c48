"""Background jobs for long tool calls, and the one-long-operation-at-a-time rule.

MCP clients differ in how long they wait for a tool call (Codex defaults to 60 s, Gemini CLI to 10 min): a
repack of the real checkpoint or a full sweep takes longer. The server therefore runs any long tool either in the
foreground (streaming progress notifications until it finishes) or as a job: `start_job` returns at once with a
job id, `job_status` reports state, progress and, once done, the same structured result the foreground call
returns.

Jobs live in this process (module state, not MCP session state: sessions come and go, the vLLM server and a
running repack do not) and die with it: job ids carry a per-process prefix, so an id from an earlier server
process is answered "lost: the server restarted" rather than "no job". Waiting for a job is asynchronous (an
event set from the job's thread): any number of waiting clients hold no worker thread. Long operations share one machine (2 CPU cores or one T4) and one vLLM server, so only
one runs at a time, foreground or background; a second is refused with the name of the one running.
Cancelling is cooperative: the job's progress callback raises `JobCancelled` at the next progress report, and the
library beneath cleans up as it does on any error.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

from tools.core.errors import ToolFailure
from tools.core.progress import Progress
from tools.core.text import clip

class JobCancelled(Exception):
    """Raised inside a job's work at its next progress report after cancel_job. Not a failure: it must pass
    every `except ToolFailure` in the library on its way out, as KeyboardInterrupt does."""


class Busy(ToolFailure):
    """Another long operation is running."""


class JobState(str, Enum):
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


class JobInfo(BaseModel):
    job_id: str
    tool: str = Field(description="The tool this job runs; its result has that tool's output schema")
    arguments: dict[str, Any]
    state: JobState
    progress: float = 0.0
    total: float | None = None
    message: str = ""
    started_at: float = Field(description="Unix time")
    finished_at: float | None = None
    elapsed_s: float
    result: dict[str, Any] | None = Field(None, description="The tool's structured result, once succeeded")
    error: str | None = Field(None, description="One-line error, once failed")
    error_detail: dict[str, Any] | None = Field(None, description="The error's machine-readable detail, as a "
                                                                 "direct call's error result carries it")


class _Job:
    def __init__(self, job_id: str, tool: str, arguments: dict[str, Any]) -> None:
        self.job_id, self.tool, self.arguments = job_id, tool, arguments
        self.state = JobState.running
        self.progress, self.total, self.message = 0.0, None, "starting"
        self.started_at, self.finished_at = time.time(), None
        self.result: dict[str, Any] | None = None
        self.error: str | None = None
        self.error_detail: dict[str, Any] | None = None
        self.cancel_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def info(self) -> JobInfo:
        end = self.finished_at or time.time()
        return JobInfo(job_id=self.job_id, tool=self.tool, arguments=self.arguments, state=self.state,
                       progress=self.progress, total=self.total, message=self.message,
                       started_at=self.started_at, finished_at=self.finished_at,
                       elapsed_s=round(end - self.started_at, 3), result=self.result, error=self.error,
                       error_detail=self.error_detail)


JOB_ID = re.compile(r"^job-([0-9a-f]{6})-\d+$")


class JobRegistry:
    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._busy: str | None = None  # description of the long operation running now
        self._busy_job: str | None = None  # its job id when it runs as a job (else a direct call)
        self._ids = itertools.count(1)
        self.boot = secrets.token_hex(3)  # this server process's job-id prefix
        self._foreground: set[threading.Event] = set()

    def _refuse_if_busy(self) -> None:
        # (under self._lock) job_status and cancel_job follow jobs only: a direct call is waited for
        if self._busy is None:
            return
        if self._busy_job is not None:
            raise Busy(f"{self._busy} is running; wait for it (job_status job_id={self._busy_job}) or cancel it "
                       f"(cancel_job) first")
        raise Busy(f"{self._busy} is running (a direct call, not a job); call again once it has returned (start_job "
                   f"runs a long tool as a job that job_status follows and cancel_job stops)")

    @contextmanager
    def exclusive(self, what: str) -> Iterator[threading.Event]:
        """Hold the single long-operation slot for `what`, or raise Busy naming the holder. Yields the event
        that cancel_all() sets (a foreground call's progress callback checks it)."""
        with self._lock:
            self._refuse_if_busy()
            self._busy, self._busy_job = what, None
            cancel = threading.Event()
            self._foreground.add(cancel)
        try:
            yield cancel
        finally:
            with self._lock:
                self._busy = self._busy_job = None
                self._foreground.discard(cancel)

    def submit(self, tool: str, arguments: dict[str, Any],
               work: Callable[[Progress], BaseModel | dict[str, Any]]) -> JobInfo:
        """Run `work(progress)` in a thread as a job; refuse if another long operation is running."""
        with self._lock:
            self._refuse_if_busy()
            job = _Job(f"job-{self.boot}-{next(self._ids)}", tool, arguments)
            self._busy, self._busy_job = f"{tool} ({job.job_id})", job.job_id
            self._jobs[job.job_id] = job

        def progress(done: float, total: float | None, message: str) -> None:
            if job.cancel_event.is_set():
                raise JobCancelled(f"{job.job_id} cancelled")
            job.progress, job.total, job.message = float(done), (None if total is None else float(total)), message

        def run() -> None:
            try:
                out = work(progress)
                job.result = out.model_dump(mode="json") if isinstance(out, BaseModel) else dict(out)
                if job.cancel_event.is_set():  # cancelled after its last progress report: never "succeeded"
                    job.state, job.message = JobState.cancelled, "cancelled after the work had ended: see result"
                else:
                    job.state, job.message = JobState.succeeded, "done"
            except JobCancelled:
                job.state, job.message = JobState.cancelled, "cancelled"
            except BaseException as exc:  # reported through job_status, never lost in a thread
                job.state = JobState.failed
                job.error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                detail = getattr(exc, "detail", None)
                job.error_detail = detail if isinstance(detail, dict) else None
                job.message = "failed"
                job.traceback = traceback.format_exc()  # type: ignore[attr-defined]
            finally:
                job.finished_at = time.time()
                with self._lock:
                    self._busy = self._busy_job = None
                    waiters, job.waiters = job.waiters, []
                    job.done.set()
                for loop, event in waiters:
                    try:
                        loop.call_soon_threadsafe(event.set)
                    except RuntimeError:  # that waiter's loop is closed
                        pass

        job.thread = threading.Thread(target=run, name=job.job_id, daemon=True)
        job.thread.start()
        return job.info()

    def get(self, job_id: str) -> JobInfo:
        job = self._jobs.get(job_id)
        if job is None:
            m = JOB_ID.match(job_id)
            if m and m.group(1) != self.boot:
                raise KeyError(f"job {clip(job_id)} is lost: the server restarted (jobs live only as long as the "
                               f"server process); start it again with start_job")
            known = ", ".join(self._jobs) or "none"
            raise KeyError(f"no job {clip(job_id)!r} (known jobs: {known})")
        return job.info()

    def wait(self, job_id: str, timeout: float | None = None) -> JobInfo:
        """Block the calling thread until the job ends or `timeout` passes (command-line and test use)."""
        self.get(job_id)
        self._jobs[job_id].done.wait(timeout)
        return self._jobs[job_id].info()

    async def wait_async(self, job_id: str, timeout: float) -> JobInfo:
        """Wait in the event loop, holding no thread, until the job ends or `timeout` passes."""
        self.get(job_id)
        job = self._jobs[job_id]
        event = asyncio.Event()
        with self._lock:
            if job.done.is_set():
                return job.info()
            entry = (asyncio.get_running_loop(), event)
            job.waiters.append(entry)
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                if entry in job.waiters:
                    job.waiters.remove(entry)
        return job.info()

    def cancel(self, job_id: str) -> JobInfo:
        info = self.get(job_id)
        if info.state == JobState.running:
            self._jobs[job_id].cancel_event.set()
            self._jobs[job_id].message = "cancelling at the next progress report"
        return self._jobs[job_id].info()

    def list(self) -> list[JobInfo]:
        return [j.info() for j in self._jobs.values()]

    def cancel_all(self) -> list[threading.Thread]:
        """Cancel every running job and foreground call (server shutdown); returns the job threads to join."""
        with self._lock:
            for event in self._foreground:
                event.set()
            running = [j for j in self._jobs.values() if j.state == JobState.running]
        for job in running:
            job.cancel_event.set()
        return [j.thread for j in running if j.thread is not None]
