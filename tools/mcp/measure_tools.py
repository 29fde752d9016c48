"""Measuring tools: token identity between builds, serving sweeps, capacity searches and their comparison
(tools/measure does the work)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from tools.core import clock
from tools.core.atomic_files import write_file
from tools.core.errors import ToolFailure, op
from tools.core.paths import PathNotAllowed
from tools.core.text import clip
from tools.measure.capacity.run import CapacityParams, capacity, failure_if_error
from tools.measure.capacity.report import CapacityResult, compare_capacity, is_capacity_run
from tools.measure.tokens.compare import TokenCompareParams, TokenComparison, TokenRecord, compare_tokens as compare
from tools.measure.decode.params import DecodeParams
from tools.measure.decode.run import DecodeSummary, run_decode
from tools.measure.fidelity.files import DEFAULT_CORPUS
from tools.measure.fidelity.run import (CheckLogprobsResult, CompareLogprobsParams, RecordLogprobsResult,
                                        compare_logprobs as logprob_fidelity)
from tools.measure.provenance import cost_basis, measured_on, other_load
from tools.measure.sweep.params import DEFAULT_PRICE_PER_HOUR, GEOMEAN_METRICS, SweepParams, SweepResult
from tools.measure.sweep.run import sweep
from tools.measure.sweep.report import (CompareSweepsParams, SweepComparison, compare_runs, load_run,
                                        write_comparison)
from tools.mcp.registry import Reply, tool
from tools.measure.endpoint import Endpoint, resolve_endpoint, resolve_name


class _Sweep(NamedTuple):
    params: SweepParams
    endpoint: Endpoint
    config: Any  # the server configuration (tpu.env), read once for the call


def _sweep_inputs(app, p: SweepParams) -> _Sweep:
    """The sweep's parameters checked, its folder confined, the server a managed one: what the sweep runs with."""
    out = app.roots.confine(p.out, "evidence", what="out")
    p.validate()
    cfg = app.config()
    endpoint = resolve_endpoint(p, cfg, managed=True)  # a managed server, not whatever holds the config's port
    return _Sweep(p.model_copy(update={"out": out}), endpoint, cfg)


@tool(toolset="measure", title="Serving sweep (vllm bench serve)", params=SweepParams, result=SweepResult,
      long=True, open_world=True, check=_sweep_inputs,
      extra={"counts": (dict[str, int], "Cells by status: ok, infeasible, failed"), "measured_on": (str, "")},
      ops="sweep")
def run_sweep(app, p: SweepParams, progress, checked: _Sweep) -> Reply:
    """Measure the running server's throughput with vLLM's bench serve over input lengths x concurrencies, the
    same prompts for every build; writes a run folder. Long."""
    res = sweep(checked.params, checked.endpoint, serve_config=checked.config,
                progress=progress)
    return sweep_reply(res)


def sweep_reply(res: SweepResult) -> Reply:
    """run_sweep's answer: the summary line and a cell's figures, each in the one statistic summary.md gives it
    (GEOMEAN_METRICS: the geometric mean of the repeats; the others: the median), named as such."""
    counts = res.counts
    oks = [c for c in res.cells if c.status == "ok" and c.figure("output_throughput")]
    best = max(oks, key=lambda c: c.figure("output_throughput") or 0, default=None)
    platform, where = measured_on(res.provenance)
    summary = (f"sweep {res.run_id} ({res.label}) on {where}: {counts['ok']} ok, {counts['failed']} failed, "
               f"{counts['infeasible']} infeasible cells"
               + (f"; best {best.figure('output_throughput'):.2f} out tok/s (geometric mean of "
                  f"{best.output_throughput_ci.n} repeats) at in={best.input_len} c={best.concurrency}" if best else "")
               + _roofline_phrase(res.roofline)
               + (f"; other work kept {busy:.1f} cores busy while none of its requests was in flight: its figures "
                  "carry that load (compare_sweeps gives no verdict on them): run it again when nothing else runs"
                  if (busy := other_load(res.provenance)) is not None else ""))
    # Small by default: a cell's figures a comparison reads (the run folder holds every metric, repeat and
    # spread, its table, parameters and provenance); the table once, as data.
    data = res.model_dump(mode="json", exclude={"provenance": True, "params": True, "prefix_cache_policy": True,
                                                "cells": {"__all__": {"repeats": True, "spread_pct": True,
                                                                      "output_throughput_ci": {"log_mean", "log_se"}}}})
    for cell, c in zip(data["cells"], res.cells):
        ci = cell.get("output_throughput_ci") or {}
        cell["output_throughput_ci"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in ci.items()}
        cell["wall_s"] = round(cell["wall_s"], 1) if isinstance(cell.get("wall_s"), float) else cell.get("wall_s")
        cell["median"] = {k: round(v, 3) for k in CELL_FIGURES if k not in GEOMEAN_METRICS
                          and isinstance(v := c.median.get(k), (int, float))}
        cell["geometric_mean"] = {k: round(v, 3) for k in CELL_FIGURES if k in GEOMEAN_METRICS
                                  and isinstance(v := c.figure(k), (int, float))}
    # Where the roofline applies, its figures to four significant digits (summary.json keeps every digit and the
    # n/a ones, which the summary line names): a measured figure carries no more
    data["roofline"] = {L: _four_digits(r) for L, r in data["roofline"].items() if r["applicable"]}
    return Reply(data, summary, {"counts": counts, "platform": platform, "measured_on": where})


