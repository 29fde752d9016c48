"""The serving sweep: vLLM's own `vllm bench serve` over input lengths x concurrencies x repeats, saved as evidence.

One cell is (input length, concurrency). Each cell runs in its own subprocess (`python -m tools.measure.sweep --cell
SPEC`) that calls `vllm.benchmarks.serve.main` directly (the CPU build's `vllm` console script is broken; the
benchmark is asyncio-heavy and imports torch, and a separate process can be timed, killed and survive a crash).
The subprocess first warms the server with `concurrency` requests of the cell's shape built from their own seed,
then measures each pending repeat and writes `raw/L<in>-c<c>-r<k>.json` as soon as that repeat ends, so a run
that stops anywhere keeps every finished repeat.

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
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import httpx

from tools.measure import provenance as prov_mod
from tools.errors import ToolFailure

from tools.measure.results import (DEFAULT_OUT, DEFAULT_PRICE_PER_HOUR, METRICS, PREFIX_CACHE_POLICY,  # noqa: F401
                                   PROJECT_ROOT, CellResult, RepeatResult, SweepParams, SweepResult, aggregate)

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
    from tools.serving.config import load_config

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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _run_cell_subprocess(spec: dict[str, Any], spec_file: Path, log_file: Path, timeout_s: float) -> tuple[int, str | None]:
    spec_file.write_text(json.dumps(spec, indent=2))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(PROJECT_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_file, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tools.measure.sweep", "--cell", str(spec_file)],
                                cwd=str(PROJECT_ROOT), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return -1, f"cell exceeded its time limit of {timeout_s:.0f} s and was stopped"
        except BaseException:
            _kill_group(proc)  # Ctrl-C or a cancelled MCP call: never leave a benchmark client behind
            raise
    return rc, None


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
    from tools.measure import sweep_report

    params = SweepParams(**{**(params or SweepParams()).model_dump(), **overrides})
    params.validate()
    base_url = (params.base_url or (serve_config.base_url if serve_config is not None else _default_base_url()))
    base_url = base_url.rstrip("/")
    params.base_url = base_url
    server = _resolve_server(params, base_url)
    model = params.model or server.model_id
    tokenizer = params.tokenizer or server.model_root or model
    max_len = server.max_model_len

    out = Path(params.out)
    out.mkdir(parents=True, exist_ok=True)
    run_dir = _run_dir(params, out)
    raw_dir = run_dir / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    result = SweepResult(run_id=run_dir.name, run_dir=str(run_dir), label=params.label,
                         params=params.model_dump(mode="json"), max_model_len=max_len, model=model,
                         started=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    result.provenance = prov_mod.collect(base_url, server=server, serve_config=serve_config).to_dict()
    prov_mod.write(prov_mod.Provenance.model_validate(result.provenance), run_dir / "provenance.json")

    cells_plan = [(L, c) for L in params.input_lens for c in params.concurrencies]
    total = sum(params.repeats for L, c in cells_plan if max_len is None or L + params.output_len <= max_len)
    done = 0

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
        elif not healthy(base_url):
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
            for k in pending:  # a stale failure record must not survive a failed rerun
                (raw_dir / raw_name(L, c, k)).unlink(missing_ok=True)
            tc = time.monotonic()
            rc, why = _run_cell_subprocess(spec, raw_dir / f"{stem}.spec.json", raw_dir / f"{stem}.log",
                                           params.cell_timeout_s * len(pending))
            cell.wall_s = time.monotonic() - tc
            for k in pending:
                rec = _load_done(raw_dir, L, c, k)
                if rec is None:
                    reason = why or (f"benchmark process exited with code {rc} before this repeat: "
                                     f"{_log_tail(raw_dir / f'{stem}.log')}")
                    if not healthy(base_url):
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
        if bad:
            cell.status = "failed"
            cell.reason = f"{len(bad)} of {params.repeats} repeats failed; first: {bad[0].reason}"
        cell.median, cell.spread_pct = aggregate(cell.repeats)
        # Save after every cell: a run stopped anywhere keeps tables of what it finished.
        result.wall_s = time.monotonic() - t0
        sweep_report.write_run(result, run_dir, price_per_hour=params.price_per_hour, plot=False)

    result.finished = datetime.now(timezone.utc).isoformat(timespec="seconds")
    result.wall_s = time.monotonic() - t0
    result.files = sweep_report.write_run(result, run_dir, price_per_hour=params.price_per_hour, plot=True)
    return result


# ----------------------------------------------------------------------------------------------------------
# The child side: one cell in its own process, vLLM's benchmark called in-process.


def _prefix_counters(client: httpx.Client, base_url: str) -> tuple[float | None, float | None]:
    try:
        text = client.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None, None
    q = h = None
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_queries_total"):
            q = (q or 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_hits_total"):
            h = (h or 0.0) + float(line.rsplit(" ", 1)[1])
    return q, h


def _bench_args(spec: dict[str, Any], seed: int, num_prompts: int, output_len: int) -> argparse.Namespace:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = ["--backend", "openai", "--base-url", spec["base_url"], "--endpoint", "/v1/completions",
            "--model", spec["model"], "--tokenizer", spec["tokenizer"],
            "--dataset-name", "random", "--random-input-len", str(spec["input_len"]),
            "--random-output-len", str(output_len), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(spec["concurrency"]), "--num-prompts", str(num_prompts),
            "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--disable-tqdm", "--num-warmups", "0"]
    return parser.parse_args(argv)


def _cell_main(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    from vllm.benchmarks.serve import main as bench_main

    raw_dir = Path(spec["raw_dir"])
    base_url = spec["base_url"]
    warmup_s = None
    if spec.get("warmup_seed") is not None:
        # Shape-matched warm-up from its own seed: `--num-warmups` would repeat the measured set's first
        # prompt, which the prefix cache would then serve to the measured run.
        tw = time.monotonic()
        try:
            bench_main(_bench_args(spec, spec["warmup_seed"], spec["concurrency"], spec["output_len"]))
        except Exception as exc:  # no measurement without the warm-up: every pending repeat fails with why
            reason = f"warm-up failed: {type(exc).__name__}: {exc}".splitlines()[0][:300]
            for k in spec["repeats"]:
                rr = RepeatResult(repeat=k, seed=int(spec["seeds"][str(k)]), status="failed", reason=reason,
                                  num_prompts=spec["num_prompts"],
                                  raw_file=raw_name(spec["input_len"], spec["concurrency"], k))
                _write_raw(raw_dir / rr.raw_file, {"repeat_result": rr.model_dump(mode="json"), "spec": spec})
            return 0
        warmup_s = time.monotonic() - tw
    with httpx.Client() as client:
        for k in spec["repeats"]:
            seed = int(spec["seeds"][str(k)])
            rr = RepeatResult(repeat=k, seed=seed, status="ok", num_prompts=spec["num_prompts"], warmup_s=warmup_s,
                              raw_file=raw_name(spec["input_len"], spec["concurrency"], k))
            warmup_s = None  # the warm-up belongs to the cell's first measured repeat
            q0, h0 = _prefix_counters(client, base_url)
            tm = time.monotonic()
            raw: dict[str, Any] = {}
            try:
                raw = bench_main(_bench_args(spec, seed, spec["num_prompts"], spec["output_len"]))
            except Exception as exc:  # recorded per repeat; the next repeat and cell still run
                rr.status, rr.reason = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            rr.measure_s = time.monotonic() - tm
            q1, h1 = _prefix_counters(client, base_url)
            if None not in (q0, q1, h0, h1):
                rr.prefix_cache_queries, rr.prefix_cache_hits = q1 - q0, h1 - h0
            rr.metrics = {m: (float(raw[m]) if isinstance(raw.get(m), (int, float)) else None) for m in METRICS}
            if rr.status == "ok":
                completed, failed = int(raw.get("completed") or 0), int(raw.get("failed") or 0)
                if failed or completed != spec["num_prompts"]:
                    errs = [e for e in raw.get("errors", []) if e] if isinstance(raw.get("errors"), list) else []
                    rr.status = "failed"
                    rr.reason = (f"{completed} of {spec['num_prompts']} requests completed, {failed} failed"
                                 + (f": {str(errs[0]).splitlines()[0][:200]}" if errs else ""))
            record = {"repeat_result": rr.model_dump(mode="json"), "spec": {**spec, "seed": seed},
                      "vllm_bench_result": {k2: v for k2, v in raw.items()
                                            if k2 not in ("errors", "generated_texts", "itls", "ttfts",
                                                          "start_times", "input_lens", "output_lens",
                                                          "latencies", "queue_times")}}
            _write_raw(raw_dir / rr.raw_file, record)
    return 0


def _write_raw(out: Path, record: dict[str, Any]) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2, default=str))
    tmp.replace(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.measure.sweep", description="Run one sweep cell (internal).")
    ap.add_argument("--cell", required=True, help="cell spec JSON written by run_sweep")
    raise SystemExit(_cell_main(ap.parse_args().cell))
