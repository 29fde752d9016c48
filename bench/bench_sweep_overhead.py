"""How much the sweep harness adds on top of vLLM's own benchmark.

1. A small sweep's wall time against the sum of its repeats' measured durations (vLLM's `duration`), split into
   benchmark time, warm-up, and the rest (process start, imports, tokenizer, /metrics reads, file writes).
2. One cell measured by `run_sweep` against the same cell by a direct `vllm bench serve` call (vLLM's own
   argument parser and `main`, in a fresh process, as the console script would run it), same server, same
   seed, alternating A/B several times: output tok/s of the two should differ by less than the run-to-run
   spread.
3. The marginal cost of one more cell: a 3-cell and a 6-cell sweep (one repeat each, warm-up on), the time
   outside vLLM's measured durations and warm-ups, and its difference per added cell; `--rounds` pairs, in
   alternating order, and their median (one pair's difference is within the noise of a loaded machine). Beside
   it, each cell's own wall time in the worker minus its warm-up and measured duration. The benchmark worker
   imports vLLM's bench code once per sweep and keeps the tokenizer, so an added cell should cost well under a
   second beyond its own requests.

Usage (against a running server; on a CPU box start one with ./vllm-t4 start or by hand, or pass --tiny to
build the tiny model and serve it for the run, stopped at the end; hold the shared vLLM lock either way):

    python bench/bench_sweep_overhead.py --base-url http://127.0.0.1:8000 [--input-len 64 --output-len 32]
        [--parts 1,3]   (the parts to run; default all three)
    flock /tmp/gemma4-vllm.lock python bench/bench_sweep_overhead.py --tiny --parts 3 --rounds 3

Writes evidence/sweep-overhead-<UTC date>.json and .md and prints the markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.core import clock  # noqa: E402
from tools.measure.provenance import collect, server_info  # noqa: E402
from tools.measure.sweep.cells import prompt_seed  # noqa: E402
from tools.measure.sweep.params import SweepParams  # noqa: E402
from tools.measure.sweep.run import run_sweep  # noqa: E402

DIRECT = """
import json, sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser(); add_cli_args(p)
res = main(p.parse_args(sys.argv[2:]))
json.dump({k: v for k, v in res.items() if isinstance(v, (int, float, str))}, open(sys.argv[1], "w"))
"""


def direct_cell(base_url: str, model: str, tokenizer: str, input_len: int, output_len: int, concurrency: int,
                num_prompts: int, seed: int, out: Path) -> tuple[dict, float]:
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--seed", str(seed),
            "--disable-tqdm"]
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", DIRECT, str(out), *argv], check=True, cwd=ROOT,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text()), time.monotonic() - t


@contextlib.contextmanager
def tiny_server(workdir: Path):
    """The tiny model's int4-embedding build (as the tests build it) served on a free port for the run."""
    import socket

    from repack.build.build import BuildOptions, build_checkpoint
    from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint
    from tools.serving.config import load_config
    from tools.serving import start_server, stop_server

    src = cached_tiny_qat_checkpoint(workdir / "gemma-4-tiny-qat").path
    build = workdir / "gemma-4-tiny-text-emb4"
    build_checkpoint(src, build, BuildOptions(text_only=True, embed_int4=True, embed_tokens=True))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = load_config(ROOT / "tpu.env", model=str(build), served_name="tiny-emb4", host="127.0.0.1", port=port,
                      state_dir=workdir / "state", max_model_len=512, max_num_seqs=8, cpu_kvcache_space_gib=1,
                      speculative_config="", extra_args="", start_timeout_s=900.0)
    start_server(cfg)
    try:
        yield cfg.base_url
    finally:
        stop_server(cfg)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", help="the server to measure (or --tiny)")
    ap.add_argument("--tiny", action="store_true", help="build the tiny model and serve it for this run")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrencies", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ab-rounds", type=int, default=4, help="alternating direct/run_sweep rounds for part 2")
    ap.add_argument("--rounds", type=int, default=3, help="3-cell/6-cell sweep pairs for part 3")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run, e.g. 1,3 (part 2 takes the longest)")
    ap.add_argument("--out", default=str(ROOT / "evidence"))
    args = ap.parse_args()
    if bool(args.base_url) == bool(args.tiny):
        ap.error("pass exactly one of --base-url URL and --tiny")
    load_start = os.getloadavg()
    with contextlib.ExitStack() as stack:
        if args.tiny:
            args.base_url = stack.enter_context(tiny_server(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        return measure(args, load_start)


def measure(args: argparse.Namespace, load_start: tuple[float, float, float]) -> int:
    parts = {int(x) for x in args.parts.split(",")}
    info = server_info(args.base_url)
    model, tokenizer = info.model_id, info.model_root
    concs = [int(c) for c in args.concurrencies.split(",")]

    part1: dict | None = None
    part2: dict | None = None
    part3: dict | None = None
    md_parts: list[str] = []

    def spread(v: list[float]) -> float:
        return (max(v) - min(v)) / statistics.median(v) * 100

    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        p = SweepParams(base_url=args.base_url, input_lens=[args.input_len], output_len=args.output_len,
                        concurrencies=concs, repeats=args.repeats, label="overhead", out=tmpd / "sweep")
        if 1 in parts:
            # Part 1: a small sweep, where its wall time goes.
            t = time.monotonic()
            res = run_sweep(p)
            wall = time.monotonic() - t
            measured = sum(r.metrics["duration"] for c in res.cells for r in c.repeats if r.status == "ok")
            bench_calls = sum(r.measure_s or 0 for c in res.cells for r in c.repeats)
            warm = sum(r.warmup_s or 0 for c in res.cells for r in c.repeats)
            part1 = {"wall_s": wall, "sum_measured_duration_s": measured, "sum_bench_call_s": bench_calls,
                     "sum_warmup_s": warm, "other_s": wall - bench_calls - warm,
                     "cells": len(res.cells), "repeats": sum(len(c.repeats) for c in res.cells)}
            md_parts += [
                f"## A sweep's wall time ({part1['cells']} cells, {part1['repeats']} repeats, concurrency {concs})",
                "", "| | seconds |", "|---|---|",
                f"| sweep wall time | {wall:.1f} |",
                f"| sum of vLLM's measured durations | {measured:.1f} |",
                f"| sum of benchmark calls (dataset, tokenizer, requests) | {bench_calls:.1f} |",
                f"| warm-ups | {warm:.1f} |",
                f"| everything else (worker start, imports, files) | {part1['other_s']:.1f} |", ""]

        if 2 in parts:
            # Part 2: one cell, same seed, run_sweep (no warm-up, one repeat) vs a direct vllm bench serve call.
            c = concs[-1]
            n = p.num_prompts(c)
            seed = prompt_seed(p.seed, args.input_len, c, 0)
            a_vals: list[float] = []
            b_vals: list[float] = []
            hits: list[float | None] = []
            for i in range(args.ab_rounds):
                # Alternate which side goes first: with the same seed the second side may find the first side's
                # prompts in the prefix cache (whole blocks only), so neither side always gets that advantage.
                for side in (("direct", "sweep") if i % 2 == 0 else ("sweep", "direct")):
                    if side == "direct":
                        d, _ = direct_cell(args.base_url, model, tokenizer, args.input_len, args.output_len, c, n,
                                           seed, tmpd / f"direct{i}.json")
                        a_vals.append(d["output_throughput"])
                    else:
                        one = run_sweep(SweepParams(base_url=args.base_url, input_lens=[args.input_len],
                                                    output_len=args.output_len, concurrencies=[c], repeats=1,
                                                    label="overhead-cell", out=tmpd / f"cell{i}", warmup=False))
                        rep = one.cells[0].repeats[0]
                        b_vals.append(rep.metrics["output_throughput"])
                        hits.append(rep.prefix_cache_hits)
            part2 = {"concurrency": c, "num_prompts": n, "seed": seed, "direct_out_tok_s": a_vals,
                     "run_sweep_out_tok_s": b_vals, "run_sweep_prefix_cache_hit_tokens": hits,
                     "direct_median": statistics.median(a_vals), "run_sweep_median": statistics.median(b_vals),
                     "difference_pct": (statistics.median(b_vals) / statistics.median(a_vals) - 1) * 100,
                     "direct_spread_pct": spread(a_vals), "run_sweep_spread_pct": spread(b_vals)}
            md_parts += [
                f"## One cell, same seed: run_sweep vs direct `vllm bench serve` (c={c}, {n} prompts, "
                f"{args.ab_rounds} rounds, order alternating)", "",
                "| | out tok/s per round | median | spread |", "|---|---|---|---|",
                f"| direct | {', '.join(f'{v:.1f}' for v in a_vals)} | {part2['direct_median']:.1f} "
                f"| {part2['direct_spread_pct']:.1f}% |",
                f"| run_sweep | {', '.join(f'{v:.1f}' for v in b_vals)} | {part2['run_sweep_median']:.1f} "
                f"| {part2['run_sweep_spread_pct']:.1f}% |", "",
                f"Difference of medians: {part2['difference_pct']:+.1f}%.", ""]

        if 3 in parts:
            # Part 3: marginal cost of a cell. Distinct input lengths make distinct cells of the same size.
            base_len = max(8, args.input_len - 6)
            rounds: list[dict] = []
            in_cell: list[float] = []
            for i in range(args.rounds):
                outside: dict[int, float] = {}
                walls: dict[int, float] = {}
                for ncells in ((3, 6) if i % 2 == 0 else (6, 3)):
                    # lengths of their own: no sweep meets a prompt another one sent (the prefix cache)
                    lens = [base_len + i * 9 + (0 if ncells == 3 else 3) + j for j in range(ncells)]
                    t = time.monotonic()
                    r = run_sweep(SweepParams(base_url=args.base_url, input_lens=lens, output_len=args.output_len,
                                              concurrencies=[1], repeats=1, label=f"marginal{ncells}",
                                              out=tmpd / f"marginal{ncells}-{i}"))
                    walls[ncells] = time.monotonic() - t
                    if any(c3.status != "ok" for c3 in r.cells):
                        raise SystemExit(f"a cell failed: {[c3.reason for c3 in r.cells if c3.status != 'ok']}")
                    inside = sum((rep.metrics.get("duration") or 0) + (rep.warmup_s or 0)
                                 for c3 in r.cells for rep in c3.repeats)
                    outside[ncells] = walls[ncells] - inside
                    in_cell += [(c3.wall_s or 0) - sum((rep.metrics.get("duration") or 0) + (rep.warmup_s or 0)
                                                       for rep in c3.repeats) for c3 in r.cells[1:]]
                rounds.append({"wall_s": walls, "outside_measured_and_warmup_s": outside,
                               "marginal_outside_s_per_cell": (outside[6] - outside[3]) / 3,
                               "load_1min": os.getloadavg()[0]})
            marg = [x["marginal_outside_s_per_cell"] for x in rounds]
            part3 = {"input_lens_from": base_len, "rounds": rounds,
                     "marginal_outside_s_per_cell": statistics.median(marg),
                     "in_worker_outside_s_per_cell_median": statistics.median(in_cell),
                     "in_worker_outside_s_per_cell": in_cell}
            md_parts += [
                f"## The marginal cost of one more cell (concurrency 1, one repeat, warm-up on; {args.rounds} "
                f"rounds, order alternating)", "",
                "| round | 3 cells: wall s | outside s | 6 cells: wall s | outside s | per added cell, s | load (1 min) |",
                "|---|---|---|---|---|---|---|",
                *[f"| {i + 1} | {x['wall_s'][3]:.1f} | {x['outside_measured_and_warmup_s'][3]:.1f} "
                  f"| {x['wall_s'][6]:.1f} | {x['outside_measured_and_warmup_s'][6]:.1f} "
                  f"| {x['marginal_outside_s_per_cell']:.2f} | {x['load_1min']:.1f} |" for i, x in enumerate(rounds)],
                "", "\"outside\": the sweep's wall time minus vLLM's measured durations and the warm-ups.", "",
                f"Per added cell (median of the rounds): {part3['marginal_outside_s_per_cell']:.2f} s outside the "
                f"measured work. Each cell's own time in the worker beyond its warm-up and measured duration "
                f"(cells after a sweep's first): median {part3['in_worker_outside_s_per_cell_median']:.2f} s.", ""]

    prov = collect(args.base_url).to_dict()
    stamp = clock.stamp()
    load = os.getloadavg()  # other work on the machine widens every spread; say how busy it was
    record = {"date": stamp, "load_average_1_5_15": load, "load_average_at_start": load_start,
              "input_len": args.input_len,
              "output_len": args.output_len, "concurrencies": concs, "repeats": args.repeats,
              "command": " ".join(["python", *sys.argv]), "part1_sweep_wall_time": part1, "part2_same_cell": part2,
              "part3_marginal_cell": part3, "provenance": prov}
    md = "\n".join([
        f"# Sweep harness overhead ({stamp})", "",
        f"Server `{model}` at {args.base_url}, {prov.get('gpu_name') or 'CPU: ' + str(prov.get('cpu_model'))}, "
        f"vLLM {prov.get('vllm_version_server')}. Input {args.input_len}, output {args.output_len} tokens. "
        f"Load average at the start: {load_start[0]:.1f} / {load_start[1]:.1f} / {load_start[2]:.1f}, at the end: "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} CPUs.", "",
        f"Command: `{record['command']}`", "", *md_parts])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sweep-overhead-{stamp}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"sweep-overhead-{stamp}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
