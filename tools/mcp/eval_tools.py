"""Accuracy tools: lm-evaluation-harness against the server and eval runs side by side (tools/measure/evals/run.py
does the work)."""

from __future__ import annotations

from tools.measure.evals.results import (EvalCompareParams, EvalComparison, EvalParams, EvalResult,
                                         confine_compare_params, confine_eval_params, summary_markdown)
from tools.measure.evals.compare import compare_evals as compare
from tools.measure.evals.run import run_eval as evaluate
from tools.mcp.registry import Reply, tool
from tools.measure.endpoint import resolve_endpoint


def _eval_inputs(app, p: EvalParams) -> EvalParams:
    """The eval's paths confined, the server a managed one."""
    confined = confine_eval_params(p, app.roots)
    resolve_endpoint(p, app.config(), managed=True)  # a managed server, not whatever holds the config's port
    return confined


@tool(toolset="eval", title="Accuracy with lm-eval", params=EvalParams, result=EvalResult, long=True,
      open_world=True, extra={"table_md": (str, "The run's scores as a markdown table")}, check=_eval_inputs,
      ops="eval")
def run_eval(app, p: EvalParams, progress, checked: EvalParams) -> Reply:
    """Score the running server with lm-evaluation-harness (greedy, local-completions) on the given tasks; writes
    a run folder (lm-eval's results and samples, summary, provenance) under an evidence root (`out`, default: the
    first). Long: lm-eval's progress."""
    res = evaluate(checked, progress=progress, serve_config=app.config())
    first = ", ".join(f"{s.task} {s.metric} {s.value:.4f}" for s in res.scores[:3] if s.value is not None)
    summary = (f"eval {res.run_id}: {len(res.scores)} scores over {', '.join(res.tasks)}"
               + (f"; {first}" if first else "") + f" ({res.run_dir})")
    return Reply(res, summary, {"table_md": summary_markdown(res)})


@tool(toolset="eval", title="Compare eval runs", params=EvalCompareParams, result=EvalComparison, read_only=True,
      idempotent=True, ops="eval_compare")
def compare_evals(app, p: EvalCompareParams) -> Reply:
    """Eval runs side by side, the first the reference: per task and metric each run's value with its stderr,
    and each later run minus the first paired over the documents both scored, with whether it is within noise.
    Writes nothing."""
    cmp = compare(confine_compare_params(p, app.roots), roots=app.roots)
    noisy = sum(1 for r in cmp.rows if r.within_noise is False)
    summary = (f"compared {len(cmp.runs)} eval runs over {len(cmp.rows)} rows"
               + (f"; {noisy} differences beyond noise" if noisy else ""))
    return Reply(cmp, summary)
