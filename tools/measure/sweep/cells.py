"""A sweep cell's repeats measured in the benchmark worker (tools/measure/sweep/worker.py), shared by the sweep's
run (tools/measure/sweep/run.py) and the capacity search (tools/measure/capacity/run.py): each repeat's prompt seed,
the records a run left, the count of repeats done, the cell's medians and status."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from tools.core.progress import Progress
from tools.measure import evidence
from tools.measure.sweep.params import (CellResult, CellSpec, RepeatResult, SweepParams, aggregate,
                                        cell_acceptance, cell_stem, raw_name)
from tools.measure.sweep.worker import BenchWorker
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


def cell_spec(params: SweepParams, cell: CellResult, repeats: list[int], *, base_url: str, model: str,
              tokenizer: str, raw_dir: Path, goodput: dict[str, float] | None = None, seed_kind: str = "measure",
              warmup_kind: str = "warmup", warmup_repeat: int = 0) -> CellSpec:
    """What the worker needs to measure `repeats` of the cell (its concurrency or request rate). Prompt seeds
    come from the cell's load (a rate in mreq/s, distinct per rate) and `seed_kind`; the warm-up's from
    `warmup_kind` and `warmup_repeat`: the sweep warms a cell up once (repeat 0), the capacity search once per
    round (its first repeat). `goodput`: vLLM's per-request limits (ttft, tpot, e2el in ms)."""
    L, c, rate = cell.input_len, cell.concurrency, cell.request_rate
    load = c if rate is None else int(round(rate * 1000))
    return CellSpec(base_url=base_url, model=model, tokenizer=tokenizer, input_len=L, output_len=cell.output_len,
                    concurrency=c, request_rate=rate, goodput=goodput, num_prompts=cell.num_prompts,
                    repeats=tuple(repeats), seeds={k: prompt_seed(params.seed, L, load, k, seed_kind) for k in repeats},
                    warmup_seed=(prompt_seed(params.seed, L, load, warmup_repeat, warmup_kind) if params.warmup
                                 else None),
                    warmup_prompts=c or max(1, min(cell.num_prompts, int(rate or 1))), raw_dir=str(raw_dir),
                    log_file=str(raw_dir / f"{cell_stem(L, c, rate)}.log"))


def measure_cell(params: SweepParams, spec: CellSpec, cell: CellResult, worker: BenchWorker, tally: Tally
                 ) -> dict[int, RepeatResult]:
    """The worker measures the cell's pending repeats; a repeat it left no record of failed, with the reason."""
    L, c, n, base_url, rate = spec.input_len, spec.concurrency, spec.num_prompts, spec.base_url, spec.request_rate
    raw_dir = Path(spec.raw_dir)
    where = f"in={L} " + (f"c={c}" if rate is None else f"rate={rate:g}/s")
    tally.tick(f"{where}: measuring {len(spec.repeats)} repeat(s) of {n} prompts")
    evidence.write_json(raw_dir / f"{spec.stem}.spec.json", spec.model_dump(mode="json"))
    for k in spec.repeats:  # a stale failure record must not survive a failed rerun
        (raw_dir / spec.raw_file(k)).unlink(missing_ok=True)
    tc = time.monotonic()
    rc, why = worker.run_cell(spec, params.cell_timeout_s * len(spec.repeats))
    cell.wall_s = time.monotonic() - tc
    repeats: dict[int, RepeatResult] = {}
    down: bool | None = None  # asked once per cell, when a repeat has no record
    for k in spec.repeats:
        rec = load_done(raw_dir, L, c, k, rate)
        if rec is None:
            reason = why or (f"benchmark process exited with code {rc} before this repeat: "
                             f"{_log_tail(Path(spec.log_file))}")
            if down is None:
                down = not health.answers(base_url, timeout=5.0)
            if down:
                reason += f" (server at {base_url} no longer answers /health)"
            rec = RepeatResult(repeat=k, seed=spec.seeds[k], status="failed", num_prompts=n, reason=reason)
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
    the cell: the capacity search's one measured point, a round at a time, each round with a warm-up of its
    own. `goodput`: vLLM's per-request limits (ttft, tpot, e2el in ms) for its request_goodput."""
    kind = "measure" if cell.request_rate is None else "rate"
    spec = cell_spec(params, cell, ks, base_url=base_url, model=model, tokenizer=tokenizer, raw_dir=raw_dir,
                     goodput=goodput, seed_kind=kind, warmup_kind=f"{kind}-warmup", warmup_repeat=ks[0])
    got = {r.repeat: r for r in cell.repeats}
    got.update(measure_cell(params, spec, cell, worker, tally))
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