def _four_digits(value: Any) -> Any:
    """`value` with every float to four significant digits, through lists and dicts: a measured figure carries no
    more, and a result an assistant reads stays small."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, list):
        return [_four_digits(v) for v in value]
    if isinstance(value, dict):
        return {k: _four_digits(v) for k, v in value.items()}
    return value


def _roofline_phrase(roofline: dict) -> str:
    """The single-stream share of the memory-bandwidth roofline per input length, the lengths where it means nothing
    (a stand-in's step, too small for bandwidth to set its speed) in one phrase."""
    shares = [f"; c=1 at in={L}: {r.share()} of the memory-bandwidth roofline" for L, r in roofline.items()
              if r.applicable]
    small = [(L, r.step_bytes / 2**20) for L, r in roofline.items() if not r.applicable]
    if small:
        mib = sorted(m for _, m in small)
        reads = f"{mib[0]:.2f}" + (f"-{mib[-1]:.2f}" if f"{mib[-1]:.2f}" != f"{mib[0]:.2f}" else "")
        shares.append(f"; no memory-bandwidth roofline share at c=1, in={', '.join(str(L) for L, _ in small)}: a "
                      f"decode step reads only {reads} MiB (a stand-in's size), too little for bandwidth to set its speed")
    return "".join(shares)


CELL_FIGURES = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                "p99_tpot_ms", "completed", "failed")


class _Capacity(NamedTuple):
    params: CapacityParams
    terms: list
    endpoint: Endpoint
    config: Any


def _capacity_inputs(app, p: CapacityParams) -> _Capacity:
    """The SLO parsed and the options checked before anything runs, the folder confined, the server managed."""
    terms = p.checked_terms()
    out = app.roots.confine(p.out, "evidence", what="out")
    cfg = app.config()
    return _Capacity(p.model_copy(update={"out": out}), terms, resolve_endpoint(p, cfg, managed=True), cfg)


@tool(toolset="capacity", title="Capacity within a latency SLO", params=CapacityParams, result=CapacityResult,
      long=True, open_world=True, check=_capacity_inputs, ops="capacity")
def find_capacity(app, p: CapacityParams, progress, checked: _Capacity) -> Reply:
    """The most concurrent users (or Poisson req/s) the running server serves with every SLO term met: doubles
    the load, then bisects, vLLM's bench serve per point; the bracket, goodput, out tok/s and $ per million
    tokens there; a capacity run folder under an evidence root. Long."""
    c = checked
    res = capacity(c.params, c.terms, c.endpoint, serve_config=c.config, progress=progress)
    failure_if_error(res)
    return Reply(res, res.statement)


@tool(toolset="measure", title="Compare sweep runs", params=CompareSweepsParams, result=SweepComparison,
      destructive=True, extra={"report_path": (str | None, "Where the comparison was written, when asked"),
                               "capacity": (str | None, "Capacity runs' verdicts"),
                               "measured_on": (dict[str, str], ""), "cost_basis": (str, "")},
      ops=("sweep_compare", "capacity_compare"))
