"""The sweep's benchmark worker: vLLM's own `vllm bench serve` called in-process, cell after cell.

The cells run in one worker process per sweep (`python -m tools.measure.sweep.worker --worker`) that imports
`vllm.benchmarks.serve` once (the CPU build's `vllm` console script is broken; the import costs seconds, paid
once, not per cell) and takes cell specs over a pipe. It stays a separate process, never an import into the
caller: the benchmark is asyncio-heavy and imports torch, the MCP server never imports vLLM, and a process can be
timed, killed and survive a crash. A cell that times out, or a worker that dies, fails that cell only; the next
cell gets a fresh worker. The worker first warms the server with `concurrency` requests of the cell's shape built
from their own seed, then measures each pending repeat and writes `raw/L<in>-c<c>-r<k>.json` as soon as that
repeat ends, so a run that stops anywhere keeps every finished repeat. Between cells the worker keeps the
tokenizer and reads /metrics once per repeat.

`BenchWorker` is the parent's end of the pipe; the rest of the module runs in the worker.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from tools.core.api_key import auth_headers, with_client_key
from tools.core.metrics import samples, total
from tools.core.process import kill_group, python_child_env
from tools.measure import evidence
from tools.core.parent_watch import end_with_parent
from tools.measure.sweep.params import METRICS, CellSpec, RepeatResult
from tools.core.root import PROJECT_ROOT
from tools.measure.spec_metrics import parse_spec_counters, spec_delta


# ----------------------------------------------------------------------------------------------------------
# The parent's end


class BenchWorker:
    """The parent's side of the benchmark worker: one process for many cells, replaced when it dies or hangs.

    Cell specs (`CellSpec`) go to the worker's stdin as JSON lines; it answers each with one line on a pipe of
    its own (its stdout and stderr belong to vLLM's benchmark and go to the cell's log file). Use as a context
    manager: the worker's process group is ended on exit, whatever ended the sweep (Ctrl-C, a cancelled MCP job).
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
        env = with_client_key(python_child_env(PROJECT_ROOT))  # vllm bench serve sends OPENAI_API_KEY
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "tools.measure.sweep.worker", "--worker", "--answer-fd", str(w)],
                                         cwd=str(PROJECT_ROOT), env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         pass_fds=(w,), start_new_session=True)
        finally:
            os.close(w)
        self._answers = r
        self.starts += 1
        return self.proc

    def run_cell(self, spec: CellSpec, timeout_s: float) -> tuple[int, str | None]:
        """Runs one cell; (0, None) when the worker finished it (each repeat's record says how it went),
        (code, why) when the worker died or was stopped before answering."""
        proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
        assert proc.stdin is not None and self._answers is not None
        try:
            self._in_cell = True
            proc.stdin.write((spec.model_dump_json() + "\n").encode())
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
            kill_group(proc, grace_s=0)  # the group may still hold children of the worker
        self._forget()


