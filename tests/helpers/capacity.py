"""Recorded capacity run folders without a server: a synthetic build searched, its points written as a sweep
run folder plus capacity.json, exactly as tools/measure/capacity/run.py writes them."""

from __future__ import annotations

from pathlib import Path

from tools.measure.sweep import report as sweep_report
from tools.measure.capacity.run import CapacityParams, result_of
from tools.measure.capacity.report import write_capacity
from tools.measure.capacity.search import Sample, search_capacity
from tools.measure.sweep.params import CellResult, RepeatResult, SweepResult, aggregate


def capacity_run(out: Path, label: str, *, ttft_per_user: float, tok_s_per_user: float = 50.0,
                 slo: str = "ttft_p99_ms=1000", max_load: int = 32, max_num_seqs: int | None = None,
                 rate: bool = False, prov: dict | None = None, price_per_hour: float | None = None) -> Path:
    """A build whose p99 TTFT grows by `ttft_per_user` ms per concurrent user (or per req/s, `rate`) and whose
    output tok/s is `tok_s_per_user` x users^0.8; two repeats per point, 1% apart."""
    params = CapacityParams(slo=slo, label=label, input_len=64, output_len=16, max_load=max_load, out=out,
                            load="rate" if rate else "concurrency",
                            **({} if price_per_hour is None else {"price_per_hour": price_per_hour}))
    terms = params.checked_terms()
    run_dir = out / f"capacity-{label}"
    (run_dir / "raw").mkdir(parents=True)
    cells: dict[float, CellResult] = {}

    def measure(load: float) -> Sample:
        cell = cells.setdefault(load, CellResult(input_len=64, output_len=16, concurrency=0 if rate else int(load),
                                                 request_rate=load if rate else None, num_prompts=4, status="ok"))
        k0 = len(cell.repeats)
        for k, f in enumerate((1.01, 0.99)):
            tok = tok_s_per_user * load ** 0.8 * f
            cell.repeats.append(RepeatResult(repeat=k0 + k, seed=k0 + k, status="ok", num_prompts=4, metrics={
                "p99_ttft_ms": ttft_per_user * load * f, "output_throughput": tok, "request_goodput": tok / 16,
                "mean_tpot_ms": 1000 / tok_s_per_user * f, "max_concurrent_requests": max(1, round(2 * load))}))
        cell.median, cell.spread_pct = aggregate(cell.repeats)
        return Sample(values={"p99_ttft_ms": [r.metrics["p99_ttft_ms"] for r in cell.repeats[k0:]]})

    found = search_capacity(measure, terms, max_load=max_load, max_num_seqs=max_num_seqs, integer=not rate)
    sweep = SweepResult(run_id=run_dir.name, run_dir=str(run_dir), label=label, params=params.model_dump(mode="json"),
                        started="2026-12-01T00:00:00+00:00", finished="2026-12-01T00:01:00+00:00",
                        cells=sorted(cells.values(), key=lambda c: c.load))
    sweep_report.write_run(sweep, run_dir, price_per_hour=params.price_per_hour, plot=False)
    res = result_of(params, terms, found, cells.get(found.capacity) if found.capacity is not None else None,
                    run_id=run_dir.name, run_dir=str(run_dir), max_num_seqs=max_num_seqs, prov=prov)
    write_capacity(res, run_dir)
    return run_dir
