"""The serving sweep: vLLM's own `vllm bench serve` over input lengths x concurrencies x repeats, saved as evidence.

One cell is (input length, concurrency). The cells run in one benchmark worker process per sweep (`python -m
tools.measure.sweep --worker`) that imports `vllm.benchmarks.serve` once (the CPU build's `vllm` console script is
broken; the import costs seconds, paid once, not per cell) and takes cell specs over a pipe. It stays a separate
process, never an import into the caller: the benchmark is asyncio-heavy and imports torch, the MCP server
never imports vLLM, and a process can be timed, killed and survive a crash. A cell that times out, or a worker
that dies, fails that cell only; the next cell gets a fresh worker. The worker first warms the server with
`concurrency` requests of the cell's shape built from their own seed, then measures each pending repeat and
writes `raw/L<in>-c<c>-r<k>.json` as soon as that repeat ends, so a run that stops anywhere keeps every
finished repeat. Between cells the worker keeps the tokenizer and reads /metrics once per repeat; the server's
/health is asked again only after a cell failed (a server that dies shows in the requests' results).

Prompts: vLLM's random dataset is deterministic in its seed. Each (input length, concurrency, repeat) gets its
own seed derived from the sweep's base seed, so every build answers the same prompts, and no measured prompt
was seen before by the server (prefix caching stays on, as served; the warm-up uses separate seeds). The
prefix-cache hits during each measured repeat are read from the server's /metrics and recorded as the check.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import httpx

from tools.measure import evidence, provenance as prov_mod, sweep_report
from tools.core.process import kill_group, python_child_env
from tools.core.errors import ToolFailure
from tools.measure.results import (DEFAULT_OUT, DEFAULT_PRICE_PER_HOUR, METRICS, PREFIX_CACHE_POLICY,  # noqa: F401
                                   PROJECT_ROOT, CellResult, RepeatResult, SweepParams, SweepResult, aggregate,
                                   cell_acceptance)
from tools.measure.spec_metrics import parse_spec_counters, spec_delta, speculative_from_argv
from tools.measure.parent_watch import end_with_parent
from tools.serving import router as router_mod
from tools.serving.config import load_config
from tools.serving.endpoint import resolve_endpoint

Progress = Callable[[int, int, str], None]


def prompt_seed(base: int, input_len: int, concurrency: int, repeat: int, kind: str = "measure") -> int:
    """Deterministic, distinct seed per cell repeat: same prompts for every build, none shared between cells.

    A hash rather than base+offset: the random dataset builds each prompt from offsets drawn from the seed, so
    two lengths with one seed would make the short prompts prefixes of the long ones.
    """
    h = hashlib.sha256(f"{kind}/{base}/{input_len}/{concurrency}/{repeat}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def raw_name(input_len: int, concurrency: int, repeat: int) -> str:
    return f"L{input_len}-c{concurrency}-r{repeat}.json"


# ----------------------------------------------------------------------------------------------------------
# The parent side: plan, run cells, save.


def _default_base_url() -> str:
    return load_config().base_url


def healthy(base_url: str, timeout: float = 5.0) -> bool:
    try:
        return httpx.get(f"{base_url.rstrip('/')}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _run_dir(params: SweepParams, out: Path) -> Path:
    if params.run_id:
        return out / params.run_id
    digest = hashlib.sha256(json.dumps(params.identity(), sort_keys=True).encode()).hexdigest()[:8]
    suffix = f"-{params.label}-{digest}"
    if params.resume:
        existing = sorted((p for p in out.glob(f"*{suffix}") if p.is_dir()), key=lambda p: p.name)
        if existing:
            return existing[-1]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return out / f"{stamp}{suffix}"


def _refuse_links(run_dir: Path, out: Path) -> None:
    """A resumed run folder is read and written in place: a link in it (the folder, raw/ or a file in raw/) would
    lead both out of `out`, and out of the MCP server's roots."""
    raw_dir = run_dir / "raw"
    links = [p for p in (run_dir, raw_dir, *(raw_dir.iterdir() if raw_dir.is_dir() else ())) if p.is_symlink()]
    if links:
        raise ToolFailure(f"{run_dir}: {links[0].relative_to(out)} is a symbolic link, which a resumed sweep "
                          f"would read and write through; remove the links, or sweep into a new folder (no resume)",
                          detail={"path": str(run_dir), "links": [str(p) for p in links[:10]]})


