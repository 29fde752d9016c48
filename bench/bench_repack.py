"""Benchmark of the one-pass build on a synthetic QAT-like checkpoint with the real E2B shapes.

    .venv/bin/python bench/bench_repack.py --scale 0.25            # a quarter of the vocabulary, layers, towers
    .venv/bin/python bench/bench_repack.py --scale 1 --keep        # full size (~10.2 GB source)
    .venv/bin/python bench/bench_repack.py --scale 0.26 --levels peaked --steps fp16 --rounding exact \
        --target-dtype bfloat16 --objective runtime-exact               # another distribution and build
    .venv/bin/python bench/bench_repack.py --ab OLD_kernel.py repack/grid/_kernel_numba.py   # a kernel change, A/B
    .venv/bin/python bench/bench_repack.py --scale 1 --member E4B --rounds 3 --baseline /tmp/main-export
        # E4B's shapes; three rounds, each: cp, the build, cp, the baseline tree's build (same load for all)

The grid tensors' distribution: levels uniform over what each group's peak allows or peaked (Laplace-like),
steps drawn as float32 or float16 values, log-uniformly over [e^-9, e^-3] (synthetic.grid_words' own draw) or
uniformly over the same range (--step-draw uniform: most steps then lie in the top two binades), values the
bf16 nearest to step * level (exact) or with a quarter of them rounded the other way (other-way: the
project's default synthetic data, like Google's export).

Writes the checkpoint once (kept with --keep and reused), copies it with `cp -r` for reference, runs
`python3 -m repack build SRC OUT --text-only --embed-int4 --embed-tokens` in a fresh process and prints: MB/s of
source processed (tensors read / wall time, and whole source / wall time), wall time against cp of the same
files, and peak RSS of the build process. Both runs read the source from the page cache (it was just written
or copied), so the comparison is about work, not disk.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from repack import choices  # noqa: E402
from repack.grid import grid  # noqa: E402
from repack.params import OTHER_DTYPE_SAMPLE  # noqa: E402
from repack.stand_ins.synthetic import grid_words, write_member_checkpoint  # noqa: E402

STEPS = {"fp32": np.float32, "fp16": np.float16}
ROUNDING = {"exact": 0.0, "other-way": 0.26}


def _child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def kernel_only(args) -> int:
    """The grid kernel alone, one thread, CPU time per value, on every distribution, target and objective:
    row blocks of E2B's widths (1536: q/gate/up, 6144 and 12288: down projections, 8960: the PLE table)."""
    import itertools

    out = []
    rng = np.random.default_rng(0)
    widths = (1536, 6144, 8960, 12288)
    grid.quantize(np.zeros((1, 32), np.uint16))  # compile or load from the cache outside the timing
    for levels, steps, rounding in itertools.product(("uniform", "peaked"), tuple(STEPS), tuple(ROUNDING)):
        blocks = [grid_words(max(1, (4 << 20) // (2 * w)), w, rng, STEPS[steps], ROUNDING[rounding], levels)
                  for w in widths]
        n = sum(b.size for b in blocks)
        for target, objective in itertools.product(choices.TARGETS, choices.OBJECTIVES):
            best = float("inf")
            for _ in range(args.repeat):
                t = time.process_time()
                for b in blocks:
                    grid.quantize(b, target, objective, args.other_every)
                best = min(best, time.process_time() - t)
            row = {"levels": levels, "steps": steps, "rounding": rounding, "target_dtype": target,
                   "objective": objective, "other_every": args.other_every, "values": n, "cpu_s": round(best, 4),
                   "m_values_per_cpu_s": round(n / best / 1e6, 1), "mb_bf16_per_cpu_s": round(2 * n / best / 1e6, 1)}
            out.append(row)
            print(f"{levels:8} {steps} {rounding:9} {target:9} {objective:14} {row['m_values_per_cpu_s']:7.1f} M values "
                  f"per CPU s ({row['mb_bf16_per_cpu_s']:.0f} MB of bf16)", flush=True)
    if args.result:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps({"implementation": grid.implementation(), "loadavg": os.getloadavg(),
                                           "rows": out}, indent=2) + "\n")
    return 0


def _load_kernel(path: Path):
    import hashlib
    import importlib.util

    from repack.grid import _kernel_numba

    # numba's on-disk cache is keyed by the source file and records the module name: the project's own kernel
    # loaded under another name would leave cache entries that `repack` then fails to load (no such module)
    if path.resolve() == Path(_kernel_numba.__file__).resolve():
        return _kernel_numba.quantize_rows
    # one name per file, stable across runs
    name = "kernel_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = mod  # numba's cache pickles the module name
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod.quantize_rows


@functools.cache  # asked on every timed call: inspected once per kernel
def _samples(k) -> bool:
    """Whether a `quantize_rows` kernel takes the other dtype's sample (kernels before it compute every group's)."""
    return "other_every" in inspect.signature(k.py_func).parameters


def _run_kernel(k, words: np.ndarray, target: str, objective: str, other_every: int = 1):
    """One call of a `quantize_rows` kernel with grid.quantize's arguments (same tables, same order)."""
    tgt = grid.target_of(target)
    oth = grid.other_target(tgt)
    rows, cols = words.shape
    packed = np.empty((rows, cols // 8), dtype=np.int32)
    scales = np.empty((rows, cols // grid.GROUP))
    stats = np.zeros(grid.N_STATS)
    extra = (other_every,) if _samples(k) else ()
    k(words, packed.view(np.uint32), scales, stats, grid._RATIO_TABLE32, grid.LOWBIT,
      *grid.bits_of(grid.SCALE_DTYPE[tgt]), *grid.bits_of(grid.SCALE_DTYPE[oth]), objective == "min-error", *extra)
    return packed, scales, stats


def kernel_ab(args) -> int:
    """Two versions of the kernel module (files) in one process, alternating, thread CPU time, best of
    --repeat; their outputs (levels, scales, stats) must be identical on every block, else it stops."""
    import itertools

    ka, kb = _load_kernel(args.ab[0]), _load_kernel(args.ab[1])
    rng = np.random.default_rng(0)
    out = []
    for levels, steps, rounding in itertools.product(("uniform", "peaked"), tuple(STEPS), tuple(ROUNDING)):
        blocks = [grid_words(max(1, (1 << 20) // (2 * w)), w, rng, STEPS[steps], ROUNDING[rounding], levels)
                  for w in (1536, 6144, 8960, 12288)]
        n = sum(b.size for b in blocks)
        for b in blocks:
            a, c = (_run_kernel(ka, b, args.target_dtype, args.objective, args.other_every),
                    _run_kernel(kb, b, args.target_dtype, args.objective, args.other_every))
            # a kernel that computes every group's other-dtype figures is compared on the target's alone
            same = _samples(ka) == _samples(kb) or args.other_every == 1
            keep = slice(None) if same else grid.TARGET_STATS
            if not (np.array_equal(a[0], c[0]) and np.array_equal(a[1], c[1])
                    and np.allclose(a[2][keep], c[2][keep], rtol=1e-12, atol=0)):
                print(f"{levels} {steps} {rounding}: the two kernels' outputs differ", file=sys.stderr)
                return 1
        best = [float("inf")] * 2
        for _ in range(args.repeat):
            for i, k in enumerate((ka, kb)):
                t = time.thread_time()
                for b in blocks:
                    _run_kernel(k, b, args.target_dtype, args.objective, args.other_every)
                best[i] = min(best[i], time.thread_time() - t)
        row = {"levels": levels, "steps": steps, "rounding": rounding, "target_dtype": args.target_dtype,
               "objective": args.objective, "m_values_per_cpu_s_a": round(n / best[0] / 1e6, 1),
               "m_values_per_cpu_s_b": round(n / best[1] / 1e6, 1)}
        out.append(row)
        print(f"{levels:8} {steps} {rounding:9} A {row['m_values_per_cpu_s_a']:6.1f}  B "
              f"{row['m_values_per_cpu_s_b']:6.1f} M values per CPU s  (B/A {best[0] / best[1]:.2f})", flush=True)
    if args.result:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps({"a": str(args.ab[0]), "b": str(args.ab[1]), "loadavg": os.getloadavg(),
                                           "rows": out}, indent=2) + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.1, help="fraction of the full E2B size (default 0.1)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/repack-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the synthetic source for the next run")
    ap.add_argument("--threads", type=int, default=0, help="worker threads (0: one per core)")
    ap.add_argument("--result", type=Path, help="also write the figures as JSON here")
    ap.add_argument("--levels", choices=("uniform", "peaked"), default="uniform", help="level distribution")
    ap.add_argument("--steps", choices=tuple(STEPS), default="fp32", help="dtype the group steps are drawn in")
    ap.add_argument("--step-draw", choices=("log-uniform", "uniform"), default="log-uniform",
                    help="how each group's step is drawn over [e^-9, e^-3]")
    ap.add_argument("--rounding", choices=tuple(ROUNDING), default="other-way",
                    help="exact: every value the nearest bf16 of step * level; other-way: a quarter the other way")
    ap.add_argument("--target-dtype", choices=choices.TARGETS, default=choices.DEFAULT_TARGET)
    ap.add_argument("--objective", choices=choices.OBJECTIVES, default=choices.DEFAULT_OBJECTIVE)
    ap.add_argument("--kernel-only", action="store_true",
                    help="time the grid kernel alone on every distribution, target and objective (no build)")
    ap.add_argument("--other-every", type=int, default=OTHER_DTYPE_SAMPLE,
                    help="--kernel-only, --ab: the other dtype's sample (default the build's; 1: every group)")
    ap.add_argument("--repeat", type=int, default=3, help="--kernel-only, --ab: best of this many runs")
    ap.add_argument("--ab", nargs=2, type=Path, metavar=("KERNEL_A", "KERNEL_B"),
                    help="time two copies of repack/grid/_kernel_numba.py against each other (no build), asserting "
                         "identical outputs; for --target-dtype / --objective")
    ap.add_argument("--member", choices=("E2B", "E4B"), default="E2B", help="whose shapes the source has")
    ap.add_argument("--fill", choices=("grid", "tiled"), default="grid",
                    help="tiled: one row block drawn per tensor and repeated (the same distribution, written at disk "
                         "speed)")
    ap.add_argument("--rounds", type=int, default=1, help="cp + build rounds (each build after its own cp)")
    ap.add_argument("--baseline", type=Path, help="another checkout of the project whose build is timed in the same "
                                                   "rounds (e.g. `git archive main` unpacked), after its own cp")
    args = ap.parse_args()
    if args.ab:
        return kernel_ab(args)
    if args.kernel_only:
        return kernel_only(args)

    dist = f"{args.levels}-{args.steps}-{args.rounding}" + ("-uniform-steps" if args.step_draw == "uniform" else "")
    # the default distribution keeps its former directory name, so a kept source is reused
    dist += "-tiled" if args.fill == "tiled" else ""
    src = args.workdir / (f"{args.member.lower()}-synthetic-{args.scale:g}" if dist == "uniform-fp32-other-way"
                          else f"{args.member.lower()}-synthetic-{args.scale:g}-{dist}")
    stamp = src / ".complete"
    if not stamp.exists():
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        size = write_member_checkpoint(args.member, src, args.scale, progress=sys.stdout.isatty(),
                                       jitter=ROUNDING[args.rounding], step_dtype=STEPS[args.steps],
                                       levels=args.levels, step_draw=args.step_draw, fill=args.fill)
        stamp.write_text(str(size))
        print(f"wrote {src} ({size / 1e9:.2f} GB) in {time.perf_counter() - t:.1f} s")
    size = int(stamp.read_text())
    trees = {"build": ROOT} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    for root in trees.values():
        # Compile (or load from numba's on-disk cache) each tree's grid kernel first: a one-time cost per install
        # that would otherwise land inside the timed build (both specialisations: a build passes read-only views)
        # (repack/grid/kernel_cache.py since the repack's folders; a baseline from before has repack/kernel_cache.py)
        new_place = (root / "repack" / "grid" / "kernel_cache.py").exists()
        warm = "repack.grid.kernel_cache" if new_place else "repack.kernel_cache"
        subprocess.run([sys.executable, "-m", warm], cwd=root, env=_env(root), check=True,
                       stdout=subprocess.DEVNULL)
    runs = []
    for rnd in range(args.rounds):
        for name, root in trees.items():
            cp = _cp(src, args.workdir)  # just before each build, so that both see the same load
            run = _build(root, src, args.workdir / "build-out", args) | {"tree": name, "round": rnd, "cp": cp}
            run["build_vs_cp"] = round(run["build_wall_s"] / cp["wall_s"], 2)
            runs.append(run)
            print(f"round {rnd} {name:8}: build {run['build_wall_s']:6.1f} s wall, {run['build_cpu_s']:6.1f} CPU s, "
                  f"peak RSS {run['peak_rss_mib']} MiB | cp {cp['wall_s']:5.1f} s -> {run['build_vs_cp']}x | "
                  f"load {run['loadavg_before'][0]:.2f} -> {run['loadavg_after'][0]:.2f}", flush=True)
            if run.get("error"):
                print(run["error"], file=sys.stderr)
                return 1
            _write_figures(args, runs, trees, size, dist)  # after each run: a series stopped early keeps its runs
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
    figures = _write_figures(args, runs, trees, size, dist)
    summary, rep = figures["summary"], runs[0]["report"]
    print(f"{args.member} x{args.scale:g}, distribution {dist}, build for {args.target_dtype} / {args.objective}; "
          f"{figures['cpu']}, {figures['cores']} cores")
    print(f"source {size / 1e9:.2f} GB (read {rep['bytes_read'] / 1e9:.2f} GB: towers are dropped unread), "
          f"wrote {rep['bytes_written'] / 1e9:.2f} GB")
    for name, f in summary.items():
        print(f"{name:8}: build/cp median {f['build_vs_cp']['median']}x (min {f['build_vs_cp']['min']}, max "
              f"{f['build_vs_cp']['max']}); build wall median {f['build_wall_s']['median']} s = "
              f"{round(size / 1e6 / f['build_wall_s']['median'], 1)} MB/s of source; CPU median "
              f"{f['build_cpu_s']['median']} s; cp median {f['cp_wall_s']['median']} s; peak RSS max "
              f"{f['peak_rss_mib']['max']} MiB")
    return 0


def _write_figures(args, runs: list[dict], trees: dict, size: int, dist: str) -> dict:
    """The figures of the runs so far (summary: median, min, max per tree), written to --result if given."""
    rep = runs[0]["report"]
    summary = {name: _spread([r for r in runs if r["tree"] == name]) for name in trees if any(
        r["tree"] == name for r in runs)}
    figures = {
        "member": args.member, "scale": args.scale, "distribution": dist, "levels": args.levels, "steps": args.steps,
        "rounding": args.rounding, "step_draw": args.step_draw, "fill": args.fill, "target_dtype": args.target_dtype,
        "objective": args.objective, "source_bytes": size, "bytes_read": rep["bytes_read"],
        "bytes_written": rep["bytes_written"], "cpu": _cpu_name(), "cores": len(os.sched_getaffinity(0)),
        "rounds": args.rounds, "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "report"} for r in runs],
        "exact_runtime_fp16_pct": {t["name"]: t["exact_runtime_fp16_pct"] for t in rep["tables"] if t["groups"]},
        "exact_runtime_bf16_pct": {t["name"]: t["exact_runtime_bf16_pct"] for t in rep["tables"] if t["groups"]},
        "offgrid_groups": sum(t.get("offgrid_groups", 0) for t in rep["tables"]),
    }
    if args.result:
        args.result.parent.mkdir(parents=True, exist_ok=True)
        args.result.write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def _env(root: Path) -> dict:
    return dict(os.environ, PYTHONPATH=str(root))


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _cp(src: Path, workdir: Path) -> dict:
    """`cp -r` of the source (then sync), as a user would copy it: wall and CPU seconds."""
    dst = workdir / "cp-copy"
    shutil.rmtree(dst, ignore_errors=True)
    c0, t = _child_cpu(), time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    os.sync()
    wall, cpu = time.perf_counter() - t, _child_cpu() - c0
    shutil.rmtree(dst, ignore_errors=True)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}


def _build(root: Path, src: Path, out: Path, args) -> dict:
    """`python -m repack build SRC OUT --text-only --embed-int4 --embed-tokens` of the tree at root, in a fresh
    process (then sync): wall and CPU seconds, peak RSS, the load average around it, and its report."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "repack", "build", str(src), str(out), "--text-only", "--embed-int4",
           "--embed-tokens", "--json", "--target-dtype", args.target_dtype, "--objective", args.objective]
    load = os.getloadavg()  # other work on the machine changes the wall figures, not the CPU ones
    c0, t = _child_cpu(), time.perf_counter()
    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=_env(root))
    os.sync()
    wall, cpu = time.perf_counter() - t, _child_cpu() - c0
    shutil.rmtree(out, ignore_errors=True)
    if r.returncode != 0:
        return {"error": r.stderr, "build_wall_s": wall, "build_cpu_s": cpu, "peak_rss_mib": 0,
                "loadavg_before": load, "loadavg_after": os.getloadavg()}
    rep = json.loads(r.stdout)
    return {"build_wall_s": round(wall, 2), "build_internal_wall_s": rep["wall_s"], "build_cpu_s": round(cpu, 2),
            "peak_rss_mib": round(rep["peak_rss_bytes"] / 2**20, 1), "implementation": rep["implementation"],
            "loadavg_before": [round(x, 2) for x in load], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "report": rep}


def _spread(runs: list[dict]) -> dict:
    """median, min and max over the rounds of each figure"""
    out = {}
    for key, get in (("build_wall_s", lambda r: r["build_wall_s"]), ("build_cpu_s", lambda r: r["build_cpu_s"]),
                     ("cp_wall_s", lambda r: r["cp"]["wall_s"]), ("build_vs_cp", lambda r: r["build_vs_cp"]),
                     ("peak_rss_mib", lambda r: r["peak_rss_mib"])):
        v = [get(r) for r in runs]
        out[key] = {"median": round(float(np.median(v)), 2), "min": min(v), "max": max(v)}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
