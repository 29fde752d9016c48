"""Accuracy with EleutherAI's lm-evaluation-harness against a live vLLM server, saved as evidence.

`run_eval` drives `python -m lm_eval run --model local-completions` in a subprocess (never imported here: it
pulls torch, datasets and friends, and a subprocess can be timed, killed and survive a crash). local-completions
scores loglikelihoods through /v1/completions with `echo` and `logprobs` on tokenized prompts, so the tokenizer
is the served model's own folder, loaded offline; generation is greedy (temperature 0).

Evidence folder (`<out>/eval-<stamp>-<label>-<hash>/`), written under a temporary name and renamed at the end so
that a failed or interrupted run leaves nothing half-written:
  lm_eval/<model>/results_*.json, samples_<task>_*.jsonl   lm-eval's own results and per-sample records
  lm_eval.log                                              lm-eval's console output
  summary.json, summary.md                                 task, metric, value, stderr, n per row
  provenance.json                                          machine, server, checkpoint hash, lm-eval, task versions

The parameter and result models are tools/measure/evals/results.py's, the task checks and the project's own tasks
tools/measure/evals/tasks.py's, runs side by side (`compare_evals`) tools/measure/evals/compare.py's.

Task YAMLs in an include folder may name local data (`dataset_path: json`, `dataset_kwargs.data_files`):
relative paths there resolve against the include folder, which is lm-eval's working directory.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.core.api_key import with_client_key
from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.process import kill_group, python_child_env
from tools.core.root import PROJECT_ROOT
from tools.core.versions import installed
from tools.measure import evidence, provenance as prov_mod
from tools.core.output_check import check_output_folder
from tools.core.progress import Progress
from tools.core import clock
from tools.measure.evals.results import TASKS_DIR, EvalParams, EvalResult, scores_from_results, summary_markdown
from tools.measure.evals.tasks import check_tasks_before_running, offline_hint, unknown_tasks_message
from tools.measure.endpoint import resolve_endpoint
from tools.serving.config import ServeConfig


# ----------------------------------------------------------------------------------------------------------
# Running lm-eval


HEARTBEAT_S = 1.0   # the longest lm-eval runs between two progress reports (each a chance to cancel)
KILL_GRACE_S = 5.0  # SIGTERM to SIGKILL for lm-eval's process group


def lm_eval_version() -> str | None:
    return installed("lm_eval")


def _arg_safe(what: str, value: str) -> str:
    # lm-eval splits --model_args on commas and '='.
    if "," in value or "=" in value:
        raise BadInput(f"{what} {value!r} contains ',' or '=', which lm-eval's --model_args cannot carry; "
                       f"use a path without them", {what: value})
    return value


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
        return unknown_tasks_message(m.group(1).strip(), params), detail
    if "clientconnectorerror" in low or "connection refused" in low or "cannot connect to host" in low:
        return (f"lm-eval could not reach the server at {params.base_url} (connection refused); check {op('status')} "
                f"and rerun", detail)
    offline, hint = offline_hint()
    if any(k in low for k in ("couldn't reach", "offline mode", "localentrynotfound", "datasetnotfounderror",
                              "unable to find", "connectionerror", "doesn't exist on the hub",
                              "cannot find the requested files", "no (supported) data files")):
        return f"a task's dataset cannot be loaded{' offline' if offline else ''}: {text[:300]}; {hint}", detail
    return f"lm-eval failed (exit code {rc}): {text[:300]}; see the log lines in detail", detail


def _run_dir_name(params: EvalParams, model: str | None) -> str:
    ident = {"tasks": params.tasks, "limit": params.limit, "num_fewshot": params.num_fewshot, "model": model,
             "apply_chat_template": params.apply_chat_template}
    digest = evidence.run_digest(ident)
    return evidence.run_id("eval", params.label, digest)


def _find_outputs(lm_dir: Path) -> tuple[Path | None, dict[str, Path]]:
    results = sorted(lm_dir.rglob("results_*.json"))
    samples: dict[str, Path] = {}
    for p in sorted(lm_dir.rglob("samples_*.jsonl")):
        m = re.match(r"samples_(.+)_\d{4}-\d{2}-\d{2}T.*\.jsonl$", p.name)
        if m:
            samples[m.group(1)] = p
    return (results[-1] if results else None), samples


@dataclass
class _Plan:
    """What one lm-eval run is, once its inputs are checked: the tasks' folder and the server it scores."""

    params: EvalParams
    version: str
    include: Path
    base_url: str
    server: prov_mod.ServerInfo
    model: str
    tokenizer: str
    max_len: int
    serve_config: ServeConfig | None


