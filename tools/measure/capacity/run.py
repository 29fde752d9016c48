"""`./vllm-t4 capacity`: how many users (or requests per second) one server serves within a latency target.

The search (tools/measure/capacity/search.py) asks for points; each point is a sweep cell measured in the
sweep's one benchmark worker (tools/measure/sweep/cells.measure_repeats: vLLM's `bench serve`, its own seeds, a
warm-up, `--goodput` with the SLO's per-request limits), `repeats` at a time. The run folder is a sweep run
folder (raw/, summary.*, plot.png, provenance.json) plus capacity.json and capacity.md, built under a temporary
name and renamed when complete (tools/measure/evidence.EvidenceRun): a stopped or refused search leaves none.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from tools.core.errors import BadInput, ToolFailure, param
from tools.core.output_check import check_output_folder
from tools.core.progress import Progress
from tools.core import clock
from tools.measure import evidence, provenance as prov_mod
from tools.measure.sweep import report as sweep_report
from tools.measure.basis import priced_on
from tools.measure.capacity.report import CapacityResult, statement, write_capacity
from tools.measure.capacity.search import Sample, Search, search_capacity
from tools.measure.capacity.slo import Term, goodput_limits, parse_slo, slo_text
from tools.measure.sweep.params import DEFAULT_PRICE_PER_HOUR, CellResult, SweepParams, SweepResult, Tokens
from tools.measure.sweep.cells import Tally, measure_repeats
from tools.measure.sweep.worker import BenchWorker
from tools.measure.endpoint import Endpoint, resolve_endpoint
from tools.serving.config import ServeConfig


class CapacityParams(SweepParams):
    """Options of one capacity search: `./vllm-t4 capacity` flags and find_capacity's arguments."""

    CLI_FLAGS: ClassVar[dict[str, str]] = {"max_load": "--max", "cell_timeout_s": "--cell-timeout"}
    CLI_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"input_lens", "concurrencies", "resume", "run_id"})
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset(
        {"input_lens", "concurrencies", "resume", "run_id", "tokenizer", "model", "cell_timeout_s",
         "prompts_per_concurrency", "min_prompts", "warmup", "rel_tol", "noise_rounds"})

    slo: str = Field("ttft_p99_ms=1000,tpot_p99_ms=100",
                     description="Latency target: METRIC_pPCT_ms=LIMIT terms, comma separated (ttft, tpot, itl, "
                                 "e2el at p50, p90, p99)")
    input_len: Tokens = Field(512, description="Prompt length in tokens")
    load: Literal["concurrency", "rate"] = Field("concurrency", description="Search concurrent users, or a "
                                                                            "Poisson request rate (req/s)")
    max_load: float = Field(64, gt=0, le=100_000, allow_inf_nan=False,
                            description="Highest load searched (users or req/s)")
    start: float = Field(1, gt=0, le=100_000, allow_inf_nan=False,
                         description="First load measured; doubled until a point fails")
    repeats: int = Field(2, ge=1, le=1000, description="Repeats per point (two or more give each term an interval)")
    noise_rounds: int = Field(1, ge=0, le=100, description="Extra rounds for a point whose interval holds a limit")
    rel_tol: float = Field(0.1, gt=0, lt=1, allow_inf_nan=False,
                           description="Rate searches stop when first fail / last pass <= 1 + this")
    label: str = Field("build", description="Build name for tables and the run id")

    def checked_terms(self) -> list[Term]:
        """The SLO parsed and the options checked: BadInput naming the first bad one, before anything is
        measured or written."""
        terms = parse_slo(self.slo)
        self.validate()
        if not self.max_load > 0 or not self.start > 0 or self.start > self.max_load:
            raise BadInput(f"{param('start')} {self.start:g} and {param('max_load')} {self.max_load:g} must be "
                           f"positive with start <= max", field="max_load")
        if self.load == "concurrency" and (self.start != int(self.start) or self.max_load != int(self.max_load)):
            raise BadInput(f"concurrencies are whole numbers: {param('start')} {self.start:g}, "
                           f"{param('max_load')} {self.max_load:g}", field="max_load")
        if self.input_len <= 0 or self.noise_rounds < 0 or not 0 < self.rel_tol < 1:
            raise BadInput(f"{param('input_len')} must be positive, {param('noise_rounds')} >= 0 and "
                           f"{param('rel_tol')} between 0 and 1", field="input_len")
        return terms

    def prompts_at(self, load: float) -> int:
        return max(self.min_prompts, math.ceil(load * self.prompts_per_concurrency))


def run_capacity(params: CapacityParams, *, progress: Progress | None = None,
                 serve_config: ServeConfig | None = None) -> CapacityResult:
    """Search the capacity against the running server (or params' endpoint); returns and saves the run."""
    terms = params.checked_terms()
    return capacity(params, terms, resolve_endpoint(params, serve_config), progress=progress,
                    serve_config=serve_config)


