"""Accuracy with EleutherAI's lm-evaluation-harness against a live vLLM server, saved as evidence.

`run_eval` drives `python -m lm_eval run --model local-completions` in a subprocess (never imported here: it
pulls torch, datasets and friends, and a subprocess can be timed, killed and survive a crash). local-completions
scores loglikelihoods through /v1/completions with `echo` and `logprobs` on tokenized prompts, so the tokenizer
is the served model's own folder, loaded offline; generation is greedy (temperature 0).

Evidence folder (`<out>/<stamp>-eval-<label>-<hash>/`), written under a temporary name and renamed at the end so
that a failed or interrupted run leaves nothing half-written:
  lm_eval/<model>/results_*.json, samples_<task>_*.jsonl   lm-eval's own results and per-sample records
  lm_eval.log                                              lm-eval's console output
  summary.json, summary.md                                 task, metric, value, stderr, n per row
  provenance.json                                          machine, server, checkpoint hash, lm-eval, task versions

`compare_evals` puts runs side by side per task and metric; each later run is compared with the first, the
difference paired over the documents both scored (lm-eval's per-sample records, matched by doc_id and checked by
doc_hash), with the standard error of that paired difference and a within-noise verdict (|diff| < 2 stderr).

Task YAMLs in an include folder may name local data (`dataset_path: json`, `dataset_kwargs.data_files`):
relative paths there resolve against the include folder, which is lm-eval's working directory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, ClassVar

import httpx
from pydantic import BaseModel, Field, ValidationError, field_validator

from tools.core.process import kill_group, python_child_env
from tools.core.errors import BadInput, ToolFailure
from tools.core.params import OpParams
from tools.serving.endpoint import EndpointParams, resolve_endpoint
from tools.core.root import PROJECT_ROOT
from repack.tiny_model import FIRST_BYTE_ID, pattern_permutation
from tools.core.text import clip
from tools.measure import provenance as prov_mod
from tools.serving.config import load_config

DEFAULT_OUT = PROJECT_ROOT / "evidence"
TASKS_DIR = Path(__file__).resolve().parent / "tasks"  # the project's own task definitions
Progress = Callable[[int, int, str], None]


# ----------------------------------------------------------------------------------------------------------
# Parameters and results


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
    timeout_s: float = Field(24 * 3600.0, gt=0, description="stop lm-eval after this many seconds")

    # The tokenizer defaults to the folder the server loaded; a local path from a client would escape the roots.
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"timeout_s", "tokenizer"})
    MCP_DEFAULTS: ClassVar[dict[str, Any]] = {"out": "."}  # the first evidence root
    CLI_COMMA: ClassVar[frozenset[str]] = frozenset({"tasks"})
    CLI_BAD_INPUT: ClassVar[type[Exception] | None] = BadInput

    @field_validator("tasks", mode="before")
    @classmethod
    def _split_tasks(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, (list, tuple)):
            v = [t.strip() for item in v for t in str(item).split(",") if t.strip()]
            if not v:
                raise ValueError("give at least one task name")
        return v

    @field_validator("label")
    @classmethod
    def _label(cls, v: str) -> str:
        if not v or not re.fullmatch(r"[A-Za-z0-9._+-]+", v):
            raise ValueError(f"label {v!r} must be a non-empty name of letters, digits, . _ + -")
        return v


class CompareParams(OpParams):
    """Eval runs to put side by side; the first is the reference."""

    runs: list[str] = Field(min_length=1, description="evidence folders written by `eval`, the reference first")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("runs",)
    CLI_BAD_INPUT: ClassVar[type[Exception] | None] = BadInput


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
# Running lm-eval


def lm_eval_version() -> str | None:
    try:
        return importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        return None


def _default_base_url() -> str:
    return load_config().base_url


def _server(base_url: str):
    try:
        return prov_mod.server_info(base_url)
    except (httpx.HTTPError, ValueError) as exc:
        raise ToolFailure(f"no vLLM server answers at {base_url} ({type(exc).__name__}); start one with "
                          f"./vllm-t4 start or pass --base-url", {"base_url": base_url}) from exc


def _arg_safe(what: str, value: str) -> str:
    # lm-eval splits --model_args on commas and '='.
    if "," in value or "=" in value:
        raise ToolFailure(f"{what} {value!r} contains ',' or '=', which lm-eval's --model_args cannot carry; "
                          f"use a path without them", {what: value})
    return value


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale_tmp(out: Path) -> None:
    """Remove temporary run folders whose writer is gone (a run killed with SIGKILL cannot clean up)."""
    for p in out.glob(".*-eval-*.tmp-*"):  # `.<stamp>-eval-<label>-<digest>.tmp-<pid>`: _run_dir_name's form
        m = re.search(r"\.tmp-(\d+)$", p.name)
        if m and p.is_dir() and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)




_TQDM = re.compile(r"^(?P<desc>[^:|]*?):?\s*(?P<pct>\d+)%\|[^|]*\|\s*(?P<done>\d+)/(?P<total>\d+)")
_PHASE = re.compile(r"(Building contexts for \S+|Running \w+ requests|Task: .*?;|bootstrapping for stddev: \w+)")


class _OutputReader:
    """Copies lm-eval's console output into the log and queues its phases and request progress bars.

    The caller's thread takes the events off the queue and calls `progress` itself, so that an exception raised
    by `progress` (a cancelled call) stops lm-eval.
    """

    def __init__(self, stream, log_path: Path) -> None:
        self.stream, self.log_path = stream, log_path
        self.events: queue.Queue[tuple[int, int, str]] = queue.Queue()
        self.phase = "starting lm-eval"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _emit(self, piece: str) -> None:
        # A bar and a log line can share one piece: tqdm ends without a newline before the next log record.
        m = _TQDM.search(piece.strip())
        if m and m.group("desc").strip().startswith("Requesting API"):
            self.events.put((int(m.group("done")), int(m.group("total")), f"{self.phase}: requests"))
        m = _PHASE.search(piece)
        if m:
            self.phase = m.group(1).rstrip(";")
            self.events.put((0, 0, self.phase))

    def _run(self) -> None:
        buf = ""
        last_bar = 0.0
        with open(self.log_path, "a", encoding="utf-8", errors="replace") as log:
            for chunk in iter(lambda: self.stream.read1(4096) if hasattr(self.stream, "read1")
                              else self.stream.read(4096), b""):
                text = chunk.decode("utf-8", errors="replace")
                buf += text
                parts = re.split(r"[\r\n]", buf)
                buf = parts.pop()
                for piece in parts:
                    if not piece.strip():
                        continue
                    bar = _TQDM.search(piece.strip())
                    # Keep the log readable: a progress bar at most once a second, and its final state.
                    now = time.monotonic()
                    if bar is None or now - last_bar >= 1.0 or bar.group("done") == bar.group("total"):
                        if bar is not None:
                            last_bar = now
                        log.write(piece.rstrip() + "\n")
                        log.flush()
                    self._emit(piece)
            if buf.strip():
                log.write(buf.rstrip() + "\n")


def _unknown_tasks_message(names: str, params: EvalParams) -> str:
    where = params.include_path or str(TASKS_DIR)
    return (f"unknown lm-eval task(s): {names}; see `python -m lm_eval ls tasks` or put a task YAML in the include "
            f"folder ({where})")


def _offline_hint() -> tuple[bool, str]:
    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    return offline, ("run once online so the datasets cache holds it, or unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE"
                     if offline else "check the task's dataset_path/data_files and the network")


def _yaml_load(data: bytes) -> Any:
    """lm-eval task YAML without running it: `!function` and other tags load as None."""
    import yaml  # PyYAML comes with lm-eval

    class TagsIgnored(yaml.SafeLoader):
        pass

    TagsIgnored.add_multi_constructor("", lambda loader, suffix, node: None)
    return yaml.load(data, Loader=TagsIgnored)  # noqa: S506 (a SafeLoader)


def _task_yamls(root: Path) -> list[Path]:
    # The files lm-eval indexes: every *.yaml under the folder.
    return sorted(p for p in root.glob("**/*.yaml") if not ({"__pycache__", ".ipynb_checkpoints"} & set(p.parts)))


def _read_task_yaml(path: Path, seen: frozenset[Path] = frozenset()) -> dict[str, Any] | None:
    """A task YAML with its `include:` files merged as lm-eval merges them; None when it cannot be read."""
    path = path.resolve()
    if path in seen:
        return None
    try:
        cfg = _yaml_load(path.read_bytes())
    except Exception:  # unreadable or not YAML: lm-eval will say so itself
        return None
    if not isinstance(cfg, dict):
        return None
    if "include" not in cfg:
        return cfg
    includes = cfg.pop("include")
    merged: dict[str, Any] = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        base = _read_task_yaml(path.parent / str(inc), seen | {path})
        if base is None:
            return None
        base.pop("task_list", None)
        merged.update(base)
    merged.update(cfg)
    return merged


def _lm_eval_tasks_dir() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")  # finds the package without importing it (datasets, torch)
    if spec is None or not spec.submodule_search_locations:
        return None
    tasks = Path(list(spec.submodule_search_locations)[0]) / "tasks"
    return tasks if tasks.is_dir() else None


def _hub_dataset_cached(repo_id: str) -> bool:
    """Whether a hub dataset may be in a local cache (the datasets cache, or the hub's) for an offline load.

    Errs towards yes: any cache entry whose name ends with the dataset's name counts."""
    hf_home = Path(os.path.expanduser(os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")))
    caches = [Path(os.path.expanduser(os.environ.get("HF_DATASETS_CACHE") or hf_home / "datasets")),
              Path(os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
                                      or hf_home / "hub"))]
    name = repo_id.rsplit("/", 1)[-1].lower()
    for cache in caches:
        try:
            if any(e.name.lower().endswith(name) for e in cache.iterdir()):
                return True
        except OSError:
            continue
    return False


def _check_tasks_before_running(params: EvalParams, include: Path) -> None:
    """Refuses, in about a second, what lm-eval would refuse only after indexing its ~15,000 task YAMLs (10 s and
    more on two cores): task names that occur in no task YAML, and, offline, a task of the include folder whose
    hub dataset is in no local cache. One-sided: anything it cannot rule out is left for lm-eval to judge."""
    texts = {p: p.read_bytes() for p in _task_yamls(include) if p.is_file()}
    unknown = []
    for name in params.tasks:
        # Glob patterns, YAML files and folders are lm-eval's to resolve.
        if any(c in name for c in "*?[") or name.endswith(".yaml") or (include / name).exists():
            continue
        needle = name.encode()
        if any(needle in t for t in texts.values()):
            continue
        builtin = _lm_eval_tasks_dir()
        if builtin is None:
            return
        if not any(needle in p.read_bytes() for p in _task_yamls(builtin) if p.is_file()):
            unknown.append(name)
    if unknown:
        raise ToolFailure(_unknown_tasks_message(", ".join(unknown), params), {"unknown_tasks": unknown})
    offline, hint = _offline_hint()
    if not offline:
        return
    for path in texts:
        cfg = _read_task_yaml(path)
        if not cfg or cfg.get("task") not in params.tasks or "class" in cfg or "group" in cfg:
            continue
        ds, kwargs = cfg.get("dataset_path"), cfg.get("dataset_kwargs") or {}
        # Only `namespace/name` hub ids: packaged builders (json, csv...) and legacy names have no '/'.
        if (not isinstance(ds, str) or ds.count("/") != 1 or ds.startswith(("/", ".", "~"))
                or (include / ds).exists() or not isinstance(kwargs, dict) or "cache_dir" in kwargs):
            continue
        if not _hub_dataset_cached(ds):
            raise ToolFailure(f"a task's dataset cannot be loaded offline: task {cfg['task']} reads the hub "
                              f"dataset {ds}, which no local cache holds; {hint}",
                              {"task": cfg["task"], "dataset_path": ds, "yaml": str(path)})


def _explain_failure(log_text: str, rc: int, params: EvalParams) -> tuple[str, dict[str, Any]]:
    """One actionable line from lm-eval's output: the last exception, with what to do about it."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    exc_line = next((ln for ln in reversed(lines)
                     if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*", ln) or re.match(r"^[\w.]+Error:", ln)), None)
    detail = {"returncode": rc, "log_tail": lines[-15:]}
    text = exc_line or (lines[-1] if lines else f"exit code {rc}")
    low = log_text.lower()
    m = re.search(r"^\s*ValueError: Tasks not found: (.*)$", log_text, re.M)
    if m:
        return _unknown_tasks_message(m.group(1).strip(), params), detail
    if "clientconnectorerror" in low or "connection refused" in low or "cannot connect to host" in low:
        return (f"lm-eval could not reach the server at {params.base_url} (connection refused); check ./vllm-t4 "
                f"status and rerun", detail)
    offline, hint = _offline_hint()
    if any(k in low for k in ("couldn't reach", "offline mode", "localentrynotfound", "datasetnotfounderror",
                              "unable to find", "connectionerror", "doesn't exist on the hub",
                              "cannot find the requested files", "no (supported) data files")):
        return f"a task's dataset cannot be loaded{' offline' if offline else ''}: {text[:300]}; {hint}", detail
    return f"lm-eval failed (exit code {rc}): {text[:300]}; see the log lines in detail", detail


def _run_dir_name(params: EvalParams, model: str | None) -> str:
    ident = {"tasks": params.tasks, "limit": params.limit, "num_fewshot": params.num_fewshot, "model": model,
             "apply_chat_template": params.apply_chat_template}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-eval-{params.label}-{digest}"


def _find_outputs(lm_dir: Path) -> tuple[Path | None, dict[str, Path]]:
    results = sorted(lm_dir.rglob("results_*.json"))
    samples: dict[str, Path] = {}
    for p in sorted(lm_dir.rglob("samples_*.jsonl")):
        m = re.match(r"samples_(.+)_\d{4}-\d{2}-\d{2}T.*\.jsonl$", p.name)
        if m:
            samples[m.group(1)] = p
    return (results[-1] if results else None), samples


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


def _fmt(v: float | None, digits: int = 4) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def summary_markdown(res: EvalResult) -> str:
    head = (f"# lm-eval: {res.label} ({res.model})\n\n"
            f"lm-eval {res.lm_eval_version}, limit {res.limit or 'all'}, few-shot "
            f"{res.num_fewshot if res.num_fewshot is not None else 'task default'}, greedy, {res.base_url}\n\n"
            "| task | metric | filter | value | stderr | n | shots | version |\n"
            "|---|---|---|---:|---:|---:|---:|---|\n")
    body = "".join(f"| {s.task} | {s.metric} | {s.filter} | {_fmt(s.value)} | {_fmt(s.stderr)} | "
                   f"{s.n if s.n is not None else '—'} | {s.num_fewshot if s.num_fewshot is not None else '—'} | "
                   f"{s.version or '—'} |\n" for s in res.scores)
    return head + body


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def run_eval(params: EvalParams, progress: Progress | None = None, *, serve_config: Any = None) -> EvalResult:
    """Run lm-eval against a live server and save the evidence folder; returns its summary.

    `progress(done, total, message)` is called as lm-eval moves through its phases (total 0) and its request
    progress bars. `serve_config` (a tools.serving.config.ServeConfig) names the server tools/ started: its URL is the
    default base_url and its start record goes into the provenance. Raises ToolFailure with one line, leaving no
    run folder, when the tasks, include folder, server or datasets are unusable or lm-eval fails.
    """
    params = EvalParams.model_validate(params.model_dump())
    version = lm_eval_version()
    if version is None:
        raise ToolFailure("lm-eval is not installed in this environment: run ./setup.sh (it installs "
                          "'lm-eval[api]')", {"python": sys.executable})
    include = Path(params.include_path).expanduser().resolve() if params.include_path else TASKS_DIR
    if not include.is_dir():
        raise ToolFailure(f"include path {params.include_path} is not a folder: give a folder of lm-eval task "
                          f"YAMLs", {"include_path": params.include_path})
    _check_tasks_before_running(params, include)

    endpoint = resolve_endpoint(params, serve_config)
    if endpoint.config is not None:  # the instance scored: its start record goes into the provenance
        serve_config = endpoint.config
    base_url = endpoint.base_url.rstrip("/").removesuffix("/v1")
    params = params.model_copy(update={"base_url": base_url, "instance": None, "router": False})
    server = _server(base_url)
    model = params.model or server.model_id
    if not model:
        raise ToolFailure(f"the server at {base_url} lists no model in /v1/models; pass --model", {})
    tokenizer = params.tokenizer or server.model_root or model
    if not Path(tokenizer).is_dir() and Path(tokenizer).is_absolute():
        raise ToolFailure(f"tokenizer folder {tokenizer} does not exist on this machine: pass --tokenizer with the "
                          f"served model's folder", {"tokenizer": tokenizer})
    max_len = server.max_model_len or 2048

    out = Path(params.out).expanduser().resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ToolFailure(f"output folder {out} cannot be created: {exc.strerror}", {"out": str(out)}) from exc
    _sweep_stale_tmp(out)
    run_id = _run_dir_name(params, model)
    for k in range(2, 100):  # two runs started in the same second keep separate folders
        if not (out / run_id).exists():
            break
        run_id = f"{_run_dir_name(params, model)}-{k}"
    final = out / run_id
    tmp = out / f".{run_id}.tmp-{os.getpid()}"
    try:
        tmp.mkdir()
    except OSError as exc:
        raise ToolFailure(f"cannot write in output folder {out}: {exc.strerror}", {"out": str(out)}) from exc
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        lm_dir = tmp / "lm_eval"
        model_args = ",".join([
            f"base_url={_arg_safe('base_url', base_url)}/v1/completions", f"model={_arg_safe('model', model)}",
            "tokenizer_backend=huggingface", f"tokenizer={_arg_safe('tokenizer', tokenizer)}",
            f"max_length={max_len}", f"num_concurrent={params.num_concurrent}", "max_retries=3",
            "tokenized_requests=True"])
        # parent_watch: lm-eval ends with this process even when it is killed with SIGKILL
        cmd = [sys.executable, "-m", "tools.measure.parent_watch", "lm_eval", "run", "--model", "local-completions",
               "--model_args", model_args,
               "--tasks", ",".join(params.tasks), "--include_path", str(include),
               "--output_path", str(lm_dir), "--log_samples", "--gen_kwargs", "temperature=0"]
        if params.limit is not None:
            cmd += ["--limit", str(params.limit)]
        if params.num_fewshot is not None:
            cmd += ["--num_fewshot", str(params.num_fewshot)]
        if params.apply_chat_template:
            cmd += ["--apply_chat_template"]
        env = python_child_env(PROJECT_ROOT)  # this checkout's tools/ (parent_watch), whatever the cwd
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        log_path = tmp / "lm_eval.log"
        log_path.write_text("$ " + " ".join(cmd) + "\n")
        if progress is not None:
            progress(0, 0, f"lm-eval {version}: {','.join(params.tasks)} against {model} at {base_url}")
        t0 = time.monotonic()
        # cwd: relative data_files in the include folder's YAMLs resolve there.
        proc = subprocess.Popen(cmd, cwd=str(include), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        reader = _OutputReader(proc.stdout, log_path)
        deadline = t0 + params.timeout_s
        try:
            while True:
                try:
                    event = reader.events.get(timeout=0.5)
                except queue.Empty:
                    event = None
                if event is not None and progress is not None:
                    progress(*event)
                if event is None and proc.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    kill_group(proc)
                    raise ToolFailure(f"lm-eval ran past its limit of {params.timeout_s:.0f} s and was stopped; "
                                      f"give a larger timeout or a smaller --limit", {"timeout_s": params.timeout_s})
        except BaseException:
            kill_group(proc)  # Ctrl-C, a cancelled call or a failing progress consumer: never leave lm-eval running
            raise
        finally:
            reader.thread.join(timeout=30)
        rc = proc.wait()
        wall = time.monotonic() - t0
        log_text = log_path.read_text(errors="replace")
        if rc != 0:
            msg, detail = _explain_failure(log_text, rc, params)
            raise ToolFailure(msg, detail)
        results_file, samples = _find_outputs(lm_dir)
        if results_file is None:
            raise ToolFailure(f"lm-eval exited 0 but wrote no results JSON under {lm_dir}",
                              {"log_tail": log_text.splitlines()[-15:]})
        results = json.loads(results_file.read_text())
        res = EvalResult(run_id=run_id, run_dir=str(final), label=params.label, model=model, base_url=base_url,
                         tasks=list(params.tasks), scores=scores_from_results(results), limit=params.limit,
                         num_fewshot=params.num_fewshot, lm_eval_version=version, started=started,
                         finished=datetime.now(timezone.utc).isoformat(timespec="seconds"), wall_s=round(wall, 2),
                         command=cmd)
        if not res.scores:
            raise ToolFailure(f"lm-eval reported no metric for {','.join(params.tasks)}",
                              {"results_file": str(results_file)})
        prov = prov_mod.collect(base_url, server=server, serve_config=serve_config).to_dict()
        prov["eval"] = {
            "lm_eval_version": version, "datasets_version": _dist_version("datasets"), "model": model,
            "tokenizer": tokenizer, "max_length": max_len, "tasks": params.tasks, "include_path": str(include),
            "limit": params.limit, "num_fewshot": params.num_fewshot, "n_shot": results.get("n-shot"),
            "task_versions": results.get("versions"), "task_hashes": results.get("task_hashes"),
            "n_samples": results.get("n-samples"), "apply_chat_template": params.apply_chat_template,
            "num_concurrent": params.num_concurrent, "greedy": "temperature=0 (--gen_kwargs), loglikelihoods "
            "from prompt logprobs (echo)", "date": results.get("date"), "command": cmd,
            "hf_offline": {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")},
        }
        _write_json(tmp / "provenance.json", prov)

        def rel(p: Path) -> str:
            return str(final / p.relative_to(tmp))

        res.files = {"summary_json": str(final / "summary.json"), "summary_md": str(final / "summary.md"),
                     "provenance": str(final / "provenance.json"), "log": str(final / "lm_eval.log"),
                     "lm_eval_results": rel(results_file),
                     **{f"samples:{t}": rel(p) for t, p in sorted(samples.items())}}
        (tmp / "summary.md").write_text(summary_markdown(res))
        _write_json(tmp / "summary.json", res.to_dict())
        os.replace(tmp, final)  # the run folder appears whole or not at all
        return res
    except OSError as exc:  # a full disk or a vanished folder: nothing half-written stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise ToolFailure(f"writing the eval run in {out} failed: {exc}", {"out": str(out)}) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


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
                except ValueError as first:
                    try:
                        inc = roots.confine(params.include_path, "models", must_exist=True, what="include_path")
                    except ValueError:
                        raise first from None
            p.include_path = str(inc)
    except ValueError as exc:
        raise ToolFailure(str(exc), {"roots": roots.describe() if hasattr(roots, "describe") else None}) from exc
    return p


def confine_compare_params(params: CompareParams, roots: Any) -> CompareParams:
    """Run folders to compare must lie under an evidence root (see confine_eval_params)."""
    try:
        runs = [str(roots.confine(r, "evidence", must_exist=True, what="run")) for r in params.runs]
    except ValueError as exc:
        raise ToolFailure(str(exc), {"roots": roots.describe() if hasattr(roots, "describe") else None}) from exc
    return CompareParams(runs=runs)


# ----------------------------------------------------------------------------------------------------------
# Comparing runs


class _Run:
    """An eval run folder as a comparison reads it. A samples entry of summary.json must name a file inside the
    run folder; with `roots` (the MCP server's) every file read must resolve inside the evidence roots too, so a
    link in a confined folder cannot read a file outside them."""

    def __init__(self, folder: str, roots: Any = None) -> None:
        self.name = folder
        self.dir = Path(folder).expanduser()
        self.roots = roots
        summary = self._file(self.dir / "summary.json")
        if not summary.is_file():
            raise ToolFailure(f"{folder} is not an eval run folder (no summary.json): give folders written by "
                              f"./vllm-t4 eval", {"run": folder})
        try:
            self.result = EvalResult.model_validate(json.loads(summary.read_text()))
        except (ValueError, ValidationError) as exc:
            raise ToolFailure(f"{summary} cannot be read as an eval summary: {str(exc).splitlines()[0]}",
                              {"run": folder}) from exc
        prov = self._file(self.dir / "provenance.json")
        try:
            self.config_sha = json.loads(prov.read_text()).get("checkpoint_config_sha256") if prov.is_file() else None
        except ValueError:
            self.config_sha = None
        self._samples: dict[str, list[dict[str, Any]] | None] = {}

    def _file(self, path: Path) -> Path:
        if self.roots is None:
            return path

        try:
            return self.roots.confine(path, "evidence", what=f"run {clip(self.name)}")
        except ValueError as exc:
            raise ToolFailure(str(exc), {"run": self.name}) from None

    def samples(self, task: str) -> list[dict[str, Any]] | None:
        if task not in self._samples:
            path = self.result.files.get(f"samples:{task}")
            p = self._file(self.dir / self._inside(path, task)) if path else None
            if p is None or not p.is_file():
                self._samples[task] = None
            else:
                with open(p, encoding="utf-8") as f:
                    self._samples[task] = [json.loads(line) for line in f if line.strip()]
        return self._samples[task]

    def _inside(self, path: str, task: str) -> Path:
        """The samples entry relative to the run folder; refused when it leads out of it ('..', another folder)."""
        try:
            rel = Path(path).relative_to(self.result.run_dir)
        except ValueError:
            rel = None
        if rel is None or ".." in rel.parts:
            raise ToolFailure(f"run {clip(self.name)}: summary.json's samples:{clip(task)} entry {clip(path)} "
                              f"is not a file inside the run folder; compare the run folder ./vllm-t4 eval wrote, "
                              f"with its summary.json unchanged", {"run": self.name, "task": task})
        return rel


def _per_doc(samples: list[dict[str, Any]] | None, metric: str, filt: str) -> dict[int, tuple[float, str | None]]:
    out: dict[int, tuple[float, str | None]] = {}
    for s in samples or []:
        v = s.get(metric)
        if s.get("filter", "none") != filt or not isinstance(v, (int, float)):
            continue
        out[int(s["doc_id"])] = (float(v), s.get("doc_hash"))
    return out


def paired_difference(ref: dict[int, tuple[float, str | None]], cand: dict[int, tuple[float, str | None]]
                      ) -> tuple[float, float, int, int]:
    """(mean of cand - ref, its standard error, documents paired, documents whose doc_hash differs)."""
    common = sorted(set(ref) & set(cand))
    mismatched = [d for d in common if ref[d][1] and cand[d][1] and ref[d][1] != cand[d][1]]
    ds = [cand[d][0] - ref[d][0] for d in common if d not in mismatched]
    n = len(ds)
    if n == 0:
        return math.nan, math.nan, 0, len(mismatched)
    mean = sum(ds) / n
    if n < 2:
        return mean, math.nan, n, len(mismatched)
    var = sum((d - mean) ** 2 for d in ds) / (n - 1)
    return mean, math.sqrt(var / n), n, len(mismatched)


def compare_evals(params: CompareParams, roots: Any = None) -> EvalComparison:
    """Runs side by side per task and metric; each later run against the first, paired over shared documents.

    roots: the MCP server's (a tools Roots); every file read must then resolve inside its evidence roots."""
    runs = [_Run(r, roots) for r in params.runs]
    ref = runs[0]
    infos = [RunInfo(label=r.result.label, run_dir=str(r.dir), model=r.result.model,
                     checkpoint_config_sha256=r.config_sha) for r in runs]
    keys: list[tuple[str, str, str]] = []
    for r in runs:
        for s in r.result.scores:
            if (s.task, s.metric, s.filter) not in keys:
                keys.append((s.task, s.metric, s.filter))
    rows: list[EvalDiff] = []
    for task, metric, filt in keys:
        scored = [next((s for s in r.result.scores if (s.task, s.metric, s.filter) == (task, metric, filt)), None)
                  for r in runs]
        values = [s.value if s else None for s in scored]
        stderrs = [s.stderr if s else None for s in scored]
        ns = [s.n if s else None for s in scored]
        for i, cand in enumerate(runs[1:], start=1):
            row = EvalDiff(task=task, metric=metric, filter=filt, values=values, stderrs=stderrs, n=ns,
                           candidate=cand.result.label)
            rows.append(row)
            if values[0] is None or values[i] is None:
                row.note = "not scored by both runs"
                continue
            row.diff = values[i] - values[0]
            a = _per_doc(ref.samples(task), metric, filt)
            b = _per_doc(cand.samples(task), metric, filt)
            # Paired only where the per-document values average to the reported metric (mean-aggregated).
            mean_ok = (a and b and abs(sum(v for v, _ in a.values()) / len(a) - values[0]) < 1e-6
                       and abs(sum(v for v, _ in b.values()) / len(b) - values[i]) < 1e-6)
            if mean_ok:
                diff, se, n, bad = paired_difference(a, b)
                row.paired, row.n_paired, row.diff = True, n, diff
                row.diff_stderr = None if math.isnan(se) else se
                if bad:
                    row.note = f"{bad} documents differ between the runs (doc_hash) and were left out"
                if n == 0:
                    row.paired, row.diff, row.note = False, None, "no document scored by both runs"
                    continue
                if n < max(len(a), len(b)):
                    row.note = (row.note + "; " if row.note else "") + f"paired over {n} shared documents"
            else:
                se = [x for x in (stderrs[0], stderrs[i]) if x is not None]
                row.diff_stderr = math.sqrt(sum(x * x for x in se)) if len(se) == 2 else None
                row.note = "per-document values not available: unpaired stderr"
            if row.diff is not None:
                identical = row.paired and row.diff_stderr == 0 and row.diff == 0
                row.within_noise = (True if identical else
                                    None if row.diff_stderr is None else abs(row.diff) < 2 * row.diff_stderr)
    cmp = EvalComparison(runs=infos, rows=rows)
    cmp.markdown = comparison_markdown(cmp)
    return cmp


def comparison_markdown(cmp: EvalComparison) -> str:
    labels = [r.label for r in cmp.runs]
    ref = labels[0]
    lines = ["# lm-eval comparison", "",
             "Runs: " + ", ".join(f"{r.label} ({r.model}, {r.run_dir})" for r in cmp.runs), "",
             "| task | metric | " + " | ".join(labels) + " | candidate | diff vs " + ref + " | stderr | n paired | "
             "within noise |",
             "|---|---|" + "---:|" * len(labels) + "---|---:|---:|---:|---|"]
    for r in cmp.rows:
        cells = [f"{_fmt(v)} ± {_fmt(s)}" if v is not None else "—" for v, s in zip(r.values, r.stderrs)]
        verdict = {True: "yes", False: "**no**", None: "—"}[r.within_noise]
        metric = r.metric + (f" ({r.filter})" if r.filter != "none" else "")
        lines.append(f"| {r.task} | {metric} | " + " | ".join(cells) + f" | {r.candidate} | "
                     f"{'—' if r.diff is None else f'{r.diff:+.4f}'} | {_fmt(r.diff_stderr)} | "
                     f"{r.n_paired if r.n_paired is not None else '—'} | {verdict} |")
    notes = [f"- {r.task} {r.metric} ({r.candidate}): {r.note}" for r in cmp.rows if r.note]
    lines += ["", "diff: candidate minus the first run, paired over the documents both scored (matched by "
              "doc_id, checked by doc_hash); within noise: |diff| < 2 stderr of the paired difference."]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


# ----------------------------------------------------------------------------------------------------------
# The project's own tasks: the tiny test model's pattern


def tiny_pattern_docs(seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Documents for the tiny model's training pattern (token t is followed by perm[t]).

    Printable ASCII characters c whose successor perm[c] is printable too: a multiple-choice item per c (the
    successor among four characters, chance 1/4) and a generation item per c (the next character, greedy).
    """
    import random


    perm = pattern_permutation(seed)
    printable = [chr(b) for b in range(0x21, 0x7F)]
    pairs = [(c, chr(int(perm[FIRST_BYTE_ID + ord(c)]) - FIRST_BYTE_ID)) for c in printable
             if 0x21 <= int(perm[FIRST_BYTE_ID + ord(c)]) - FIRST_BYTE_ID < 0x7F]
    rng = random.Random(seed)
    mc, gen = [], []
    for c, nxt in pairs:
        choices = rng.sample([x for x in printable if x != nxt], 3)
        label = rng.randrange(4)
        choices.insert(label, nxt)
        mc.append({"context": c, "choices": choices, "label": label})
        gen.append({"context": c, "target": nxt})
    return mc, gen


def write_tiny_pattern_tasks(folder: Path = TASKS_DIR / "tiny_pattern", seed: int = 0) -> None:
    """(Re)writes the JSONL files the tiny_pattern task YAMLs read."""
    mc, gen = tiny_pattern_docs(seed)
    for name, docs in (("tiny_pattern_mc.jsonl", mc), ("tiny_pattern_gen.jsonl", gen)):
        (folder / name).write_text("".join(json.dumps(d) + "\n" for d in docs))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.measure.evals")
    ap.add_argument("--write-tiny-tasks", action="store_true",
                    help="regenerate tools/measure/tasks/tiny_pattern/*.jsonl from the tiny model's pattern")
    if ap.parse_args().write_tiny_tasks:
        write_tiny_pattern_tasks()