def _read_line(fd: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            return b""
        data += chunk
    return data


# ----------------------------------------------------------------------------------------------------------
# The worker



class _Counters:
    """The /metrics counters a repeat reports (prefix-cache queries and hits, speculative decoding), from one
    read of the page. The reading that ends one repeat starts the next when nothing reached the server between."""

    def __init__(self, prefix: tuple[float | None, float | None], spec: dict[str, Any]) -> None:
        self.prefix, self.spec = prefix, spec

    @classmethod
    def parse(cls, text: str) -> "_Counters":
        found = samples(text, "vllm:")
        return cls((total(found, "vllm:prefix_cache_queries_total"), total(found, "vllm:prefix_cache_hits_total")),
                   parse_spec_counters(text))


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

        # Patched, not passed: vLLM has no option for either. serve.main takes only a Namespace and loads the
        # tokenizer on every call (main_async calls the module's get_tokenizer); the lower-level serve.benchmark()
        # takes a tokenizer, but calling it would mean copying main's dataset sampling, prompt alignment,
        # sampling parameters and result record. benchmark() reads /metrics before and after every run through
        # the module-level fetchers, with no flag to skip them (a None reading skips their stats). All three are
        # looked up as module globals at call time, so replacing the attributes reaches those calls;
        # tests/measure/sweep/test_sweep_vllm_patch.py fails on a vLLM where that stops being true.
        serve.get_tokenizer = get_tokenizer
        serve.fetch_spec_decode_metrics = no_metrics
        serve.fetch_diffusion_metrics = no_metrics

    def run(self, spec: CellSpec, seed: int, num_prompts: int) -> dict[str, Any]:
        self._last = None  # requests reach the server: the last counters no longer describe it
        self.bench_calls += 1
        return self.main(self.parser.parse_args(_bench_argv(spec, seed, num_prompts)))

    def counters(self, base_url: str, *, fresh: bool = False) -> _Counters | None:
        """The server's counters now: the last reading when nothing was sent since (and not `fresh`)."""
        if not fresh and self._last is not None and self._last[0] == base_url:
            return self._last[1]
        if self._client is None:
            self._client = httpx.Client(headers=auth_headers())  # one client per worker: building one costs tens of ms (TLS setup)
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


def _bench_argv(spec: CellSpec, seed: int, num_prompts: int) -> list[str]:
    """The cell's load is a concurrency (--max-concurrency, all requests at once) or a Poisson request rate
    (--request-rate, with --max-concurrency as a cap only where the spec gives one); `goodput` (per-request
    ms limits on ttft, tpot, e2el) makes vLLM count the requests that meet them all."""
    load = ["--max-concurrency", str(spec.concurrency)] if spec.concurrency else []
    if spec.request_rate:
        load += ["--request-rate", f"{spec.request_rate:g}"]
    goodput = [f"{k}:{v:g}" for k, v in (spec.goodput or {}).items()]
    return ["--backend", "openai", "--base-url", spec.base_url, "--endpoint", "/v1/completions",
            "--model", spec.model, "--tokenizer", spec.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(spec.input_len),
            "--random-output-len", str(spec.output_len), "--ignore-eos", "--temperature", "0",
            *load, "--num-prompts", str(num_prompts),
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--disable-tqdm", "--num-warmups", "0",
            "--ready-check-timeout-sec", "0", "--save-detailed", *(["--goodput", *goodput] if goodput else [])]


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
        spec = CellSpec.model_validate_json(line)
        with open(spec.log_file, "ab") as log:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        _run_cell(spec, bench)
        sys.stdout.flush()
        sys.stderr.flush()
        answers.write(json.dumps({"done": [spec.input_len, spec.concurrency], **bench.stats()}) + "\n")
    return 0


def _failed_requests(raw: dict[str, Any], expected: int) -> str | None:
    """Why a benchmark call's requests did not all complete (None: they did), from its own results."""
    completed, failed = int(raw.get("completed") or 0), int(raw.get("failed") or 0)
    if not failed and completed == expected:
        return None
    errs = [e for e in raw.get("errors", []) if e] if isinstance(raw.get("errors"), list) else []
    return (f"{completed} of {expected} requests completed, {failed} failed"
            + (f": {str(errs[0]).splitlines()[0][:200]}" if errs else ""))


def _run_cell(spec: CellSpec, bench: _Bench) -> None:
    raw_dir = Path(spec.raw_dir)
    base_url = spec.base_url
    record_spec = spec.model_dump(mode="json")  # the raw records' "spec", with the repeat's own "seed"
    warmup_s = None
    if spec.warmup_seed is not None:
        # Shape-matched warm-up from its own seed: `--num-warmups` would repeat the measured set's first
        # prompt, which the prefix cache would then serve to the measured run.
        tw = time.monotonic()
        try:
            why = _failed_requests(bench.run(spec, spec.warmup_seed, spec.warmup_prompts), spec.warmup_prompts)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why is not None:  # no measurement without the warm-up: every pending repeat fails with why
            reason = f"warm-up failed: {why}".splitlines()[0][:300]
            for k in spec.repeats:
                rr = RepeatResult(repeat=k, seed=spec.seeds[k], status="failed", reason=reason,
                                  num_prompts=spec.num_prompts, raw_file=spec.raw_file(k))
                _write_raw(raw_dir / rr.raw_file, {"repeat_result": rr.model_dump(mode="json"), "spec": record_spec})
            return
        warmup_s = time.monotonic() - tw
    for k in spec.repeats:
        seed = spec.seeds[k]
        rr = RepeatResult(repeat=k, seed=seed, status="ok", num_prompts=spec.num_prompts, warmup_s=warmup_s,
                          raw_file=spec.raw_file(k))
        warmup_s = None  # the warm-up belongs to the cell's first measured repeat
        c0 = bench.counters(base_url)
        tm = time.monotonic()
        raw: dict[str, Any] = {}
        try:
            raw = bench.run(spec, seed, spec.num_prompts)
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
            why = _failed_requests(raw, spec.num_prompts)
            if why is not None:
                rr.status, rr.reason = "failed", why
        record = {"repeat_result": rr.model_dump(mode="json"), "spec": {**record_spec, "seed": seed},
                  "vllm_bench_result": {k2: v for k2, v in raw.items()
                                        if k2 not in ("errors", "generated_texts", "itls", "ttfts",
                                                      "start_times", "input_lens", "output_lens",
                                                      "latencies", "queue_times")}}
        _write_raw(raw_dir / rr.raw_file, record)


def _write_raw(out: Path, record: dict[str, Any]) -> None:
    evidence.write_json(out, record)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.measure.sweep.worker", description="The sweep's benchmark worker (internal).")
    ap.add_argument("--worker", action="store_true", required=True, help="read cell specs from stdin")
    ap.add_argument("--answer-fd", type=int, required=True, help="file descriptor for one answer line per cell")
    raise SystemExit(_worker_main(ap.parse_args().answer_fd))
