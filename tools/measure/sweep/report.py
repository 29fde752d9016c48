"""Evidence files of a sweep run (summary.json/.csv, the article-form markdown table, a PNG plot) and the
comparison of two or more runs in the article's form (ratios per cell with their 95% interval and a verdict:
faster, slower, within noise; cost per million tokens).

A run folder is read back from its `summary.json` alone, so published figures (evidence/article-t4/*) compare
the same way as fresh runs: metrics that a source did not publish are simply null.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from tools.core.errors import BadInput, op, param
from tools.measure.basis import Basis, basis, differences, no_t4_measurement, priced_basis, priced_on
from tools.measure.evidence import write_text, write_texts
from tools.measure.provenance import other_load
from tools.measure.sweep.params import DEFAULT_PRICE_PER_HOUR, METRICS, SweepResult
from tools.measure.uncertainty import METHOD, Estimate, Ratio, ratio, without_verdict_under_load
from tools.core.params import OpParams, Price

CSV_COLUMNS = ("input_len", "output_len", "concurrency", "num_prompts", "status", "repeats_ok", "repeats",
               *(f"{m}" for m in METRICS), "output_throughput_spread_pct", "mean_ttft_ms_spread_pct",
               "output_throughput_mean", "output_throughput_ci_low", "output_throughput_ci_high", "reason",
               "request_rate")


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def cost_per_million(tok_s: float | None, price_per_hour: float) -> float | None:
    """Dollars per million output tokens when the machine runs at tok_s around the clock."""
    if not tok_s:
        return None
    return price_per_hour / (tok_s * 3600.0) * 1e6


def _load_text(c: Any) -> str:
    return str(c.concurrency) if c.request_rate is None else f"{c.request_rate:g} req/s"


def markdown_run(res: SweepResult, *, price_per_hour: float = DEFAULT_PRICE_PER_HOUR) -> str:
    """One section per input length: `| c | out tok/s | req/s | TTFT ... |`; out tok/s is the
    geometric mean of the repeats with its interval (tools/measure/uncertainty.py), the other columns medians."""
    prov = res.provenance or {}
    hw = prov.get("gpu_name") or (f"CPU: {prov.get('cpu_model')}" if prov.get("cpu_model") else "unknown")
    priced = priced_on(prov, res.model, price_per_hour, price_per_hour != DEFAULT_PRICE_PER_HOUR)
    lines = [f"# Sweep {res.run_id}: {res.label}", "",
             f"Model `{res.model}`, {hw}, vLLM {prov.get('vllm_version_server') or prov.get('vllm_version_client')}, "
             f"max_model_len {res.max_model_len}. Output {res.params.get('output_len')} tokens, greedy, "
             f"`vllm bench serve` random dataset, {res.params.get('repeats')} repeats per cell. Out tok/s, TTFT p99 "
             f"and TPOT mean: geometric mean of the repeats, its 95% confidence interval in parentheses (Student t "
             f"on the log repeats; none with fewer than two); other columns: medians; spread = (max-min)/median of "
             f"out tok/s. Cost at {priced}.", ""]
    by_len: dict[int, list] = {}
    for c in res.cells:
        by_len.setdefault(c.input_len, []).append(c)
    for L, cells in by_len.items():
        lines += [f"## {L}-token prompts", "",
                  "| c | out tok/s | req/s | TTFT mean ms | TTFT p99 ms | TPOT mean ms | ITL mean ms "
                  "| spread | $/M out tok | status |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in sorted(cells, key=lambda x: x.load):
            m = c.median
            spread = c.spread_pct.get("output_throughput")
            status = c.status if c.status == "ok" else f"{c.status}: {c.reason}"
            lines.append(
                f"| {_load_text(c)} | {c.output_throughput_ci.text()} | {_fmt(m.get('request_throughput'), 3)} "
                f"| {_fmt(m.get('mean_ttft_ms'), 1)} | {c.estimate('p99_ttft_ms').text(1)} "
                f"| {c.estimate('mean_tpot_ms').text(2)} | {_fmt(m.get('mean_itl_ms'), 2)} "
                f"| {'—' if spread is None else f'{spread:.1f}%'} "
                f"| {_fmt(cost_per_million(c.output_throughput_ci.mean, price_per_hour))} | {status} |")
        if L in res.roofline:
            lines += [f"Single stream (c=1), decode tok/s = 1000 / TPOT mean as a share of the roofline: "
                      f"{res.roofline[L].line()}"]
        lines.append("")
    if res.roofline_note:
        lines += [f"Roofline: none ({res.roofline_note})", ""]
    if res.speculative_config:  # the concurrency question of speculative decoding: acceptance per cell
        import json

        lines += [f"Speculative decoding: `{json.dumps(res.speculative_config)}`. Drafts accepted per cell: "
                  + ", ".join(f"in={c.input_len} c={c.concurrency}: "
                              + ("—" if c.acceptance_rate is None else f"{100 * c.acceptance_rate:.0f}%")
                              for c in res.cells if c.status == "ok"), ""]
    return "\n".join(lines)


def csv_run(res: SweepResult) -> str:
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(CSV_COLUMNS)
    for c in res.cells:
        w.writerow([c.input_len, c.output_len, c.concurrency, c.num_prompts, c.status,
                    sum(r.status == "ok" for r in c.repeats), len(c.repeats),
                    *(c.median.get(m) for m in METRICS), c.spread_pct.get("output_throughput"),
                    c.spread_pct.get("mean_ttft_ms"), c.output_throughput_ci.mean, c.output_throughput_ci.low,
                    c.output_throughput_ci.high, c.reason or "", c.request_rate])
    return buf.getvalue()


def run_labels(runs: list[SweepResult]) -> list[str]:
    """Run labels, qualified by run id when two runs share a label so columns and legends stay distinct."""
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        labels = [f"{r.label} ({r.run_id})" for r in runs]
    return labels


def plot_runs(runs: list[SweepResult], path: str | Path) -> Path:
    """Output tok/s and mean TTFT against concurrency, one line per (run, input length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = ["-", "--", ":", "-."]  # one line style per input length, one colour per run
    all_lens = sorted({c.input_len for r in runs for c in r.cells})
    labels = run_labels(runs)
    ttft_all: list[float] = []
    for i, res in enumerate(runs):
        for L in all_lens:
            cells = sorted((c for c in res.cells if c.input_len == L and c.figure("output_throughput")),
                           key=lambda c: c.concurrency)
            if not cells:
                continue
            name = f"{labels[i]}, in={L}" if len(runs) > 1 else f"in={L}"
            look = dict(color=f"C{i % 10}" if len(runs) > 1 else f"C{all_lens.index(L) % 10}",
                        linestyle=styles[all_lens.index(L) % 4], marker="o", label=name)
            ax1.plot([c.concurrency for c in cells], [c.figure("output_throughput") for c in cells], **look)
            ttft = [(c.concurrency, c.median["mean_ttft_ms"]) for c in cells if c.median.get("mean_ttft_ms")]
            ttft_all += [y for _, y in ttft]
            if ttft:
                ax2.plot([x for x, _ in ttft], [y for _, y in ttft], **look)
    all_c = sorted({c.concurrency for r in runs for c in r.cells})
    for ax, title, ylabel in ((ax1, "Output throughput (geometric mean of the repeats)", "output tok/s"),
                              (ax2, "Time to first token (mean)", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_c or [1])
        ax.set_xticklabels([str(c) for c in all_c] or ["1"])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    ax1.set_ylim(bottom=0)
    if ax2.lines and max(ttft_all) > 20 * min(ttft_all):
        # TTFT spans short and long prompts (and queueing past max-num-seqs): log scale, plain numbers.
        from matplotlib.ticker import FuncFormatter, NullFormatter

        ax2.set_yscale("log")
        ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax2.yaxis.set_minor_formatter(NullFormatter())
    elif ax2.lines:
        ax2.set_ylim(bottom=0)
    else:
        ax2.text(0.5, 0.5, "no TTFT figures in these runs", ha="center", va="center", transform=ax2.transAxes,
                 color="gray")
    fig.suptitle(" vs ".join(labels) if len(runs) > 1 else f"{runs[0].label} ({runs[0].run_id})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_run(res: SweepResult, run_dir: str | Path, *, price_per_hour: float = DEFAULT_PRICE_PER_HOUR,
              plot: bool = True, final_dir: str | Path | None = None) -> dict[str, str]:
    """Write summary.json, summary.csv, summary.md (and plot.png) into run_dir; returns name -> path (under
    `final_dir` where run_dir is a temporary folder renamed to it when complete)."""
    d = Path(run_dir)
    files = {"summary_json": d / "summary.json", "summary_csv": d / "summary.csv", "table_md": d / "summary.md",
             "provenance": d / "provenance.json", "raw": d / "raw"}
    if plot:
        files["plot_png"] = d / "plot.png"
    shown = Path(final_dir) if final_dir is not None else d
    res.files = {k: str(shown / v.relative_to(d)) for k, v in files.items()}
    write_text(files["summary_csv"], csv_run(res))
    write_text(files["table_md"], markdown_run(res, price_per_hour=price_per_hour))
    if plot:
        plot_runs([res], files["plot_png"])
    write_text(files["summary_json"], json.dumps(res.to_dict(), indent=2) + "\n")
    return res.files


def load_run(path: str | Path) -> SweepResult:
    p = Path(path)
    f = p / "summary.json" if p.is_dir() else p
    if not f.is_file():
        raise BadInput(f"{p}: no summary.json; pass a sweep run folder (evidence/<run-id>/)")
    try:
        res = SweepResult.model_validate_json(f.read_text())
    except ValueError as exc:
        raise BadInput(f"{f}: not a sweep summary ({str(exc).splitlines()[0]}); pass a folder written by "
                       f"{op('sweep')}") from exc
    if res.finished is None:  # the folder stays in place while a sweep runs (for --resume): unfinished looks alike
        raise BadInput(f"{p}: this sweep was stopped before it finished ({len(res.cells)} cells begun); "
                       f"complete it with {op('sweep', resume=True, label=res.label)} and its other options",
                       detail={"path": str(p), "finished": None, "cells": len(res.cells)})
    return res


# ----------------------------------------------------------------------------------------------------------
# Comparison


class CompareCell(BaseModel):
    input_len: int
    concurrency: int | float = Field(description="Concurrency, or request rate for a rate cell")
    out_tok_s: list[float | None] = Field(description="Output tok/s per run, in the runs' order: the geometric "
                                                      "mean of the repeats (the recorded median without them)")
    estimates: list[Estimate] = Field(default_factory=list, description="Output tok/s per run with its 95% "
                                                                        "interval")
    ratios: dict[str, float | None] = Field(default_factory=dict,
                                            description="'<last> vs <other>': last / other output tok/s")
    intervals: dict[str, Ratio] = Field(default_factory=dict,
                                        description="'<last> vs <other>': the ratio's 95% interval and verdict "
                                                    "(faster, slower, within noise, no repeats)")


class CostRow(BaseModel):
    label: str
    out_tok_s: float | None
    usd_per_million: float | None


class SweepComparison(BaseModel):
    labels: list[str]
    run_dirs: list[str]
    price_per_hour: float
    method: str = Field(METHOD, description="How values, intervals and verdicts are computed")
    cells: list[CompareCell]
    cost_cell: tuple[int, int | float] | None = Field(None, description="(input_len, concurrency) of the cost "
                                                                         "table")
    cost: list[CostRow] = Field(default_factory=list)
    across: dict[str, str] = Field(default_factory=dict, description="Ratios across models, platforms or vLLM "
                                                                     "versions: what differs")
    caveat: str | None = Field(None, description="What the ratios compare besides builds; members never on a T4")
    markdown: str = ""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def text(self) -> str:
        return self.markdown

    def summary(self) -> str:
        """One line: the runs, the cell count, the verdicts counted over every cell (a first cell alone would
        hide the others'), and the first cell's ratios."""
        first = self.cells[0].intervals.items() if self.cells else []
        counts: dict[str, int] = {}
        for cell in self.cells:
            for r in cell.intervals.values():
                counts[r.verdict or "no value"] = counts.get(r.verdict or "no value", 0) + 1
        tally = ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        return (f"{self.caveat}; " if self.caveat else "") + f"compared {', '.join(self.labels)} over " \
            f"{len(self.cells)} cells" + (
            f" (verdicts: {tally})" if tally else "") + (
            "; first cell " + "; ".join(f"{k}: {r.cell()}" for k, r in first) if first else "")


def compare_runs(paths: list[str | Path], *, price_per_hour: float = DEFAULT_PRICE_PER_HOUR,
                 cost_cell: tuple[int, int] | None = None) -> SweepComparison:
    """Compare runs in the article's form: the LAST run against each earlier one, per cell.

    Each cell's output tok/s is the geometric mean of its repeats with a 95% interval, each ratio carries its
    95% interval and a verdict (faster, slower, within noise, no repeats), all by tools/measure/uncertainty.py.
    Ratios are written one way, `1.37x` (the article's "+37%") and `2.30x`. The cost table uses cost_cell, by
    default the first input length at the concurrency where the last run peaks.
    """
    if len(paths) < 2:
        raise BadInput("sweep-compare needs two or more run folders (earlier builds first, the candidate last)")
    runs = [load_run(p) for p in paths]
    labels = run_labels(runs)
    last = labels[-1]
    bases = [basis(r.provenance, r.model) for r in runs]
    across = {lab: differences(bases[-1], b) for lab, b in zip(labels[:-1], bases[:-1])}
    # a pair that differs says so in the ratio's own name, so every place that prints the ratio says it
    pair = {lab: f"{last} vs {lab}" + (f" (other {', '.join(w for w, _ in d)})" if d else "")
            for lab, d in across.items()}
    keys = sorted({c.key for r in runs for c in r.cells})
    loads = {lab: other_load(r.provenance) for lab, r in zip(labels, runs)}
    loaded = {lab: loads[last] is not None or loads[lab] is not None for lab in labels[:-1]}
    cells: list[CompareCell] = []
    for L, c in keys:
        ests = []
        for r in runs:
            cell = r.cell(L, c)
            ests.append(cell.estimate() if cell else Estimate(n=0, mean=None))
        # Nearest predecessor first, as the article orders "emb4 vs QAT" before "emb4 vs bf16".
        intervals = {pair[lab]: without_verdict_under_load(ratio(ests[-1], est), loaded[lab])
                     for lab, est in reversed(list(zip(labels[:-1], ests[:-1])))}
        cells.append(CompareCell(input_len=L, concurrency=c, out_tok_s=[e.mean for e in ests], estimates=ests,
                                 ratios={k: v.value for k, v in intervals.items()}, intervals=intervals))
    if cost_cell is None:
        first_len = keys[0][0] if keys else None
        cands = [cc for cc in cells if cc.input_len == first_len and cc.out_tok_s[-1]]
        if cands:
            best = max(cands, key=lambda cc: cc.out_tok_s[-1] or 0)
            cost_cell = (best.input_len, best.concurrency)
    cost: list[CostRow] = []
    if cost_cell is not None:
        cc = next((x for x in cells if (x.input_len, x.concurrency) == tuple(cost_cell)), None)
        if cc is None:
            raise BadInput(f"cost cell input {cost_cell[0]}, c={cost_cell[1]} is in none of the runs")
        cost = [CostRow(label=lab, out_tok_s=tp, usd_per_million=cost_per_million(tp, price_per_hour))
                for lab, tp in zip(labels, cc.out_tok_s)]
    cmp = SweepComparison(labels=labels, run_dirs=[str(p) for p in paths], price_per_hour=price_per_hour,
                          cells=cells, cost_cell=cost_cell, cost=cost,
                          caveat=caveat(labels, bases, across, loads),
                          across={pair[lab]: "; ".join(f"{w}: {how}" for w, how in d)
                                  for lab, d in across.items() if d})
    given = price_per_hour != DEFAULT_PRICE_PER_HOUR
    cmp.markdown = markdown_comparison(
        cmp, measured="; ".join(f"{lab}: {b.model} on {b.machine}" + (f", vLLM {b.vllm}" if b.vllm else "")
                                for lab, b in zip(labels, bases)),
        priced=list(dict.fromkeys(priced_basis(b, price_per_hour, given) for b in bases)))
    return cmp


def caveat(labels: list[str], bases: list[Basis], across: dict[str, list[tuple[str, str]]],
           loads: dict[str, float | None] | None = None) -> str | None:
    """The comparison's first words where its ratios compare more than builds (other models, machines, vLLM
    versions; other work on the machine during a run: provenance.other_load), and members without a T4
    measurement (what stands in for one)."""
    parts = [f"ACROSS {'; '.join(f'{w} ({how})' for w, how in d)}: {labels[-1]} vs {lab} is no build's ratio"
             for lab, d in across.items() if d]
    parts += list(dict.fromkeys(n for b in bases if (n := no_t4_measurement(b))))
    busy = {lab: x for lab, x in (loads or {}).items() if x is not None}
    if busy:
        parts.append("OTHER WORK on the machine around " + ", ".join(f"{lab} ({x:.1f} cores busy" + (
            " while none of its requests was in flight)" if i == 0 else ")") for i, (lab, x) in enumerate(busy.items()))
            + ": a ratio with " + ("it" if len(busy) == 1 else "them") + " measures that load too")
    return "; ".join(parts) or None


def markdown_comparison(cmp: SweepComparison, *, measured: str, priced: list[str]) -> str:
    """The comparison as a report: what each run measured and where (`measured`), the tables, and the cost
    table with how each run was priced (`priced`: a T4's price on a CPU's throughput is no cost of either)."""
    lines: list[str] = ([f"**{cmp.caveat}.**", ""] if cmp.caveat else []) + [
        f"Measured: {measured}.", "",
        f"Output tok/s per cell and the last run against each earlier one. {cmp.method}", ""]
    for L in sorted({c.input_len for c in cmp.cells}):
        rows = [x for x in cmp.cells if x.input_len == L]
        names = list(rows[0].intervals)
        lines += [f"## {L}-token prompts", "",
                  "| c | " + " | ".join(f"{lab} out tok/s" for lab in cmp.labels) + " | " + " | ".join(names) + " |",
                  "|---|" + "---|" * (len(cmp.labels) + len(names))]
        for cc in rows:
            lines.append(f"| {cc.concurrency:g} | " + " | ".join(e.text() for e in cc.estimates) + " | "
                         + " | ".join(cc.intervals[n].cell() for n in names) + " |")
        lines.append("")
    if cmp.cost:
        L, c = cmp.cost_cell or (None, None)
        lines += [f"## Cost per million output tokens ({L}-token prompts, c={c}, ${cmp.price_per_hour}/h)", "",
                  f"Priced at {'; '.join(priced)}.", "",
                  "| Build | Output tok/s | Per million output tokens |", "|---|---|---|"]
        for row in cmp.cost:
            usd = "—" if row.usd_per_million is None else f"${row.usd_per_million:.2f}"
            lines.append(f"| {row.label} | {_fmt(row.out_tok_s)} | {usd} |")
        lines.append("")
    return "\n".join(lines)


class CompareSweepsParams(OpParams):
    """What compare_sweeps is asked (`./vllm-t4 sweep-compare` reads the same fields)."""

    run_dirs: list[str] = Field(min_length=2, description="run_sweep run folders, baselines first, "
                                                          "the candidate last")
    output: str | None = Field(None, description="Optional .md file for it (and a .json), "
                                                 "outside the run folders")
    price_per_hour: Price = Field(DEFAULT_PRICE_PER_HOUR, description="Machine $/hour (default: the "
                                                                      "article's T4 VM)")
    force: bool = Field(False, description="Replace an existing output")


def write_comparison(cmp: SweepComparison, out: str | Path, *, force: bool = False) -> Path:
    """Write the comparison as OUT (markdown) and OUT.json, atomically.

    Refuses an output inside an input run folder (it would replace that run's own summary files) and an
    existing output unless `force`; nothing is written when it refuses.
    """
    md = Path(out)
    js = md.with_suffix(".json")
    for run in cmp.run_dirs:
        r = Path(run).resolve()
        for f in (md, js):
            if r == f.resolve().parent or r in f.resolve().parents:
                raise BadInput(f"output {f} lies inside the input run folder {run}; write the comparison "
                               f"somewhere else", detail={"output": str(f), "run_dir": str(run)})
    for f in (md, js):  # --force replaces a file, never a folder (or anything else) in the way
        if (f.exists() or f.is_symlink()) and not f.is_file():
            raise BadInput(f"output {f} is a folder or not a regular file; give another output",
                           detail={"output": str(f)})
    existing = [str(f) for f in (md, js) if f.exists()]
    if existing and not force:
        raise BadInput(f"{', '.join(existing)} exists; pass {param('force', True)} to replace it, or give another "
                       f"output",
                       detail={"existing": existing})
    md.parent.mkdir(parents=True, exist_ok=True)
    write_texts((js, json.dumps(cmp.to_dict(), indent=2) + "\n"), (md, cmp.markdown + "\n"))
    return md