def run_eval(params: EvalParams, progress: Progress | None = None, *,
             serve_config: ServeConfig | None = None) -> EvalResult:
    """Run lm-eval against a live server and save the evidence folder; returns its summary.

    `progress(done, total, message)` is called as lm-eval moves through its phases (total 0) and its request
    progress bars. `serve_config` (a tools.serving.config.ServeConfig) names the server tools/ started: its URL is the
    default base_url and its start record goes into the provenance. Raises ToolFailure with one line, leaving no
    run folder, when the tasks, include folder, server or datasets are unusable or lm-eval fails.
    """
    check_output_folder(params.out)  # before lm-eval or the server is asked
    plan = _plan(EvalParams.model_validate(params.model_dump()), serve_config)
    params = plan.params
    run = _run_folder(params, plan.model)
    out, run_id, tmp, final = run.out, run.name, run.dir, run.path
    started = clock.iso()
    try:
        lm_dir = tmp / "lm_eval"
        cmd = _lm_eval_command(plan, lm_dir)
        log_path = tmp / "lm_eval.log"
        log_path.write_text("$ " + " ".join(cmd) + "\n")
        if progress is not None:
            progress(0, 0, f"lm-eval {plan.version}: {','.join(params.tasks)} against {plan.model} at {plan.base_url}")
        rc, wall = _run_lm_eval(cmd, plan.include, log_path, params.timeout_s, progress)
        log_text = log_path.read_text(errors="replace")
        if rc != 0:
            msg, detail = _explain_failure(log_text, rc, params)
            raise ToolFailure(msg, detail)
        results_file, samples = _find_outputs(lm_dir)
        if results_file is None:
            raise ToolFailure(f"lm-eval exited 0 but wrote no results JSON under {lm_dir}",
                              {"log_tail": log_text.splitlines()[-15:]})
        results = json.loads(results_file.read_text())
        res = EvalResult(run_id=run_id, run_dir=str(final), label=params.label, model=plan.model,
                         base_url=plan.base_url, tasks=list(params.tasks), scores=scores_from_results(results),
                         limit=params.limit, num_fewshot=params.num_fewshot, lm_eval_version=plan.version,
                         started=started, finished=clock.iso(),
                         wall_s=round(wall, 2), command=cmd)
        if not res.scores:
            raise ToolFailure(f"lm-eval reported no metric for {','.join(params.tasks)}",
                              {"results_file": str(results_file)})
        evidence.write_json(tmp / "provenance.json", _provenance(plan, results, cmd))

        def rel(p: Path) -> str:
            return str(final / p.relative_to(tmp))

        res.files = {"summary_json": str(final / "summary.json"), "summary_md": str(final / "summary.md"),
                     "provenance": str(final / "provenance.json"), "log": str(final / "lm_eval.log"),
                     "lm_eval_results": rel(results_file),
                     **{f"samples:{t}": rel(p) for t, p in sorted(samples.items())}}
        evidence.write_text(tmp / "summary.md", summary_markdown(res))
        evidence.write_json(tmp / "summary.json", res.to_dict())
        if progress is not None:  # the last report before publishing: a call cancelled by now writes no run
            progress(0, 0, "publishing the run folder")
        run.finish()  # the run folder appears whole or not at all
        return res
    except OSError as exc:  # a full disk or a vanished folder: nothing half-written stays
        run.abandon()
        raise ToolFailure(f"writing the eval run in {out} failed: {exc}", {"out": str(out)}) from exc
    except BaseException:
        run.abandon()
        raise


def _plan(params: EvalParams, serve_config: ServeConfig | None) -> _Plan:
    """lm-eval, the tasks, the endpoint (resolved once) and the server it serves, checked before any folder."""
    version = lm_eval_version()
    if version is None:
        raise ToolFailure("lm-eval is not installed in this environment: run ./setup.sh (it installs "
                          "'lm-eval[api]')", {"python": sys.executable})
    include = Path(params.include_path).expanduser().resolve() if params.include_path else TASKS_DIR
    if not include.is_dir():
        raise BadInput(f"include path {params.include_path} is not a folder: give a folder of lm-eval task "
                       f"YAMLs", {"include_path": params.include_path}, field="include_path")
    check_tasks_before_running(params, include)

    endpoint = resolve_endpoint(params, serve_config)
    if endpoint.config is not None:  # the instance scored: its start record goes into the provenance
        serve_config = endpoint.config
    base_url = endpoint.base_url.rstrip("/").removesuffix("/v1")
    params = params.model_copy(update={"base_url": base_url, "instance": None, "router": False})
    server, model = prov_mod.served_model(base_url, params.model)
    tokenizer = params.tokenizer or server.model_root or model
    if not Path(tokenizer).is_dir() and Path(tokenizer).is_absolute():
        raise BadInput(f"tokenizer folder {tokenizer} does not exist on this machine: pass {param('tokenizer')} "
                       f"with the served model's folder", {"tokenizer": tokenizer}, field="tokenizer")
    return _Plan(params=params, version=version, include=include, base_url=base_url, server=server, model=model,
                 tokenizer=tokenizer, max_len=server.max_model_len or 2048, serve_config=serve_config)


