"""Job tools: run a long tool in the background and follow it (tools/mcp/jobs.py holds the registry)."""

from __future__ import annotations

from typing import Any, Literal

import anyio.to_thread
from pydantic import BaseModel, Field, ValidationError, create_model

from tools.core.params import OpParams
from tools.mcp.errors import argument_error
from tools.mcp.jobs import JobInfo
from tools.mcp.registry import Reply, tool


class JobList(BaseModel):
    jobs: list[JobInfo] = Field(description="Every job of this server process, oldest first")


@tool(toolset="jobs", title="List jobs", result=JobList, read_only=True, idempotent=True)
async def list_jobs(app, p) -> Reply:
    """Every job started with start_job in this server process, with state and progress; use it to find a job
    id again."""
    jobs = app.jobs.list()
    running = [j.job_id for j in jobs if j.state == "running"]
    return Reply(JobList(jobs=jobs), f"{len(jobs)} job(s), running: {', '.join(running) or 'none'}")


class JobStatusParams(OpParams):
    job_id: str = Field(description="The job_id start_job returned")
    wait_s: float = Field(0, ge=0, le=600, description="Wait up to this long for the job to finish")


def _job_summary(info: JobInfo) -> str:
    tail = f": {info.error}" if info.error else (f" ({info.message})" if info.message else "")
    return f"{info.job_id} {info.tool} {info.state.value} after {info.elapsed_s:.0f} s{tail}"


@tool(toolset="jobs", title="Job status", params=JobStatusParams, result=JobInfo, read_only=True, idempotent=True)
async def job_status(app, p: JobStatusParams) -> Reply:
    """State, progress and, once done, the result (the tool's own structured result) or the one-line error of
    a job; wait_s waits for it to finish without polling."""
    info = await app.jobs.wait_async(p.job_id, p.wait_s) if p.wait_s else app.jobs.get(p.job_id)
    return Reply(info, _job_summary(info))


class JobIdParams(OpParams):
    job_id: str = Field(description="The job to cancel")


@tool(toolset="jobs", title="Cancel a job", params=JobIdParams, result=JobInfo, destructive=True, idempotent=True)
async def cancel_job(app, p: JobIdParams) -> Reply:
    """Ask a running job to stop at its next progress report; the library removes its partial output and
    stops a vLLM server it was starting."""
    info = app.jobs.cancel(p.job_id)
    return Reply(info, _job_summary(info))


class StartJobParams(OpParams):
    tool: str = Field(description="The long tool to run")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Its arguments, as for a direct call")

    @classmethod
    def for_app(cls, app) -> type[OpParams]:
        """`tool` offers exactly the long tools this server lists (their declarations say they are long)."""
        names = tuple(sorted(n for n, s in app.specs.items() if s.long))
        if not names:
            return cls
        return create_model("StartJobParams", __base__=cls,
                            tool=(Literal[names], Field(description="The long tool to run")))  # type: ignore[valid-type]


@tool(toolset="jobs", title="Run a long tool as a background job", params=StartJobParams, result=JobInfo,
      destructive=True, open_world=True)
async def start_job(app, p: StartJobParams) -> Reply:
    """Start a long tool without waiting, for clients whose tool calls time out: returns a job_id at once;
    follow it with job_status. Jobs live in this server process and die with it (a restart loses them)."""
    spec = app.specs.get(p.tool)
    if spec is None or not spec.long:
        raise ValueError(f"{p.tool[:80]} is not a long tool of this server")
    model = spec.params
    try:
        params = model.from_mcp_args(p.arguments)
    except ValidationError as exc:
        raise argument_error(exc, p.tool) from None
    checked = None
    if spec.check is not None:  # refused now, as a direct call is, and the job runs with what was checked
        checked = await anyio.to_thread.run_sync(lambda: spec.check(app, params))
    info = app.jobs.submit(p.tool, params.model_dump(mode="json", exclude_none=True, exclude_defaults=True),
                           lambda progress: app.run_job_work(spec, params, progress, checked))
    return Reply(info, _job_summary(info))
