"""The int4 GEMM of the vLLM plugin on this CPU at Gemma 4's real layer shapes: the plugin's int4 matmul
(gemma4_t4_vllm/int4_matmul.py) against the fallback it replaces (the torch dequantize-and-matmul of
`gemma4_t4_vllm/wna16.py` as of --baseline-rev, loaded from git, on the weight layout vLLM's CPUWNA16 leaves),
and ATen's int4 CPU GEMM (`_weight_int4pack_mm_for_cpu`) in float16 and bfloat16 for reference.

    .venv/bin/python bench/bench_int4_gemm.py [--rounds 5] [--rows 1] [--threads 1] [--baseline-rev e193131~1]
        [--out evidence/cpu-int4-gemm.json]

Each round times one call of every method on every shape, the methods interleaved, so that the machine's load
(shared) falls on all of them; the figures are the median and the range over the rounds, with the load average
before and after, in wall time and in this process's CPU time (one thread: what the call cost the core it ran on,
whatever share of it the machine's other work left). Every method's output is checked against the float64 product of the exact weight first.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gemma4_t4_vllm import int4_matmul  # noqa: E402
from tools.core import clock  # noqa: E402

# (name, output channels N, inputs K) of the layers a decode step multiplies, at E2B's and E4B's shapes
SHAPES = [("e2b q_proj", 2048, 1536), ("e2b mlp gate/up", 6144, 1536), ("e2b mlp down", 1536, 6144),
          ("e4b q_proj", 2048, 2560), ("e4b mlp gate/up", 10240, 2560), ("e4b mlp down", 2560, 10240)]
GROUP = 32


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def old_fallback(rev: str) -> types.ModuleType:
    """gemma4_t4_vllm/wna16.py as it was at `rev` (its gemm_wna16: the dequantize-and-matmul per forward)."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:gemma4_t4_vllm/wna16.py"], check=True,
                         capture_output=True, text=True).stdout
    module = types.ModuleType("wna16_baseline")
    exec(compile(src, f"{rev}:gemma4_t4_vllm/wna16.py", "exec"), module.__dict__)
    return module


def layouts(rng, n: int, k: int):
    """One random int4 weight in every method's layout, and its exact float32 value [K, N]."""
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.scalar_type import scalar_types

    q = torch.from_numpy(rng.integers(0, 16, size=(n, k), dtype=np.int32))  # level + 8
    nib = q.numpy().astype(np.uint64).reshape(n, k // 8, 8) << (np.arange(8, dtype=np.uint64) * 4)
    words = torch.from_numpy(nib.sum(-1).astype(np.uint32).view(np.int32))  # compressed-tensors' [N, K/8]
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, size=(k // GROUP, n)).astype(np.float32)).half()
    layer = torch.nn.Module()  # what CPUWNA16LinearKernel leaves for cpu_gemm_wna16 (the old fallback's input)
    layer.weight_packed = torch.nn.Parameter(words.t(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scales, requires_grad=False)
    kernel = types.SimpleNamespace(w_q_name="weight_packed", w_s_name="weight_scale", config=types.SimpleNamespace(
        weight_type=scalar_types.uint4b8))
    CPUWNA16LinearKernel._process_gptq_weights_w4a16(kernel, layer)
    aten = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scales.float(), torch.zeros_like(scales, dtype=torch.float32)], -1)  # [K/G, N, 2]
    return {"tiles": int4_matmul.to_tiles(words), "scales": scales, "cpuwna16": layer.weight_packed.data,
            "aten": aten, "aten_sz16": sz.half(), "aten_szbf": sz.bfloat16(),
            "dense": (q.float() - 8).t() * scales.float().repeat_interleave(GROUP, 0)}


def methods(old):
    import torch

    return {
        "old fallback (dequantize + matmul, float32)":
            lambda x, w: old.gemm_wna16(x, w["cpuwna16"], w["scales"], None, None, 8, "vec"),
        "int4_matmul (the kernel up to MAX_GEMV_ROWS rows, else dequantize)":
            lambda x, w: int4_matmul.linear(x, w["tiles"], w["scales"]),
        "ATen int4 float16": lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w["aten"], GROUP,
                                                                                      w["aten_sz16"]),
        "ATen int4 bfloat16": lambda x, w: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), w["aten"], GROUP, w["aten_szbf"]).half(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", type=int, default=1, help="rows of x (1: a decode step)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (vLLM's CPU worker here: 1)")
    ap.add_argument("--baseline-rev", default="e193131~1", help="git revision of the old fallback")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence" / "cpu-int4-gemm.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    old = old_fallback(args.baseline_rev)
    rng = np.random.default_rng(0)
    weights = {name: layouts(rng, n, k) for name, n, k in SHAPES}
    xs = {name: torch.from_numpy(rng.standard_normal((args.rows, k)).astype(np.float32)).half()
          for name, _, k in SHAPES}
    fns = methods(old)
    errors = {}
    for name, _, _ in SHAPES:  # correctness first (and every method's first call, out of the timings)
        exact = xs[name].double() @ weights[name]["dense"].double()
        scale = exact.abs().max().item()
        errors[name] = {m: (fn(xs[name], weights[name]).double() - exact).abs().max().item() / scale
                        for m, fn in fns.items()}
    times: dict = {name: {m: [] for m in fns} for name, _, _ in SHAPES}
    cpu: dict = {name: {m: [] for m in fns} for name, _, _ in SHAPES}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for name, _, _ in SHAPES:
            for m, fn in fns.items():
                t, c = time.perf_counter(), time.process_time()
                fn(xs[name], weights[name])
                times[name][m].append(time.perf_counter() - t)
                cpu[name][m].append(time.process_time() - c)
    load_after = os.getloadavg()
    rows = []
    for name, n, k in SHAPES:
        int4_bytes = n * k // 2 + n * k // GROUP * 2
        for m in fns:
            ts, cs = times[name][m], cpu[name][m]
            rows.append({"shape": name, "n": n, "k": k, "method": m, "median_ms": 1e3 * statistics.median(ts),
                         "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
                         "cpu_median_ms": 1e3 * statistics.median(cs), "cpu_min_ms": 1e3 * min(cs),
                         "cpu_max_ms": 1e3 * max(cs),
                         "int4_gb_per_s": int4_bytes / statistics.median(ts) / 1e9,
                         "int4_gb_per_cpu_s": int4_bytes / statistics.median(cs) / 1e9,
                         "max_rel_error": errors[name][m]})
    record = {"date": clock.minute(),
              "command": " ".join(["python", *sys.argv]), "cpu": cpu_name(),
              "capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
              "threads": args.threads, "rows": args.rows, "rounds": args.rounds, "group_size": GROUP,
              "baseline_rev": args.baseline_rev, "load_average_before": load_before,
              "load_average_after": load_after, "results": rows}
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{record['cpu']} ({record['capability']}), {args.threads} thread(s), {args.rows} row(s), "
          f"{args.rounds} rounds, load {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print("| shape | method | wall ms, median (range) | CPU ms, median (range) | int4 GB per wall s | "
          "per CPU s | max rel. error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} ({r['n']} x {r['k']}) | {r['method']} | {r['median_ms']:.2f} "
              f"({r['min_ms']:.2f}-{r['max_ms']:.2f}) | {r['cpu_median_ms']:.2f} ({r['cpu_min_ms']:.2f}-"
              f"{r['cpu_max_ms']:.2f}) | {r['int4_gb_per_s']:.2f} | {r['int4_gb_per_cpu_s']:.2f} "
              f"| {r['max_rel_error']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