def _run_folder(params: EvalParams, model: str) -> evidence.EvidenceRun:
    """The run, written in its temporary folder (tools.measure.evidence.EvidenceRun: published whole by finish;
    a killed run's folder is removed by the next write into the same --out, of any command)."""
    out = Path(params.out).expanduser().resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ToolFailure(f"output folder {out} cannot be created: {exc.strerror}", {"out": str(out)}) from exc
    # two runs started in the same second keep separate folders: the second gets a suffix (EvidenceRun.create)
    run = evidence.EvidenceRun.create(out, _run_dir_name(params, model))
    run.raw.rmdir()  # lm-eval's own output goes to lm_eval/
    return run


def _lm_eval_command(plan: _Plan, lm_dir: Path) -> list[str]:
    params = plan.params
    model_args = ",".join([
        f"base_url={_arg_safe('base_url', plan.base_url)}/v1/completions", f"model={_arg_safe('model', plan.model)}",
        "tokenizer_backend=huggingface", f"tokenizer={_arg_safe('tokenizer', plan.tokenizer)}",
        f"max_length={plan.max_len}", f"num_concurrent={params.num_concurrent}", "max_retries=3",
        "tokenized_requests=True"])
    # parent_watch: lm-eval ends with this process even when it is killed with SIGKILL; lm_eval_main: lm-eval's
    # command line without indexing its built-in tasks when the run needs none of them
    cmd = [sys.executable, "-m", "tools.core.parent_watch", "tools.measure.evals.lm_eval_main", "run", "--model", "local-completions",
           "--model_args", model_args,
           "--tasks", ",".join(params.tasks), "--include_path", str(plan.include),
           "--output_path", str(lm_dir), "--log_samples", "--gen_kwargs", "temperature=0"]
    if params.limit is not None:
        cmd += ["--limit", str(params.limit)]
    if params.num_fewshot is not None:
        cmd += ["--num_fewshot", str(params.num_fewshot)]
    if params.apply_chat_template:
        cmd += ["--apply_chat_template"]
    return cmd


def _run_lm_eval(cmd: list[str], include: Path, log_path: Path, timeout_s: float,
                 progress: Progress | None) -> tuple[int, float]:
    """lm-eval in its own process group, its output copied to the log and its progress passed on; (exit code,
    wall seconds). lm-eval is stopped at the time limit and by whatever ends the caller (Ctrl-C, a cancelled
    call, a failing progress consumer)."""
    # this checkout's tools/ (parent_watch), whatever the cwd; local-completions sends OPENAI_API_KEY
    env = with_client_key(python_child_env(PROJECT_ROOT))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    t0 = time.monotonic()
    # cwd: relative data_files in the include folder's YAMLs resolve there.
    proc = subprocess.Popen(cmd, cwd=str(include), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    reader = _OutputReader(proc.stdout, log_path)
    deadline = t0 + timeout_s
    last: tuple[int, int, str] = (0, 0, "starting lm-eval")
    reported = time.monotonic()
    try:
        while True:
            try:
                event = reader.events.get(timeout=0.5)
            except queue.Empty:
                event = None
            if progress is not None and (event is not None or time.monotonic() - reported >= HEARTBEAT_S):
                # lm-eval may print nothing for minutes (loading, building contexts): the last report again, so
                # that a cancelled call (its progress raises) stops lm-eval within seconds at any phase
                last = event or last
                reported = time.monotonic()
                progress(*last)
            if event is None and proc.poll() is not None:
                break
            if time.monotonic() > deadline:
                kill_group(proc)
                raise ToolFailure(f"lm-eval ran past its limit of {timeout_s:.0f} s and was stopped; give a larger "
                                  f"timeout or a smaller {param('limit')}", {"timeout_s": timeout_s})
    except BaseException:
        kill_group(proc, grace_s=KILL_GRACE_S)  # never leave lm-eval running
        raise
    finally:
        reader.thread.join(timeout=30)
    return proc.wait(), time.monotonic() - t0


def _provenance(plan: _Plan, results: dict[str, Any], cmd: list[str]) -> dict[str, Any]:
    params = plan.params
    prov = prov_mod.collect(plan.base_url, server=plan.server, serve_config=plan.serve_config).to_dict()
    prov["eval"] = {
        "lm_eval_version": plan.version, "datasets_version": installed("datasets"), "model": plan.model,
        "tokenizer": plan.tokenizer, "max_length": plan.max_len, "tasks": params.tasks,
        "include_path": str(plan.include), "limit": params.limit, "num_fewshot": params.num_fewshot,
        "n_shot": results.get("n-shot"), "task_versions": results.get("versions"),
        "task_hashes": results.get("task_hashes"), "n_samples": results.get("n-samples"),
        "apply_chat_template": params.apply_chat_template, "num_concurrent": params.num_concurrent,
        "greedy": "temperature=0 (--gen_kwargs), loglikelihoods from prompt logprobs (echo)",
        "date": results.get("date"), "command": cmd,
        "hf_offline": {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")},
    }
    return prov