def _load_done(raw_dir: Path, input_len: int, concurrency: int, repeat: int) -> RepeatResult | None:
    f = raw_dir / raw_name(input_len, concurrency, repeat)
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




class BenchWorker:
    """The parent's side of the benchmark worker: one process for many cells, replaced when it dies or hangs.

    Specs go to the worker's stdin as JSON lines; it answers each with one line on a pipe of its own (its
    stdout and stderr belong to vLLM's benchmark and go to the cell's log file). Use as a context manager: the
    worker's process group is ended on exit, whatever ended the sweep (Ctrl-C, a cancelled MCP job).
    """

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._answers: int | None = None
        # A cell was sent and not answered: the worker is inside vLLM's benchmark and reads stdin again only
        # when the cell ends, so closing stdin would not end it (close() then ends its group at once).
        self._in_cell = False
        self.starts = 0
        # The worker's own counts after its last answered cell (tokenizer_loads, metrics_reads, bench_calls):
        # what it kept between cells, as it saw it.
        self.stats: dict[str, int] = {}

    def __enter__(self) -> "BenchWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> subprocess.Popen:
        r, w = os.pipe()
        env = python_child_env(PROJECT_ROOT)
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "tools.measure.sweep", "--worker", "--answer-fd", str(w)],
                                         cwd=str(PROJECT_ROOT), env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         pass_fds=(w,), start_new_session=True)
        finally:
            os.close(w)
        self._answers = r
        self.starts += 1
        return self.proc

    def run_cell(self, spec: dict[str, Any], timeout_s: float) -> tuple[int, str | None]:
        """Runs one cell; (0, None) when the worker finished it (each repeat's record says how it went),
        (code, why) when the worker died or was stopped before answering."""
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        assert proc.stdin is not None and self._answers is not None
        try:
            self._in_cell = True
            proc.stdin.write((json.dumps(spec) + "\n").encode())
            proc.stdin.flush()
            deadline = time.monotonic() + timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.close()
                    return -1, f"cell exceeded its time limit of {timeout_s:.0f} s and was stopped"
                ready, _, _ = select.select([self._answers], [], [], min(left, 1.0))
                if ready:
                    line = _read_line(self._answers)
                    if line:
                        self._in_cell = False
                        self.stats = {k: v for k, v in json.loads(line).items() if k != "done"}
                        return 0, None
                    break  # EOF: the worker is gone
                if proc.poll() is not None:
                    break
        except BrokenPipeError:
            pass
        except BaseException:
            self.close()  # Ctrl-C or a cancelled MCP call: never leave a benchmark client behind
            raise
        code = proc.wait()
        self._forget()
        return code, None

    def _forget(self) -> None:
        if self._answers is not None:
            os.close(self._answers)
            self._answers = None
        self.proc = None
        self._in_cell = False

    def close(self) -> None:
        proc = self.proc
        if proc is not None:
            if proc.poll() is not None:
                proc.wait()
            elif self._in_cell:
                kill_group(proc)  # mid-cell (a time limit, Ctrl-C, a cancelled job): EOF would wait for the cell
            else:
                try:
                    assert proc.stdin is not None
                    proc.stdin.close()  # EOF: the worker's loop ends by itself
                    proc.wait(timeout=5)
                except (OSError, subprocess.TimeoutExpired, AssertionError):
                    kill_group(proc)
            try:  # the group may hold children of the worker
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self._forget()


