"""The serving sweep: vLLM's own `vllm bench serve` over input lengths x concurrencies x repeats, saved as evidence.

One cell is (input length, concurrency). The cells run in one benchmark worker process per sweep
(tools/measure/sweep/worker.py). The server's /health is asked again only after a cell failed (a server that dies
shows in the requests' results).

Prompts: vLLM's random dataset is deterministic in its seed. Each (input length, concurrency, repeat) gets its
own seed derived from the sweep's base seed, so every build answers the same prompts, and no measured prompt
was seen before by the server (prefix caching stays on, as served; the warm-up uses separate seeds). The
prefix-cache hits during each measured repeat are read from the server's /metrics and recorded as the check.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from tools.core.atomic_files import HeldFolder
from tools.core.errors import BadInput
from tools.measure import evidence, provenance as prov_mod
from tools.measure.sweep import report as sweep_report
from tools.core.output_check import check_output_folder
from tools.core.progress import Progress
from tools.core import clock
from tools.measure.sweep.params import CellResult, RepeatResult, SweepParams, SweepResult
from tools.measure.roofline import SPECULATIVE_NOTE, Roofline, roofline_or_reason, sweep_context
from tools.measure.spec_metrics import speculative_from_argv
from tools.measure.sweep.cells import Tally, cell_spec, finish_cell, load_done, measure_cell, prompt_seed
from tools.measure.sweep.worker import BenchWorker
from tools.serving import health
from tools.measure.endpoint import Endpoint, request_counts, resolve_endpoint
from tools.serving.config import ServeConfig


def _run_dir(params: SweepParams, out: Path) -> HeldFolder:
    """The run's folder, created or found and held for the sweep (tools.core.atomic_files.HeldFolder): a run id
    given or a resumed run is that folder (refused while another sweep writes it); a new run's time-stamped name
    is reserved, with a suffix where a run started in the same second has it."""
    if params.run_id:
        return HeldFolder.reserve(out, params.run_id, exact=True)
    digest = evidence.run_digest(params.identity())
    suffix = f"-{params.label}-{digest}"
    if params.resume:
        named = re.compile(rf".*{re.escape(suffix)}(-[0-9]+)?")  # -2, -3: a run started in the same second
        existing = sorted((p for p in out.glob(f"*{suffix}*") if named.fullmatch(p.name) and p.is_dir()),
                          key=lambda p: p.name)
        if existing:
            return HeldFolder.hold(existing[-1])
    return HeldFolder.reserve(out, evidence.run_id("sweep", params.label, digest))


def _refuse_links(run_dir: Path, out: Path) -> None:
    """A resumed run folder is read and written in place: a link in it (the folder, raw/ or a file in raw/) would
    lead both out of `out`, and out of the MCP server's roots."""
    raw_dir = run_dir / "raw"
    links = [p for p in (run_dir, raw_dir, *(raw_dir.iterdir() if raw_dir.is_dir() else ())) if p.is_symlink()]
    if links:
        raise BadInput(f"{run_dir}: {links[0].relative_to(out)} is a symbolic link, which a resumed sweep "
                       f"would read and write through; remove the links, or sweep into a new folder (no "
                       f"resume)",
                       detail={"path": str(run_dir), "links": [str(p) for p in links[:10]]})


def run_sweep(params: SweepParams | None = None, *, progress: Progress | None = None,
              serve_config: ServeConfig | None = None, **overrides: Any) -> SweepResult:
    """Run (or resume) a sweep against a live OpenAI-compatible vLLM server; returns and saves the evidence.

    `overrides` set SweepParams fields by name. The parameters are checked and the endpoint resolved here, once;
    a caller that has done both (the MCP server) calls `sweep` itself. `serve_config` (a
    tools.serving.config.ServeConfig) names the server tools/ started: its URL is the default base_url and its
    argv and engine start fields go into the provenance (default: the project's tpu.env).
    """
    if params is None or overrides:
        params = SweepParams(**{**(params or SweepParams()).model_dump(), **overrides})
    params.validate()
    return sweep(params, resolve_endpoint(params, serve_config), progress=progress, serve_config=serve_config)


def sweep(params: SweepParams, endpoint: Endpoint, *, progress: Progress | None = None,
          serve_config: ServeConfig | None = None) -> SweepResult:
    """Run (or resume) a sweep with checked parameters (SweepParams.validate) against a resolved endpoint.

    `progress` is called with (repeats done, repeats planned, message) as cells start and after every measured
    repeat. `serve_config`: as for run_sweep; the endpoint's own configuration (a named instance) wins.
    """
    check_output_folder(params.out)  # before the server is asked: a sweep that cannot write is refused at once
    base_url = endpoint.base_url
    if endpoint.config is not None:  # the instance measured: its start record goes into the provenance
        serve_config = endpoint.config
    server, model = prov_mod.served_model(base_url, params.model)
    tokenizer = params.tokenizer or server.model_root or model
    out = Path(params.out)
    with _run_dir(params, out) as held:  # no other sweep writes this folder while this one does
        return _sweep_into(params, held.path, out, endpoint, base_url=base_url, server=server, model=model,
                           tokenizer=tokenizer, progress=progress, serve_config=serve_config)