def capacity(params: CapacityParams, terms: list[Term], endpoint: Endpoint, *, progress: Progress | None = None,
             serve_config: ServeConfig | None = None) -> CapacityResult:
    """The search with checked parameters (CapacityParams.checked_terms) against a resolved endpoint."""
    check_output_folder(params.out)  # before the server is asked: a search that cannot write is refused at once
    base_url = endpoint.base_url
    if endpoint.config is not None:
        serve_config = endpoint.config
    server, model = prov_mod.served_model(base_url, params.model)
    max_len = server.max_model_len
    if max_len is not None and params.input_len + params.output_len > max_len:
        raise BadInput(f"{param('input_len')} {params.input_len} + {param('output_len')} {params.output_len} is "
                       f"more than the server's max_model_len {max_len}", field="input_len")
    prov = evidence.collect_provenance(base_url, serve_config=serve_config, server=server)
    prov.endpoint = endpoint.to_dict()
    seqs = evidence.argv_option(prov.server_argv, "--max-num-seqs")
    max_num_seqs = int(seqs) if seqs and seqs.isdigit() else None
    sp = params.model_copy(update={"input_lens": [params.input_len], "concurrencies": []})
    digest = evidence.run_digest([slo_text(terms), params.identity(), params.load, params.input_len])
    Path(params.out).mkdir(parents=True, exist_ok=True)
    run = evidence.EvidenceRun.create(params.out, evidence.run_id("capacity", params.label, digest))
    try:
        res = _search(sp, terms, run, base_url=base_url, model=model, tokenizer=params.tokenizer
                      or server.model_root or model, max_num_seqs=max_num_seqs, prov=prov.to_dict(),
                      max_len=max_len, progress=progress)
        run.finish()
    except BaseException:
        run.abandon()
        raise
    return res


def _search(params: CapacityParams, terms: list[Term], run: evidence.EvidenceRun, *, base_url: str, model: str,
            tokenizer: str, max_num_seqs: int | None, prov: dict[str, Any], max_len: int | None,
            progress: Progress | None) -> CapacityResult:
    t0 = time.monotonic()
    run_dir = run.dir
    evidence.write_json(run_dir / "provenance.json", prov)
    sweep = SweepResult(run_id=run.name, run_dir=str(run.path), label=params.label,
                        params=params.model_dump(mode="json"), max_model_len=max_len, model=model,
                        started=clock.iso(), provenance=prov)
    goodput = goodput_limits(terms)
    conc = params.load == "concurrency"
    steps = 2 * max(1, math.ceil(math.log2(max(2.0, params.max_load / params.start)))) + 1
    tally = Tally(steps * params.repeats, progress)
    cells: dict[float, CellResult] = {}

    with BenchWorker() as worker:
        def measure(load: float) -> Sample:
            cell = cells.get(load)
            if cell is None:
                cell = cells[load] = CellResult(input_len=params.input_len, output_len=params.output_len,
                                                concurrency=int(load) if conc else 0,
                                                request_rate=None if conc else load,
                                                num_prompts=params.prompts_at(load), status="ok")
                sweep.cells.append(cell)
            k0 = len(cell.repeats)
            measure_repeats(params, cell, list(range(k0, k0 + params.repeats)), worker, base_url=base_url,
                            model=model, tokenizer=tokenizer, raw_dir=run_dir / "raw", tally=tally,
                            goodput=goodput or None)
            sweep.wall_s = time.monotonic() - t0
            sweep_report.write_run(sweep, run_dir, price_per_hour=params.price_per_hour, plot=False,
                                   final_dir=run.path)
            if cell.status != "ok":
                return Sample(failed=cell.reason or "failed")
            new = cell.repeats[k0:]
            return Sample(values={t.key: [r.metrics[t.key] for r in new if r.metrics.get(t.key) is not None]
                                  for t in terms})

        found = search_capacity(measure, terms, max_load=params.max_load, start=params.start, integer=conc,
                                max_num_seqs=max_num_seqs, rel_tol=params.rel_tol,
                                noise_rounds=params.noise_rounds)
    sweep.cells.sort(key=lambda c: c.load)
    sweep.finished = clock.iso()
    sweep.wall_s = time.monotonic() - t0
    sweep_report.write_run(sweep, run_dir, price_per_hour=params.price_per_hour, plot=True, final_dir=run.path)
    res = result_of(params, terms, found, cells.get(found.capacity) if found.capacity is not None else None,
                    run_id=run.name, run_dir=str(run.path), max_num_seqs=max_num_seqs, prov=prov)
    res.wall_s = time.monotonic() - t0
    res.files = dict(sweep.files)
    write_capacity(res, run_dir, final_dir=run.path)
    return res


def result_of(params: CapacityParams, terms: list[Term], found: Search, cell: CellResult | None, *, run_id: str,
              run_dir: str, max_num_seqs: int | None, prov: dict[str, Any] | None = None) -> CapacityResult:
    """The capacity result from a finished search and the cell measured at the capacity, labelled with where it
    was measured (`prov`: the run's provenance)."""
    point = found.point(found.capacity)
    out = cell.estimate("output_throughput") if cell else None
    res = CapacityResult(run_id=run_id, run_dir=run_dir, label=params.label, slo=slo_text(terms), terms=terms,
                         load=params.load, input_len=params.input_len, output_len=params.output_len,
                         status=found.status, capacity=found.capacity, last_pass=found.last_pass,
                         first_fail=found.first_fail, max_num_seqs=max_num_seqs, search=found,
                         goodput=cell.estimate("request_goodput") if cell else None, out_tok_s=out,
                         terms_at_capacity=point.terms if point else [], price_per_hour=params.price_per_hour,
                         usd_per_million=sweep_report.cost_per_million(out.mean if out else None,
                                                                       params.price_per_hour))
    if prov:
        res.platform, res.measured_on = prov_mod.measured_on(prov)
        res.cost_basis = priced_on(prov, (prov.get("server") or {}).get("model_id"), params.price_per_hour,
                                   params.price_per_hour != DEFAULT_PRICE_PER_HOUR)
    res.statement = statement(res)
    return res


def failure_if_error(res: CapacityResult) -> None:
    """A search that could not measure a point is a failure of the run, with the run folder to look into."""
    if res.status == "error":
        raise ToolFailure(f"{res.statement}; the measured points are in {res.run_dir}",
                          detail={"run_dir": res.run_dir})