def compare_sweeps(app, p: CompareSweepsParams) -> Reply:
    """Sweep or capacity runs side by side: per cell each run's output tok/s (95% interval), the last run's
    ratio to each earlier one with a verdict, cost per million tokens, capacities."""
    dirs = [app.roots.confine(d, "evidence", must_exist=True, what="run_dir") for d in p.run_dirs]
    for given, d in zip(p.run_dirs, dirs):  # the file read, not only its folder: a link in it may lead out
        if d.is_dir():
            for name in ("summary.json", "capacity.json")[:1 + is_capacity_run(d)]:
                app.roots.confine(d / name, "evidence", what=f"run_dir {clip(given)}")
    out = app.roots.confine(p.output, "evidence", what="output") if p.output else None
    cmp = compare_runs([str(d) for d in dirs], price_per_hour=p.price_per_hour)
    cap = None
    if all(is_capacity_run(d) for d in dirs):  # the capacities first: the question capacity runs answer
        cap = compare_capacity(dirs)
        cmp.markdown = cap.markdown + "\n" + cmp.markdown
    if out is not None:
        write_comparison(cmp, out, force=p.force)
    # The method paragraph once, in `method`, and the caveat once, in `caveat` (the summary starts with it): the
    # markdown (the written report keeps both) points there.
    md = cmp.markdown.replace(cmp.method, "(Method: see `method`.)")
    if cmp.caveat:
        md = md.replace(f"**{cmp.caveat}.**", "(**Caveat: see `caveat`.**)", 1)
    cmp = cmp.model_copy(update={"markdown": md})
    where = {label: measured_on(load_run(d).provenance) for label, d in zip(cmp.labels, dirs)}
    platforms = {pf for pf, _ in where.values()}
    basis = cost_basis("cpu" if "cpu" in platforms else next(iter(platforms), ""), p.price_per_hour,
                       p.price_per_hour != DEFAULT_PRICE_PER_HOUR)
    places = sorted({w for _, w in where.values()})
    on = f"; measured on {places[0]}" if len(places) == 1 else "; measured on " + ", ".join(
        f"{label}: {w}" for label, (_, w) in where.items())
    first = (f"{cmp.caveat}; {cap.summary()}" if cmp.caveat else cap.summary()) if cap else cmp.summary()
    # Small by default: the cells' figures to four significant digits, without the log-scale internals (the
    # written report and the runs' summary.json keep every digit)
    data = cmp.model_dump(mode="json", exclude={"cells": {"__all__": {"estimates": {"__all__": {"log_mean", "log_se"}}}}})
    data["cells"] = _four_digits(data["cells"])
    return Reply(data, first + on + f"; cost at {basis}",
                 {"report_path": str(out) if out else None, "capacity": cap.summary() if cap else None,
                  "measured_on": {label: w for label, (_, w) in where.items()}, "cost_basis": basis})


def _token_inputs(app, p: TokenCompareParams) -> TokenCompareParams:
    """The comparison's mode and reference checked and confined, its endpoints resolved."""
    if p.mode in ("record", "check") and not p.reference:
        raise ToolFailure(f"mode {p.mode} needs reference: the token record file under an evidence root "
                          f"({'written' if p.mode == 'record' else 'read'} by this call)")
    if p.mode == "live" and bool(p.other_url) == bool(p.other_instance):
        raise ToolFailure("mode live needs other_url (or other_instance): the candidate (base_url, instance "
                          "or router is the reference)")
    ref = None
    if p.reference:
        try:
            ref = app.roots.confine(p.reference, "evidence", must_exist=p.mode == "check", what="reference")
        except PathNotAllowed as exc:
            if exc.detail.get("problem") != "missing":
                raise
            raise ToolFailure(f"{exc}: record it first with {op('compare_tokens.record', reference=p.reference)} "
                              "against the reference build", exc.detail, field="reference") from None
    base_url = resolve_endpoint(p, app.config(), managed=True).base_url
    other = p.other_url
    if p.mode == "live" and p.other_instance:  # this server's instances (its state dir), not tpu.env's
        other = resolve_name(p.other_instance, app.config()).base_url
    return p.model_copy(update={"reference": str(ref) if ref else None, "base_url": base_url, "instance": None,
                                "router": False, "other_url": other, "other_instance": None})