def _sweep_into(params: SweepParams, run_dir: Path, out: Path, endpoint: Endpoint, *, base_url: str, server: Any,
                model: str, tokenizer: str, progress: Progress | None, serve_config: Any) -> SweepResult:
    max_len = server.max_model_len
    raw_dir = run_dir / "raw"
    _refuse_links(run_dir, out)
    raw_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    result = SweepResult(run_id=run_dir.name, run_dir=str(run_dir), label=params.label,
                         params=params.model_dump(mode="json"), max_model_len=max_len, model=model,
                         started=clock.iso())
    # The sweep's folder stays in place while it runs (resume continues it), so it shares the evidence module's
    # files and provenance rather than its rename-when-complete folder.
    idle_before = prov_mod.machine_busy_cores()  # before any request: the server idles, what is busy is others'
    prov = evidence.collect_provenance(base_url, server=server, serve_config=serve_config)
    prov.endpoint = endpoint.to_dict()
    prov.other_load_cores = [idle_before]
    backends = endpoint.backends
    before = request_counts(backends) if backends else {}
    result.provenance = prov.to_dict()
    evidence.write_json(run_dir / "provenance.json", result.provenance)
    result.speculative_config = speculative_from_argv(result.provenance.get("server_argv"))

    cells_plan = [(L, c) for L in params.input_lens for c in params.concurrencies]
    total = sum(params.repeats for L, c in cells_plan if max_len is None or L + params.output_len <= max_len)
    with BenchWorker() as worker:
        _run_cells(params, cells_plan, result, worker, base_url=base_url, model=model, tokenizer=tokenizer,
                   max_len=max_len, raw_dir=raw_dir, run_dir=run_dir, progress=progress, total=total, t0=t0)

    if backends:  # how the router spread the sweep: each instance's finished requests, warm-ups included
        after = request_counts(backends)
        prov.endpoint["requests"] = {n: (None if before.get(n) is None or after.get(n) is None
                                         else int(after[n] - before[n])) for n in after}
    prov.other_load_cores = [idle_before, prov_mod.machine_busy_cores()]  # the last request answered: idle again
    result.provenance = prov.to_dict()
    evidence.write_json(run_dir / "provenance.json", result.provenance)
    result.finished = clock.iso()
    result.wall_s = time.monotonic() - t0
    result.roofline, result.roofline_note = single_stream_rooflines(result, server.model_root)
    result.files = sweep_report.write_run(result, run_dir, price_per_hour=params.price_per_hour, plot=True)
    return result


def single_stream_rooflines(result: SweepResult, model_root: str | None) -> tuple[dict[int, Roofline], str | None]:
    """Each ok c=1 cell's decode rate (1000 / mean TPOT: output tok/s over a request includes its prefill) as a
    share of the served build's memory-bandwidth roofline, by input length; or why there is none."""
    singles = [c for c in result.cells if c.status == "ok" and c.concurrency == 1 and c.request_rate is None]
    if not singles:
        return {}, None
    if result.speculative_config:
        return {}, SPECULATIVE_NOTE
    out: dict[int, Roofline] = {}
    for c in singles:
        tpot = c.estimate("mean_tpot_ms").mean
        if not tpot:
            continue
        fig, note = roofline_or_reason(1000.0 / tpot, model_root, sweep_context(c.input_len, c.output_len))
        if fig is None:
            return out, note
        out[c.input_len] = fig
    return out, None


def _run_cells(params: SweepParams, cells_plan: list[tuple[int, int]], result: SweepResult, worker: BenchWorker, *,
               base_url: str, model: str, tokenizer: str, max_len: int | None, raw_dir: Path, run_dir: Path,
               progress: Progress | None, total: int, t0: float) -> None:
    tally = Tally(total, progress)
    # /health is asked only after a cell failed: the sweep began with the server answering, and a server that
    # dies mid-cell shows in that cell's request results. Once it is found down, the remaining cells fail
    # without being sent.
    suspect = False
    for L, c in cells_plan:
        n = params.num_prompts(c)
        cell = CellResult(input_len=L, output_len=params.output_len, concurrency=c, num_prompts=n, status="ok")
        result.cells.append(cell)
        if max_len is not None and L + params.output_len > max_len:
            cell.status = "infeasible"
            cell.reason = (f"input {L} + output {params.output_len} > the server's max_model_len {max_len}: "
                           f"not run")
            continue
        repeats, pending = _measured_before(params, raw_dir, L, c, tally)
        if not pending:
            tally.tick(f"in={L} c={c}: {params.repeats} repeats already measured, skipped")
        elif suspect and not health.answers(base_url, timeout=5.0):
            for k in pending:
                repeats[k] = RepeatResult(repeat=k, seed=prompt_seed(params.seed, L, c, k), status="failed",
                                          num_prompts=n, reason=f"server at {base_url} did not answer /health")
                tally.done += 1
            tally.tick(f"in={L} c={c}: server down, cell marked failed")
        else:
            spec = cell_spec(params, cell, pending, base_url=base_url, model=model, tokenizer=tokenizer,
                             raw_dir=raw_dir)
            repeats.update(measure_cell(params, spec, cell, worker, tally))
        suspect = finish_cell(params, cell, repeats)
        # Save after every cell: a run stopped anywhere keeps tables of what it finished.
        result.wall_s = time.monotonic() - t0
        sweep_report.write_run(result, run_dir, price_per_hour=params.price_per_hour, plot=False)


def _measured_before(params: SweepParams, raw_dir: Path, L: int, c: int, tally: Tally
                     ) -> tuple[dict[int, RepeatResult], list[int]]:
    """The cell's repeats a previous run of this sweep measured, and those still to measure."""
    repeats: dict[int, RepeatResult] = {}
    pending: list[int] = []
    for k in range(params.repeats):
        prev = load_done(raw_dir, L, c, k)
        if prev is not None and prev.status == "ok":
            repeats[k] = prev
            tally.done += 1
        else:
            pending.append(k)
    return repeats, pending


