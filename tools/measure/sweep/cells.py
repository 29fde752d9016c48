"""A sweep cell's repeats measured in the benchmark worker (tools/measure/sweep/worker.py), shared by the sweep's
run (tools/measure/sweep/run.py) and the capacity search (tools/measure/capacity/run.py): each repeat's prompt seed,
the records a run left, the count of repeats done, the cell's medians and status."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from tools.core.progress import Progress
from tools.measure import evidence
from tools.measure.sweep.params import CellResult, RepeatResult, SweepParams, aggregate, cell_acceptance
from tools.measure.sweep.worker import BenchWorker, raw_name
from tools.serving import health


def prompt_seed(base: int, input_len: int, concurrency: int, repeat: int, kind: str = "measure") -> int:
    """Deterministic, distinct seed per cell repeat: same prompts for every build, none shared between cells.

    A hash rather than base+offset: the random dataset builds each prompt from offsets drawn from the seed, so
    two lengths with one seed would make the short prompts prefixes of the long ones.
    """
    h = hashlib.sha256(f"{kind}/{base}/{input_len}/{concurrency}/{repeat}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def load_done(raw_dir: Path, input_len: int, concurrency: int, repeat: int,
               request_rate: float | None = None) -> RepeatResult | None:
    f = raw_dir / raw_name(input_len, concurrency, repeat, request_rate)
    if not f.is_file():
        return None
    try:
        rec = json.loads(f.read_text())
        return RepeatResult.model_validate(rec["repeat_result"])
    except (ValueError, KeyError):
        return None  # a torn or foreign file: measure again


def _log_tail(path: Path, n: int = 1) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[-400:]


class Tally:
    """Repeats done of those planned, and the progress callback that hears of each."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.done, self.total, self.progress = 0, total, progress

    def tick(self, msg: str) -> None:
        if self.progress is not None:
            self.progress(self.done, self.total, msg)


def measure_cell(params: SweepParams, spec: dict[str, Any], cell: CellResult, worker: BenchWorker, raw_dir: Path,
                  tally: Tally) -> dict[int, RepeatResult]:
    """The worker measures the cell's pending repeats; a repeat it left no record of failed, with the reason."""
    L, c, n, base_url = spec["input_len"], spec["concurrency"], spec["num_prompts"], spec["base_url"]
    rate = spec.get("request_rate")
    pending: list[int] = spec["repeats"]
    where = f"in={L} " + (f"c={c}" if rate is None else f"rate={rate:g}/s")
    tally.tick(f"{where}: measuring {len(pending)} repeat(s) of {n} prompts")
    stem = raw_name(L, c, 0, rate).rsplit("-", 1)[0]
    spec["log_file"] = str(raw_dir / f"{stem}.log")
    evidence.write_json(raw_dir / f"{stem}.spec.json", spec)
    for k in pending:  # a stale failure record must not survive a failed rerun
        (raw_dir / raw_name(L, c, k, rate)).unlink(missing_ok=True)
    tc = time.monotonic()
    rc, why = worker.run_cell(spec, params.cell_timeout_s * len(pending))
    cell.wall_s = time.monotonic() - tc
    repeats: dict[int, RepeatResult] = {}
    down: bool | None = None  # asked once per cell, when a repeat has no record
    for k in pending:
        rec = load_done(raw_dir, L, c, k, rate)
        if rec is None:
            reason = why or (f"benchmark process exited with code {rc} before this repeat: "
                             f"{_log_tail(raw_dir / f'{stem}.log')}")
            if down is None:
                down = not health.answers(base_url, timeout=5.0)
            if down:
                reason += f" (server at {base_url} no longer answers /health)"
            rec = RepeatResult(repeat=k, seed=spec["seeds"][str(k)], status="failed", num_prompts=n, reason=reason)
        repeats[k] = rec
        tally.done += 1
        tally.tick(f"{where} repeat {k % params.repeats + 1}/{params.repeats}: {rec.status}"
                   + (f", {rec.metrics.get('output_throughput') or 0:.2f} out tok/s" if rec.status == "ok"
                      else f" ({rec.reason})"))
    return repeats


def measure_repeats(params: SweepParams, cell: CellResult, ks: list[int], worker: BenchWorker, *, base_url: str,
                    model: str, tokenizer: str, raw_dir: Path, tally: Tally,
                    goodput: dict[str, float] | None = None) -> CellResult:
    """Measure repeats `ks` of one cell (its concurrency or request rate) in the sweep's worker and add them to
    the cell: the capacity search's one measured point, a round at a time. `goodput`: vLLM's per-request
    limits (ttft, tpot, e2el in ms) for its request_goodput."""
    L, c, rate = cell.input_len, cell.concurrency, cell.request_rate
    load = c if rate is None else int(round(rate * 1000))  # the seed's load: distinct per rate, in mreq/s
    kind = "measure" if rate is None else "rate"
    spec = {"base_url": base_url, "model": model, "tokenizer": tokenizer, "input_len": L,
            "output_len": cell.output_len, "concurrency": c, "request_rate": rate, "goodput": goodput,
            "num_prompts": cell.num_prompts, "repeats": ks,
            "seeds": {str(k): prompt_seed(params.seed, L, load, k, kind) for k in ks},
            "warmup_seed": (prompt_seed(params.seed, L, load, ks[0], f"{kind}-warmup") if params.warmup
                            else None),
            "warmup_prompts": c or max(1, min(cell.num_prompts, int(rate or 1))), "raw_dir": str(raw_dir)}
    got = {r.repeat: r for r in cell.repeats}
    got.update(measure_cell(params, spec, cell, worker, raw_dir, tally))
    finish_cell(params, cell, got)
    return cell


def finish_cell(params: SweepParams, cell: CellResult, repeats: dict[int, RepeatResult]) -> bool:
    """The cell's repeats in order, its status, medians and acceptance; true when a repeat failed."""
    cell.repeats = [repeats[k] for k in sorted(repeats)]
    bad = [r for r in cell.repeats if r.status != "ok"]
    if bad:
        cell.status = "failed"
        cell.reason = f"{len(bad)} of {len(cell.repeats)} repeats failed; first: {bad[0].reason}"
    cell.median, cell.spread_pct = aggregate(cell.repeats)
    cell.acceptance_rate = cell_acceptance(cell.repeats)
    return bool(bad)