def _read_line(fd: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            return b""
        data += chunk
    return data


def _resolve_server(params: SweepParams, base_url: str) -> prov_mod.ServerInfo:
    try:
        info = prov_mod.server_info(base_url)
    except (httpx.HTTPError, ValueError) as exc:
        raise ToolFailure(f"no vLLM server answers at {base_url} ({type(exc).__name__}); start one with "
                          f"./vllm-t4 start or pass --base-url") from exc
    if not (params.model or info.model_id):
        raise ToolFailure(f"the server at {base_url} lists no model in /v1/models; pass --model")
    return info


def run_sweep(params: SweepParams | None = None, *, progress: Progress | None = None, serve_config: Any = None,
              **overrides: Any) -> SweepResult:
    """Run (or resume) a sweep against a live OpenAI-compatible vLLM server; returns and saves the evidence.

    `overrides` set SweepParams fields by name (the MCP server passes its arguments this way). `progress` is
    called with (repeats done, repeats planned, message) as cells start and after every measured repeat.
    `serve_config` (a tools.serving.config.ServeConfig) names the server tools/ started: its URL is the default
    base_url and its argv and engine start fields go into the provenance (default: the project's tpu.env).
    """
    params = SweepParams(**{**(params or SweepParams()).model_dump(), **overrides})
    params.validate()

    endpoint = resolve_endpoint(params, serve_config)
    base_url = endpoint.base_url
    if endpoint.config is not None:  # the instance measured: its start record goes into the provenance
        serve_config = endpoint.config
    server = _resolve_server(params, base_url)
    model = params.model or server.model_id
    tokenizer = params.tokenizer or server.model_root or model
    max_len = server.max_model_len

    out = Path(params.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = _run_dir(params, out)
    raw_dir = run_dir / "raw"
    _refuse_links(run_dir, out)
    raw_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    result = SweepResult(run_id=run_dir.name, run_dir=str(run_dir), label=params.label,
                         params=params.model_dump(mode="json"), max_model_len=max_len, model=model,
                         started=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    # The sweep's folder stays in place while it runs (resume continues it), so it shares the evidence module's
    # files and provenance rather than its rename-when-complete folder.
    prov = evidence.collect_provenance(base_url, server=server, serve_config=serve_config)
    prov.endpoint = endpoint.to_dict()
    backends = [router_mod.Backend(**b) for b in endpoint.backends]
    before = router_mod.request_counts(backends) if backends else {}
    result.provenance = prov.to_dict()
    evidence.write_json(run_dir / "provenance.json", result.provenance)

    result.speculative_config = speculative_from_argv(result.provenance.get("server_argv"))

    cells_plan = [(L, c) for L in params.input_lens for c in params.concurrencies]
    total = sum(params.repeats for L, c in cells_plan if max_len is None or L + params.output_len <= max_len)
    with BenchWorker() as worker:
        _run_cells(params, cells_plan, result, worker, base_url=base_url, model=model, tokenizer=tokenizer,
                   max_len=max_len, raw_dir=raw_dir, run_dir=run_dir, progress=progress, total=total, t0=t0)

    if backends:  # how the router spread the sweep: each instance's finished requests, warm-ups included
        after = router_mod.request_counts(backends)
        prov.endpoint["requests"] = {n: (None if before.get(n) is None or after.get(n) is None
                                         else int(after[n] - before[n])) for n in after}
        result.provenance = prov.to_dict()
        evidence.write_json(run_dir / "provenance.json", result.provenance)
    result.finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result.wall_s = time.monotonic() - t0
    result.files = sweep_report.write_run(result, run_dir, price_per_hour=params.price_per_hour, plot=True)
    return result


def _run_cells(params: SweepParams, cells_plan: list[tuple[int, int]], result: SweepResult, worker: BenchWorker, *,
               base_url: str, model: str, tokenizer: str, max_len: int | None, raw_dir: Path, run_dir: Path,
               progress: Progress | None, total: int, t0: float) -> None:
    done = 0
    # /health is asked only after a cell failed: the sweep began with the server answering, and a server that
    # dies mid-cell shows in that cell's request results. Once it is found down, the remaining cells fail
    # without being sent.
    suspect = False

    def tick(msg: str) -> None:
        if progress is not None:
            progress(done, total, msg)

    for L, c in cells_plan:
        n = params.num_prompts(c)
        cell = CellResult(input_len=L, output_len=params.output_len, concurrency=c, num_prompts=n, status="ok")
        result.cells.append(cell)
        if max_len is not None and L + params.output_len > max_len:
            cell.status = "infeasible"
            cell.reason = (f"input {L} + output {params.output_len} > the server's max_model_len {max_len}: "
                           f"not run")
            continue
        repeats: dict[int, RepeatResult] = {}
        pending: list[int] = []
        for k in range(params.repeats):
            prev = _load_done(raw_dir, L, c, k)
            if prev is not None and prev.status == "ok":
                repeats[k] = prev
                done += 1
            else:
                pending.append(k)
        if not pending:
            tick(f"in={L} c={c}: {params.repeats} repeats already measured, skipped")
        elif suspect and not healthy(base_url):
            for k in pending:
                repeats[k] = RepeatResult(repeat=k, seed=prompt_seed(params.seed, L, c, k), status="failed",
                                          num_prompts=n, reason=f"server at {base_url} did not answer /health")
                done += 1
            tick(f"in={L} c={c}: server down, cell marked failed")
        else:
            tick(f"in={L} c={c}: measuring {len(pending)} repeat(s) of {n} prompts")
            spec = {"base_url": base_url, "model": model, "tokenizer": tokenizer, "input_len": L,
                    "output_len": params.output_len, "concurrency": c, "num_prompts": n,
                    "repeats": pending, "seeds": {str(k): prompt_seed(params.seed, L, c, k) for k in pending},
                    "warmup_seed": prompt_seed(params.seed, L, c, 0, "warmup") if params.warmup else None,
                    "raw_dir": str(raw_dir)}
            stem = f"L{L}-c{c}"
            spec["log_file"] = str(raw_dir / f"{stem}.log")
            evidence.write_json(raw_dir / f"{stem}.spec.json", spec)
            for k in pending:  # a stale failure record must not survive a failed rerun
                (raw_dir / raw_name(L, c, k)).unlink(missing_ok=True)
            tc = time.monotonic()
            rc, why = worker.run_cell(spec, params.cell_timeout_s * len(pending))
            cell.wall_s = time.monotonic() - tc
            down: bool | None = None  # asked once per cell, when a repeat has no record
            for k in pending:
                rec = _load_done(raw_dir, L, c, k)
                if rec is None:
                    reason = why or (f"benchmark process exited with code {rc} before this repeat: "
                                     f"{_log_tail(raw_dir / f'{stem}.log')}")
                    if down is None:
                        down = not healthy(base_url)
                    if down:
                        reason += f" (server at {base_url} no longer answers /health)"
                    rec = RepeatResult(repeat=k, seed=spec["seeds"][str(k)], status="failed", num_prompts=n,
                                       reason=reason)
                repeats[k] = rec
                done += 1
                tick(f"in={L} c={c} repeat {k + 1}/{params.repeats}: {rec.status}"
                     + (f", {rec.metrics.get('output_throughput') or 0:.2f} out tok/s" if rec.status == "ok"
                        else f" ({rec.reason})"))
        cell.repeats = [repeats[k] for k in sorted(repeats)]
        bad = [r for r in cell.repeats if r.status != "ok"]
        suspect = bool(bad)
        if bad:
            cell.status = "failed"
            cell.reason = f"{len(bad)} of {params.repeats} repeats failed; first: {bad[0].reason}"
        cell.median, cell.spread_pct = aggregate(cell.repeats)
        cell.acceptance_rate = cell_acceptance(cell.repeats)
        # Save after every cell: a run stopped anywhere keeps tables of what it finished.
        result.wall_s = time.monotonic() - t0
        sweep_report.write_run(result, run_dir, price_per_hour=params.price_per_hour, plot=False)


# ----------------------------------------------------------------------------------------------------------
# The child side: the benchmark worker, vLLM's benchmark called in-process, cell after cell.


class _Counters:
    """The /metrics counters a repeat reports (prefix-cache queries and hits, speculative decoding), from one
    read of the page. The reading that ends one repeat starts the next when nothing reached the server between."""

    def __init__(self, prefix: tuple[float | None, float | None], spec: dict[str, Any]) -> None:
        self.prefix, self.spec = prefix, spec

    @classmethod
    def parse(cls, text: str) -> "_Counters":
        q = h = None
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_queries_total"):
                q = (q or 0.0) + float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_hits_total"):
                h = (h or 0.0) + float(line.rsplit(" ", 1)[1])
        return cls((q, h), parse_spec_counters(text))


class _Bench:
    """vLLM's benchmark as the worker runs it, with what does not change between cells kept between them.

    `vllm.benchmarks.serve.main` loads the tokenizer on every call, sends an unmeasured test prompt first (the
    first measured prompt itself, so the measured run would find it in the prefix cache) and reads /metrics four
    times. Here the argument parser is built once, the tokenizer is loaded once per tokenizer (the module's
    `get_tokenizer` is replaced by a memo), the test prompt is skipped (`--ready-check-timeout-sec 0`: a dead
    server shows in the requests' results instead) and vLLM's own /metrics reads are off: the worker reads the
    counters it reports itself, once per repeat. The random dataset is still sampled per call: every call has
    a seed of its own (no prompt is measured twice), and sampling takes milliseconds.
    """

    def __init__(self) -> None:
        import vllm.benchmarks.serve as serve  # the import this process exists to pay once
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        self.parser = FlexibleArgumentParser()
        serve.add_cli_args(self.parser)
        self.main: Callable[[argparse.Namespace], dict[str, Any]] = serve.main
        self.tokenizer_loads = 0
        self.metrics_reads = 0
        self.bench_calls = 0
        self._client: httpx.Client | None = None
        self._last: tuple[str, _Counters] | None = None  # (base_url, counters) while nothing was sent since
        load, tokenizers = serve.get_tokenizer, {}

        def get_tokenizer(name: Any, *args: Any, **kwargs: Any) -> Any:
            key = repr((name, args, sorted(kwargs.items())))
            if key not in tokenizers:
                tokenizers[key] = load(name, *args, **kwargs)
                self.tokenizer_loads += 1
            return tokenizers[key]

        async def no_metrics(*args: Any, **kwargs: Any) -> None:
            return None

        serve.get_tokenizer = get_tokenizer
        serve.fetch_spec_decode_metrics = no_metrics
        serve.fetch_diffusion_metrics = no_metrics

    def run(self, spec: dict[str, Any], seed: int, num_prompts: int) -> dict[str, Any]:
        self._last = None  # requests reach the server: the last counters no longer describe it
        self.bench_calls += 1
        return self.main(self.parser.parse_args(_bench_argv(spec, seed, num_prompts)))

    def counters(self, base_url: str, *, fresh: bool = False) -> _Counters | None:
        """The server's counters now: the last reading when nothing was sent since (and not `fresh`)."""
        if not fresh and self._last is not None and self._last[0] == base_url:
            return self._last[1]
        if self._client is None:
            self._client = httpx.Client()  # one client per worker: building one costs tens of ms (TLS setup)
        self.metrics_reads += 1
        try:
            got = _Counters.parse(self._client.get(f"{base_url}/metrics", timeout=10).text)
        except httpx.HTTPError:
            self._last = None
            return None
        self._last = (base_url, got)
        return got

    def stats(self) -> dict[str, int]:
        return {"tokenizer_loads": self.tokenizer_loads, "metrics_reads": self.metrics_reads,
                "bench_calls": self.bench_calls}


def _bench_argv(spec: dict[str, Any], seed: int, num_prompts: int) -> list[str]:
    return ["--backend", "openai", "--base-url", spec["base_url"], "--endpoint", "/v1/completions",
            "--model", spec["model"], "--tokenizer", spec["tokenizer"],
            "--dataset-name", "random", "--random-input-len", str(spec["input_len"]),
            "--random-output-len", str(spec["output_len"]), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(spec["concurrency"]), "--num-prompts", str(num_prompts),
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--disable-tqdm", "--num-warmups", "0",
            "--ready-check-timeout-sec", "0", "--save-detailed"]


def _worker_main(answer_fd: int) -> int:
    """The worker's loop: one JSON cell spec a line on stdin, one answer line per finished cell on answer_fd
    (with the worker's counters: tokenizer loads, /metrics reads, benchmark calls).

    vLLM's benchmark prints to stdout and stderr: both are pointed at the cell's own log file for each cell.
    """
    # Stdin's EOF is read only between cells, and a cell can run for minutes: a killed sweep's worker must not
    # finish it, loading the server and writing into a folder that a resumed sweep measures again.

    end_with_parent()
    bench = _Bench()
    answers = os.fdopen(answer_fd, "w", buffering=1)
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        with open(spec["log_file"], "ab") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        _run_cell(spec, bench)
        sys.stdout.flush()
        sys.stderr.flush()
        answers.write(json.dumps({"done": [spec["input_len"], spec["concurrency"]], **bench.stats()}) + "\n")
    return 0


def _failed_requests(raw: dict[str, Any], expected: int) -> str | None:
    """Why a benchmark call's requests did not all complete (None: they did), from its own results."""
    completed, failed = int(raw.get("completed") or 0), int(raw.get("failed") or 0)
    if not failed and completed == expected:
        return None
    errs = [e for e in raw.get("errors", []) if e] if isinstance(raw.get("errors"), list) else []
    return (f"{completed} of {expected} requests completed, {failed} failed"
            + (f": {str(errs[0]).splitlines()[0][:200]}" if errs else ""))


def _run_cell(spec: dict[str, Any], bench: _Bench) -> None:
    raw_dir = Path(spec["raw_dir"])
    base_url = spec["base_url"]
    warmup_s = None
    if spec.get("warmup_seed") is not None:
        # Shape-matched warm-up from its own seed: `--num-warmups` would repeat the measured set's first
        # prompt, which the prefix cache would then serve to the measured run.
        tw = time.monotonic()
        try:
            why = _failed_requests(bench.run(spec, spec["warmup_seed"], spec["concurrency"]), spec["concurrency"])
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:  # no measurement without the warm-up: every pending repeat fails with why
            reason = f"warm-up failed: {why}".splitlines()[0][:300]
            for k in spec["repeats"]:
                rr = RepeatResult(repeat=k, seed=int(spec["seeds"][str(k)]), status="failed", reason=reason,
                                  num_prompts=spec["num_prompts"],
                                  raw_file=raw_name(spec["input_len"], spec["concurrency"], k))
                _write_raw(raw_dir / rr.raw_file, {"repeat_result": rr.model_dump(mode="json"), "spec": spec})
            return
        warmup_s = time.monotonic() - tw
    for k in spec["repeats"]:
        seed = int(spec["seeds"][str(k)])
        rr = RepeatResult(repeat=k, seed=seed, status="ok", num_prompts=spec["num_prompts"], warmup_s=warmup_s,
                          raw_file=raw_name(spec["input_len"], spec["concurrency"], k))
        warmup_s = None  # the warm-up belongs to the cell's first measured repeat
        c0 = bench.counters(base_url)
        tm = time.monotonic()
        raw: dict[str, Any] = {}
        try:
            raw = bench.run(spec, seed, spec["num_prompts"])
        except Exception as exc:  # recorded per repeat; the next repeat and cell still run
            rr.status, rr.reason = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        rr.measure_s = time.monotonic() - tm
        c1 = bench.counters(base_url, fresh=True)
        if c0 is not None and c1 is not None:
            (q0, h0), (q1, h1) = c0.prefix, c1.prefix
            if None not in (q0, q1, h0, h1):
                rr.prefix_cache_queries, rr.prefix_cache_hits = q1 - q0, h1 - h0

            stats, found = spec_delta(c0.spec, c1.spec)
            rr.spec_decode = stats.model_dump(mode="json") if found else None
        rr.metrics = {m: (float(raw[m]) if isinstance(raw.get(m), (int, float)) else None) for m in METRICS}
        if rr.status == "ok":
            why = _failed_requests(raw, spec["num_prompts"])
            if why is not None:
                rr.status, rr.reason = "failed", why
        record = {"repeat_result": rr.model_dump(mode="json"), "spec": {**spec, "seed": seed},
                  "vllm_bench_result": {k2: v for k2, v in raw.items()
                                        if k2 not in ("errors", "generated_texts", "itls", "ttfts",
                                                      "start_times", "input_lens", "output_lens",
                                                      "latencies", "queue_times")}}
        _write_raw(raw_dir / rr.raw_file, record)


def _write_raw(out: Path, record: dict[str, Any]) -> None:
    evidence.write_json(out, record)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.measure.sweep", description="The sweep's benchmark worker (internal).")
    ap.add_argument("--worker", action="store_true", required=True, help="read cell specs from stdin")
    ap.add_argument("--answer-fd", type=int, required=True, help="file descriptor for one answer line per cell")
    raise SystemExit(_worker_main(ap.parse_args().answer_fd))
