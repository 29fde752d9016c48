"""A stand-in for vLLM's `bench serve` on a benchmark worker's PYTHONPATH: a package `vllm` whose
`vllm.benchmarks.serve` has the module-level names the sweep worker uses (add_cli_args, get_tokenizer, main and
the metrics fetchers), so sweep and capacity tests need no vLLM server and can make a cell crash, hang or take
time on purpose (input length 13 exits, 14 hangs, 15 fails every request; STAND_IN_BENCH_SLEEP_S delays each call).
Each call appends its input length to STAND_IN_BENCH_PIDS/<worker pid>; STAND_IN_BENCH_LOG gets tokenizer loads and
metrics reads."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

STAND_IN_SERVE = '''
import argparse, asyncio, json, os, time, urllib.request

FLAGS = ["--backend", "--base-url", "--endpoint", "--model", "--tokenizer", "--dataset-name",
         "--random-input-len", "--random-output-len", "--temperature", "--max-concurrency", "--num-prompts",
         "--seed", "--percentile-metrics", "--metric-percentiles", "--num-warmups", "--ready-check-timeout-sec",
         "--request-rate"]

def add_cli_args(parser):
    for flag in FLAGS:
        parser.add_argument(flag)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-detailed", action="store_true")
    parser.add_argument("--goodput", nargs="+")

def get_tokenizer(name, **kwargs):
    with open(os.path.join(os.environ["STAND_IN_BENCH_LOG"], "tokenizer-loads"), "a") as f:
        f.write(name + "\\n")
    return name

async def fetch_spec_decode_metrics(base_url, session):
    with open(os.path.join(os.environ["STAND_IN_BENCH_LOG"], "vllm-metrics-reads"), "a") as f:
        f.write(base_url + "\\n")
    return {}

async def fetch_diffusion_metrics(base_url, session):
    return await fetch_spec_decode_metrics(base_url, session)

def main(args):
    with open(os.path.join(os.environ["STAND_IN_BENCH_PIDS"], str(os.getpid())), "a") as f:
        f.write(args.random_input_len + "\\n")
    get_tokenizer(args.tokenizer, tokenizer_mode="auto", trust_remote_code=False)
    asyncio.run(fetch_spec_decode_metrics(args.base_url, None))
    n, prompts = int(args.random_input_len), int(args.num_prompts)
    if n == 13:
        os._exit(3)          # the worker dies mid-cell
    if n == 14:
        time.sleep(600)      # the worker hangs
    if n == 15:              # the server is gone: every request fails, the call itself returns
        return {"completed": 0, "failed": prompts, "errors": ["Cannot connect to host"] * prompts}
    try:                     # the requests' prompt tokens, as the server's prefix-cache counters would count them
        urllib.request.urlopen(f"{args.base_url}/add?{n * prompts}", timeout=5).read()
    except OSError:
        pass
    time.sleep(float(os.environ.get("STAND_IN_BENCH_SLEEP_S") or 0))
    print("benchmark output for", n)
    latency = {f"{s}_{m}_ms": v for m, v in (("ttft", 20.0), ("tpot", 5.0), ("itl", 5.0), ("e2el", 40.0))
               for s in ("mean", "median", "p50", "p90", "p99")}
    return {"completed": prompts, "failed": 0, "output_throughput": float(n), "request_goodput": 1.0,
            "duration": 0.1, "total_output_tokens": 4 * prompts, "errors": [""] * prompts, **latency}
'''


def install(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Writes the package under tmp_path/stand-in; returns (the PYTHONPATH entry, the pids folder, the log folder)."""
    pkg = tmp_path / "stand-in" / "vllm"
    (pkg / "benchmarks").mkdir(parents=True)
    (pkg / "utils").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "benchmarks" / "__init__.py").write_text("")
    (pkg / "benchmarks" / "serve.py").write_text(textwrap.dedent(STAND_IN_SERVE))
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "utils" / "argparse_utils.py").write_text("from argparse import ArgumentParser as FlexibleArgumentParser\n")
    pids = tmp_path / "pids"
    pids.mkdir()
    log = tmp_path / "bench-log"
    log.mkdir()
    return tmp_path / "stand-in", pids, log


def child_env(tmp_path: Path, root_dir: Path, sleep_s: str) -> tuple[dict[str, str], Path]:
    """A child's environment that runs this stand-in as `vllm bench serve` (each call `sleep_s` long) with the
    project (`root_dir`) importable; returns it and the folder where each worker's calls are counted."""
    root, pids, log = install(tmp_path)
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{root_dir}", STAND_IN_BENCH_PIDS=str(pids),
               STAND_IN_BENCH_LOG=str(log), STAND_IN_BENCH_SLEEP_S=sleep_s)
    return env, pids
