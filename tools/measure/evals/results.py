"""An lm-eval run's parameters and results, and a comparison's: the models the command line's flags and the MCP
tools' arguments are derived from, the summary rows read from lm-eval's results, and the paths an MCP caller may
name kept inside its roots."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, Field, field_validator

from tools.core.errors import BadInput
from tools.core.names import RULE, is_name
from tools.core.paths import PathNotAllowed
from tools.core.text import clip
from tools.core.params import OpParams, Seconds
from tools.core.root import PROJECT_ROOT
from tools.measure.endpoint import EndpointParams

DEFAULT_OUT = PROJECT_ROOT / "evidence"
TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"  # the project's own task definitions



class EvalParams(EndpointParams):
    """One lm-eval run against a live OpenAI-compatible server."""

    tasks: list[str] = Field(description="lm-eval task or group names, comma separated (e.g. arc_easy,hellaswag), "
                                         "from lm-eval's registry or the include folder")
    include_path: str | None = Field(None, description="folder of extra lm-eval task YAMLs (default: the "
                                                       "project's tools/measure/tasks); relative data files in "
                                                       "them resolve against this folder")
    limit: int | None = Field(None, ge=1, description="score at most this many documents per task (default: all)")
    num_fewshot: int | None = Field(None, ge=0, description="few-shot examples per prompt (default: each task's "
                                                            "own)")
    label: str = Field("build", description="name of the build; goes into the run folder name and the tables")
    out: str = Field(str(DEFAULT_OUT), description="folder that receives the run folder")
    model: str | None = Field(None, description="served model name (default: the first of /v1/models)")
    tokenizer: str | None = Field(None, description="tokenizer folder or hub id (default: the folder the server "
                                                    "loaded)")
    apply_chat_template: bool = Field(False, description="wrap prompts in the model's chat template (for tasks "
                                                         "written for chat models)")
    num_concurrent: int = Field(8, ge=1, le=64, description="requests in flight (the T4 setup serves 8 at once)")
    timeout_s: Seconds = Field(24 * 3600.0, description="stop lm-eval after this many seconds")

    # The tokenizer defaults to the folder the server loaded; a local path from a client would escape the roots.
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"timeout_s", "tokenizer"})
    MCP_DEFAULTS: ClassVar[dict[str, Any]] = {"out": "."}  # the first evidence root
    CLI_COMMA: ClassVar[frozenset[str]] = frozenset({"tasks"})

    @field_validator("tasks", mode="before")
    @classmethod
    def _split_tasks(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, (list, tuple)):
            v = [t.strip() for item in v for t in str(item).split(",") if t.strip()]
            if not v:
                raise ValueError("give at least one task name")
            for t in v:  # a task name is also looked up as a file of the include folder
                if len(t.encode()) > 255 or "\0" in t:
                    raise ValueError(f"task name {clip(t, 40)!r} is not a task name (at most 255 bytes, no NUL)")
        return v

    @field_validator("label")
    @classmethod
    def _label(cls, v: str) -> str:
        if not is_name(v):  # pydantic reports a ValueError as the field's error
            raise ValueError(f"label {clip(repr(v))} {RULE}")
        return v


class EvalCompareParams(OpParams):
    """Eval runs to put side by side; the first is the reference."""

    runs: list[str] = Field(min_length=2, description="evidence folders written by `eval`, the reference first")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("runs",)


class TaskScore(BaseModel):
    task: str = Field(description="lm-eval task name")
    metric: str = Field(description="metric name, e.g. acc, acc_norm, exact_match")
    filter: str = Field("none", description="lm-eval filter the metric was computed after")
    value: float | None = Field(description="the metric over the scored documents")
    stderr: float | None = Field(None, description="lm-eval's standard error of the value")
    n: int | None = Field(None, description="documents scored")
    n_total: int | None = Field(None, description="documents in the task's split")
    num_fewshot: int | None = Field(None, description="few-shot examples per prompt")
    version: str | None = Field(None, description="the task's version")
    higher_is_better: bool | None = None


class EvalResult(BaseModel):
    run_id: str = Field(description="name of the run folder")
    run_dir: str = Field(description="the evidence folder")
    label: str
    model: str | None = Field(None, description="served model name")
    base_url: str
    tasks: list[str] = Field(description="tasks as requested")
    scores: list[TaskScore] = Field(default_factory=list, description="one row per task, metric and filter")
    limit: int | None = None
    num_fewshot: int | None = None
    lm_eval_version: str | None = None
    started: str
    finished: str | None = None
    wall_s: float | None = Field(None, description="wall time of lm-eval")
    command: list[str] = Field(default_factory=list, description="the lm-eval command line")
    files: dict[str, str] = Field(default_factory=dict, description="evidence files by kind")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class RunInfo(BaseModel):
    label: str
    run_dir: str
    model: str | None = None
    checkpoint_config_sha256: str | None = None


class EvalDiff(BaseModel):
    task: str
    metric: str
    filter: str = "none"
    values: list[float | None] = Field(description="the metric of each run, in run order")
    stderrs: list[float | None] = Field(description="lm-eval's stderr of each run's value")
    n: list[int | None] = Field(description="documents each run scored")
    candidate: str = Field(description="label of the run compared with the reference")
    diff: float | None = Field(None, description="candidate minus reference")
    diff_stderr: float | None = Field(None, description="standard error of the difference")
    paired: bool = Field(False, description="true when diff and its stderr come from per-document differences")
    n_paired: int | None = Field(None, description="documents both runs scored")
    within_noise: bool | None = Field(None, description="|diff| < 2 x diff_stderr (or both runs agree on every "
                                                        "document)")
    note: str | None = None


class EvalComparison(BaseModel):
    runs: list[RunInfo] = Field(description="the runs, reference first")
    rows: list[EvalDiff] = Field(default_factory=list, description="one row per task, metric and candidate")
    markdown: str = Field("", description="the side-by-side table")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ----------------------------------------------------------------------------------------------------------
# Summaries


def scores_from_results(results: dict[str, Any]) -> list[TaskScore]:
    """Rows of lm-eval's results JSON: one per task, metric and filter (stderr next to its metric)."""
    rows: list[TaskScore] = []
    n_samples = results.get("n-samples") or {}
    versions = results.get("versions") or {}
    shots = results.get("n-shot") or {}
    hib = results.get("higher_is_better") or {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            if key == "alias" or "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            ns = n_samples.get(task) or {}
            rows.append(TaskScore(
                task=task, metric=metric, filter=filt,
                value=float(value) if isinstance(value, (int, float)) else None,
                stderr=float(stderr) if isinstance(stderr, (int, float)) else None,
                n=ns.get("effective"), n_total=ns.get("original"),
                num_fewshot=shots.get(task) if isinstance(shots.get(task), int) else None,
                version=str(versions[task]) if task in versions and versions[task] is not None else None,
                higher_is_better=(hib.get(task) or {}).get(metric)))
    return rows


def fmt(v: float | None, digits: int = 4) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def summary_markdown(res: EvalResult) -> str:
    head = (f"# lm-eval: {res.label} ({res.model})\n\n"
            f"lm-eval {res.lm_eval_version}, limit {res.limit or 'all'}, few-shot "
            f"{res.num_fewshot if res.num_fewshot is not None else 'task default'}, greedy, {res.base_url}\n\n"
            "| task | metric | filter | value | stderr | n | shots | version |\n"
            "|---|---|---|---:|---:|---:|---:|---|\n")
    body = "".join(f"| {s.task} | {s.metric} | {s.filter} | {fmt(s.value)} | {fmt(s.stderr)} | "
                   f"{s.n if s.n is not None else '—'} | {s.num_fewshot if s.num_fewshot is not None else '—'} | "
                   f"{s.version or '—'} |\n" for s in res.scores)
    return head + body


# ----------------------------------------------------------------------------------------------------------
# Paths inside the MCP server's roots


def confine_eval_params(params: EvalParams, roots: Any) -> EvalParams:
    """For callers that must keep paths inside configured roots (the MCP server): `roots` is a tools Roots.

    The include folder must be the project's own tasks folder or lie under an evidence or models root; the output
    folder under an evidence root. Raises ToolFailure naming the path and the roots.
    """
    p = params.model_copy()
    try:
        p.out = str(roots.confine(params.out, "evidence", what="out"))
        if params.include_path is not None:
            inc = Path(os.path.realpath(Path(params.include_path).expanduser()))
            if inc != TASKS_DIR and TASKS_DIR not in inc.parents:
                try:
                    inc = roots.confine(params.include_path, "evidence", must_exist=True, what="include_path")
                except PathNotAllowed as first:
                    try:
                        inc = roots.confine(params.include_path, "models", must_exist=True, what="include_path")
                    except PathNotAllowed:
                        raise first from None
            p.include_path = str(inc)
    except PathNotAllowed as exc:
        raise BadInput(str(exc), {"roots": roots.describe() if hasattr(roots, "describe") else None}) from exc
    return p


def confine_compare_params(params: EvalCompareParams, roots: Any) -> EvalCompareParams:
    """Run folders to compare must lie under an evidence root (see confine_eval_params)."""
    try:
        runs = [str(roots.confine(r, "evidence", must_exist=True, what="run")) for r in params.runs]
    except PathNotAllowed as exc:
        raise BadInput(str(exc), {"roots": roots.describe() if hasattr(roots, "describe") else None}) from exc
    return EvalCompareParams(runs=runs)