@tool(toolset="measure", title="Greedy token identity between builds", params=TokenCompareParams,
      result=TokenComparison | TokenRecord, long=True, destructive=True, open_world=True, check=_token_inputs,
      extra={"report": (str, ""), "comparison_path": (str | None, "")},
      ops={"compare_tokens": {}, "compare_tokens.record": {"mode": "record"}})
def compare_tokens(app, p: TokenCompareParams, progress, checked: TokenCompareParams) -> Reply:
    """Whether two builds give the same greedy tokens, prompt by prompt: record with build A, check with build B
    (or live with two instances). Long."""
    res = compare(checked, progress=progress)
    if isinstance(res, TokenRecord):
        # The record itself is in the file; the reply lists what was recorded, a prompt as its first words.
        path = Path(res.path or str(checked.reference))
        lines = [f"{i}. {len(g.token_ids)} tokens ({g.finish_reason}), prompt {_prompt_size(g.prompt_tokens)}: "
                 f"{_head(g.prompt)}" for i, g in enumerate(res.generations, 1)]
        return Reply(res.model_dump(mode="json", exclude={"generations"}),
                     f"{res.summary()}, served {app.served_on()}",
                     {"report": "\n".join(lines + [f"written to {path}"])})
    whole = _write_comparison(app, res, checked)
    rows = [_prompt_row(i, x) for i, x in enumerate(res.prompts, 1)]
    data = res.model_dump(mode="json", exclude={"prompts"}) | {"prompts": rows}
    report = "\n".join([_prompt_line(i, x) for i, x in enumerate(res.prompts, 1)]
                       + [f"{res.summary} ({res.reference} vs {res.candidate}); whole comparison: {whole}"])
    return Reply(data, f"{res.summary} ({res.reference} vs {res.candidate}, served {app.served_on()})",
                 {"report": report, "comparison_path": str(whole) if isinstance(whole, Path) else None})


def _head(prompt: str, n: int = 60) -> str:
    flat = " ".join(prompt.split())
    return repr(flat if len(flat) <= n else flat[:n] + "...")


def _prompt_size(tokens: int | None) -> str:
    return f"{tokens:,} tokens" if tokens else "length unknown"


def _prompt_row(i: int, x: Any) -> dict[str, Any]:
    """A prompt's comparison without the prompt: its number, length and the counts that matter."""
    row = {"n": i, "prompt_tokens": x.prompt_tokens, "same_tokens": x.same_tokens, "verdict": x.verdict,
           "compared": min(x.reference_len, x.candidate_len), "first_divergence": x.first_divergence,
           "logprob_gap": x.logprob_gap}
    return {k: v for k, v in row.items() if v is not None}


def _prompt_line(i: int, x: Any) -> str:
    n = min(x.reference_len, x.candidate_len)
    head = f"{i}. prompt {_prompt_size(x.prompt_tokens)} {_head(x.prompt, 40)}: "
    if x.same_tokens:
        return head + f"identical, {n} tokens compared"
    if x.verdict == "length":
        return head + f"lengths differ ({x.reference_len} vs {x.candidate_len}), same up to {x.first_divergence}"
    gap = "" if x.logprob_gap is None else f", logprob gap {x.logprob_gap:.3f}"
    return head + f"first divergence at token {x.first_divergence} of {n} ({x.verdict}{gap})"


def _write_comparison(app, res: TokenComparison, p: TokenCompareParams) -> Path | str:
    """The whole comparison (every prompt in full) beside the reference record, or in the first evidence root for
    a live comparison: the reply holds the counts, this file the rest. A folder that takes no file costs the
    file, not the comparison (said in its place)."""
    if not p.reference and not app.roots.evidence:
        return "not written (no evidence root)"
    stamp = clock.fine_stamp()
    folder = Path(p.reference).parent if p.reference else app.roots.evidence[0]
    stem = Path(p.reference).stem if p.reference else "tokens-live"
    try:
        out = app.roots.confine(folder / f"{stem}.check-{stamp}.json", "evidence", what="comparison")
        return write_file(out, json.dumps(res.to_dict(), indent=1) + "\n")
    except (ToolFailure, PathNotAllowed, OSError) as exc:
        return f"not written ({clip(exc)})"


