"""`./vllm-t4 pareto`: output tok/s per user against tok/s per GPU, one curve per build (vLLM's plot_pareto
shape), from any sweep or capacity run folders.

Per cell: tok/s per GPU = output tok/s / the server's tensor-parallel size (1 without one); tok/s per user =
output tok/s / the users: the cell's concurrency, or for a request-rate cell the most requests vLLM's benchmark
saw in flight (its max_concurrent_requests, median over the repeats). Output tok/s is the geometric mean of the
cell's repeats with its 95% interval (tools/measure/uncertainty.py). A build's curve joins its Pareto-optimal
cells (no other cell of the build is better on both axes); every cell is drawn.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from tools.core.errors import BadInput, op
from tools.measure import evidence
from tools.measure.capacity.report import is_capacity_run
from tools.measure.sweep.params import DEFAULT_OUT, SweepResult
from tools.measure.sweep.report import load_run, run_labels
from tools.measure.uncertainty import METHOD

# Each run is read whole and plotted: beyond this many the command runs for minutes and holds gigabytes, and
# no one reads the figure.
MAX_RUNS = 50


class ParetoPoint(BaseModel):
    label: str
    input_len: int
    load: str = Field(description="c=N, or N req/s")
    users: float
    tok_s_per_user: float
    tok_s_per_gpu: float
    low: float | None = Field(None, description="Output tok/s per GPU, 95% interval lower end")
    high: float | None = None
    frontier: bool = False


class Pareto(BaseModel):
    labels: list[str]
    run_dirs: list[str]
    points: list[ParetoPoint]
    dropped: int = Field(0, description="Cells left out because a metric is not a finite number (NaN, Infinity)")
    run_dir: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    markdown: str = ""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def summary(self) -> str:
        return f"pareto of {', '.join(self.labels)}: {len(self.points)} cells, " \
               f"{sum(p.frontier for p in self.points)} on the frontiers" + _dropped_note(self.dropped)


def _dropped_note(n: int) -> str:
    return f"; {n} cell{'s' if n != 1 else ''} left out (a metric is not a finite number)" if n else ""


def _gpus(run: SweepResult) -> int:
    tp = evidence.argv_option((run.provenance or {}).get("server_argv"), "--tensor-parallel-size")
    return int(tp) if tp and tp.isdigit() and int(tp) > 0 else 1


def points_of(run: SweepResult, label: str) -> tuple[list[ParetoPoint], int]:
    """The build's plotted cells, and how many were left out because a metric is NaN or infinite (a damaged
    summary.json): such a point would sit on every frontier as `nan`."""
    gpus, out, dropped = _gpus(run), [], 0
    for c in run.cells:
        e = c.estimate("output_throughput")
        users = float(c.concurrency) if c.request_rate is None else (c.median.get("max_concurrent_requests") or 0)
        if c.status != "ok" or not e.mean or not users:
            continue
        if not (math.isfinite(e.mean) and math.isfinite(users)):
            dropped += 1
            continue
        finite_ci = e.low is not None and e.high is not None and math.isfinite(e.low) and math.isfinite(e.high)
        out.append(ParetoPoint(label=label, input_len=c.input_len, users=users,
                               load=f"c={c.concurrency}" if c.request_rate is None else f"{c.request_rate:g} req/s",
                               tok_s_per_user=e.mean / users, tok_s_per_gpu=e.mean / gpus,
                               low=e.low / gpus if finite_ci else None, high=e.high / gpus if finite_ci else None))
    for p in out:  # on the frontier: no other cell of the build at least as good on both axes and better on one
        p.frontier = not any(q is not p and q.input_len == p.input_len and q.tok_s_per_user >= p.tok_s_per_user
                             and q.tok_s_per_gpu >= p.tok_s_per_gpu
                             and (q.tok_s_per_user, q.tok_s_per_gpu) != (p.tok_s_per_user, p.tok_s_per_gpu)
                             for q in out)
    return out, dropped


def _load(path: str | Path) -> SweepResult:
    try:
        return load_run(path)
    except BadInput as exc:
        p = Path(path)
        if not is_capacity_run(p):
            raise
        # A capacity run keeps its points in summary.json too: the remedy is to measure the capacity again.
        raise BadInput(f"{p / 'summary.json'}: a capacity run's points are missing or damaged; measure it again "
                       f"with {op('capacity')}", detail={"path": str(p)}) from exc


def pareto(paths: list[str | Path]) -> Pareto:
    if not paths:
        raise BadInput(f"{op('pareto')} needs one or more sweep or capacity run folders")
    if len(paths) > MAX_RUNS:
        raise BadInput(f"{op('pareto')} takes at most {MAX_RUNS} run folders ({len(paths)} given): plot fewer builds "
                       f"at a time", detail={"runs": len(paths), "limit": MAX_RUNS})
    runs = [_load(p) for p in paths]
    labels = run_labels(runs)
    per_run = [points_of(run, lab) for run, lab in zip(runs, labels)]
    res = Pareto(labels=labels, run_dirs=[str(p) for p in paths], points=[p for pts, _ in per_run for p in pts],
                 dropped=sum(n for _, n in per_run))
    res.markdown = markdown(res)
    return res


def markdown(res: Pareto) -> str:
    lines = ["# Pareto: output tok/s per user against tok/s per GPU", "",
             "| Build | prompt | load | users | tok/s per user | tok/s per GPU | frontier |",
             "|---|---|---|---|---|---|---|"]
    for p in sorted(res.points, key=lambda p: (res.labels.index(p.label), p.input_len, p.users)):
        ci = f" ({p.low:,.2f}–{p.high:,.2f})" if p.low is not None and p.high is not None else ""
        lines.append(f"| {p.label} | {p.input_len} | {p.load} | {p.users:g} | {p.tok_s_per_user:,.2f} "
                     f"| {p.tok_s_per_gpu:,.2f}{ci} | {'yes' if p.frontier else ''} |")
    if res.dropped:
        lines += ["", f"Left out: {res.dropped} cell{'s' if res.dropped != 1 else ''} whose output tok/s or users is "
                      "not a finite number (NaN or Infinity in summary.json)."]
    lines += ["", "Users: the cell's concurrency (for a request-rate cell, the most requests in flight); per GPU: "
              "divided by the server's tensor-parallel size. " + METHOD, ""]
    return "\n".join(lines)


def plot(res: Pareto, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    lens = sorted({p.input_len for p in res.points})
    for i, lab in enumerate(res.labels):
        for j, L in enumerate(lens):
            pts = [p for p in res.points if p.label == lab and p.input_len == L]
            if not pts:
                continue
            name = lab if len(lens) == 1 else f"{lab}, in={L}"
            ax.scatter([p.tok_s_per_user for p in pts], [p.tok_s_per_gpu for p in pts], color=f"C{i % 10}",
                       marker="os^D"[j % 4], alpha=0.5)
            front = sorted((p for p in pts if p.frontier), key=lambda p: p.tok_s_per_user)
            ax.plot([p.tok_s_per_user for p in front], [p.tok_s_per_gpu for p in front], color=f"C{i % 10}",
                    linestyle=["-", "--", ":", "-."][j % 4], marker="os^D"[j % 4], label=name)
            for p in front:
                ax.annotate(p.load, (p.tok_s_per_user, p.tok_s_per_gpu), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set_xlabel("output tok/s per user")
    ax.set_ylabel("output tok/s per GPU")
    ax.set_title("Pareto: per-user speed against per-GPU throughput")
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def write_pareto(res: Pareto, out: str | Path = DEFAULT_OUT) -> Pareto:
    """pareto.png, pareto.md and pareto.json in a new evidence folder `<out>/pareto-<stamp>/`, published whole;
    on failure no folder it made (not even an empty out) is left behind."""
    made = [d for d in (Path(out), *Path(out).parents) if not d.exists()]
    Path(out).mkdir(parents=True, exist_ok=True)
    try:
        _publish(res, out)
    except BaseException:
        for d in made:  # deepest first; one holding anything else stays
            try:
                d.rmdir()
            except OSError:
                break
        raise
    return res


def _publish(res: Pareto, out: str | Path) -> None:
    run = evidence.EvidenceRun.create(out, evidence.run_id("pareto"))
    try:
        run.raw.rmdir()  # no raw records: the figures are the input runs'
        res.run_dir = str(run.path)
        res.files = {n: str(run.path / n) for n in ("pareto.png", "pareto.md", "pareto.json")}
        plot(res, run.dir / "pareto.png")
        evidence.write_text(run.dir / "pareto.md", res.markdown)
        evidence.write_text(run.dir / "pareto.json", json.dumps(res.to_dict(), indent=2) + "\n")
        run.finish()
    except BaseException:
        run.abandon()
        raise