def _logprob_inputs(app, p: CompareLogprobsParams) -> CompareLogprobsParams:
    """The reference and corpus confined (the corpus under an evidence or a models root), the endpoint resolved."""
    ref = app.roots.confine(p.reference, "evidence", must_exist=p.mode == "check", what="reference")
    corpus = None
    if p.corpus is not None and Path(p.corpus).expanduser().resolve() != DEFAULT_CORPUS:
        try:
            corpus = app.roots.confine(p.corpus, "evidence", must_exist=True, what="corpus")
        except PathNotAllowed as first:
            try:
                corpus = app.roots.confine(p.corpus, "models", must_exist=True, what="corpus")
            except PathNotAllowed:
                raise first from None
    base_url = resolve_endpoint(p, app.config(), managed=True).base_url
    return p.model_copy(update={"reference": str(ref), "corpus": str(corpus) if corpus else None,
                                "base_url": base_url, "instance": None, "router": False})


@tool(toolset="fidelity", title="Logprob fidelity between builds (KLD)", params=CompareLogprobsParams,
      result=RecordLogprobsResult | CheckLogprobsResult, long=True, destructive=True, open_world=True,
      check=_logprob_inputs, ops={"fidelity.record": {"mode": "record"}, "fidelity.check": {"mode": "check"}})
def compare_logprobs(app, p: CompareLogprobsParams, progress, checked: CompareLogprobsParams) -> Reply:
    """Full-distribution fidelity of two builds over a text corpus: mode=record scores it with the reference
    build into `reference` (REF.json under an evidence root; force=true to replace one), restart with the other
    build, mode=check: mean/p99/max KLD, top-1 agreement, perplexity ratio. Long: progress in windows."""
    res = logprob_fidelity(checked, progress=progress)
    if isinstance(res, RecordLogprobsResult):
        return Reply(res, f"recorded {res.tokens} positions ({res.windows} windows) from {res.model}: {res.path}")
    return Reply(res, f"{res.candidate_model} vs {res.reference_model}: mean KLD {res.mean_kld:.4g}, p99 "
                      f"{res.p99_kld:.4g}, top-1 agreement {100 * res.top1_agreement:.2f}%, PPL ratio "
                      f"{res.ppl_ratio:.4f} over {res.tokens} tokens")


class _Decode(NamedTuple):
    params: DecodeParams
    endpoint: Endpoint
    config: Any


def _decode_inputs(app, p: DecodeParams) -> _Decode:
    """The run's folder confined, the server a managed one (not whatever holds the config's port)."""
    out = app.roots.confine(p.out, "evidence", what="out")
    cfg = app.config()
    return _Decode(p.model_copy(update={"out": out}), resolve_endpoint(p, cfg, managed=True), cfg)


@tool(toolset="decode", title="Single-stream decode benchmark (speculative decoding)", params=DecodeParams,
      result=DecodeSummary, long=True, open_world=True, check=_decode_inputs, ops="decode")
def run_decode_bench(app, p: DecodeParams, progress, checked: _Decode) -> Reply:
    """Time per output token for one user: twenty chat prompts one at a time, streamed, with the drafter's
    acceptance from /metrics when the server runs speculative decoding; writes a run folder under an evidence
    root. Long: progress in prompts."""
    res = run_decode(checked.params, serve_config=checked.config, endpoint=checked.endpoint,
                     progress=progress)
    acc = (f", {100 * res.acceptance_rate:.0f}% of {res.draft_tokens:.0f} draft tokens accepted"
           if res.acceptance_rate is not None else ", no drafts")
    summary = (f"decode {res.run_id}: median {res.median_tpot_ms or 0:.2f} ms per token, TTFT "
               f"{res.median_ttft_ms or 0:.0f} ms over {len(res.prompts)} prompts{acc}")
    # The per-prompt token ids and texts stay in the run folder.
    return Reply(res.model_dump(mode="json", exclude={"prompts"}), summary)
