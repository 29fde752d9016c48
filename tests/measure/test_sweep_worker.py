"""The sweep's benchmark worker: one process for many cells, and the failure rules around it.

vLLM's benchmark is replaced by a stand-in package on the worker's PYTHONPATH (it shadows the installed
`vllm.benchmarks.serve`), so these tests need no server and can make a cell crash or hang on purpose.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import psutil
import pytest

from tools.measure.sweep import BenchWorker, raw_name

FAKE_SERVE = '''
import argparse, json, os, time

FLAGS = ["--backend", "--base-url", "--endpoint", "--model", "--tokenizer", "--dataset-name",
         "--random-input-len", "--random-output-len", "--temperature", "--max-concurrency", "--num-prompts",
         "--seed", "--percentile-metrics", "--metric-percentiles", "--num-warmups"]

def add_cli_args(parser):
    for flag in FLAGS:
        parser.add_argument(flag)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--disable-tqdm", action="store_true")

def main(args):
    with open(os.path.join(os.environ["FAKE_BENCH_PIDS"], str(os.getpid())), "a") as f:
        f.write(args.random_input_len + "\\n")
    n = int(args.random_input_len)
    if n == 13:
        os._exit(3)          # the worker dies mid-cell
    if n == 14:
        time.sleep(600)      # the worker hangs
    print("benchmark output for", n)
    return {"completed": int(args.num_prompts), "failed": 0, "output_throughput": float(n),
            "duration": 0.1, "total_output_tokens": 4 * int(args.num_prompts)}
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    pkg = tmp_path / "fake" / "vllm"
    (pkg / "benchmarks").mkdir(parents=True)
    (pkg / "utils").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "benchmarks" / "__init__.py").write_text("")
    (pkg / "benchmarks" / "serve.py").write_text(textwrap.dedent(FAKE_SERVE))
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "utils" / "argparse_utils.py").write_text("from argparse import ArgumentParser as FlexibleArgumentParser\n")
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_BENCH_PIDS", str(pids))
    return pids


def _spec(raw: Path, input_len: int, repeats=(0, 1)) -> dict:
    return {"base_url": "http://127.0.0.1:9", "model": "m", "tokenizer": "t", "input_len": input_len,
            "output_len": 4, "concurrency": 1, "num_prompts": 2, "repeats": list(repeats),
            "seeds": {str(k): 100 + k for k in repeats}, "warmup_seed": 7, "raw_dir": str(raw),
            "log_file": str(raw / f"L{input_len}.log")}


def _record(raw: Path, input_len: int, k: int) -> dict:
    return json.loads((raw / raw_name(input_len, 1, k)).read_text())["repeat_result"]


def test_one_worker_serves_every_cell(fake_vllm, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with BenchWorker() as worker:
        for n in (10, 11, 12):
            assert worker.run_cell(_spec(raw, n), timeout_s=60) == (0, None)
        pid = worker.proc.pid
    assert worker.starts == 1
    assert [p.name for p in fake_vllm.iterdir()] == [str(pid)]  # every cell ran in that one process
    # warm-up + two repeats per cell, in order
    assert (fake_vllm / str(pid)).read_text().split() == [x for n in (10, 11, 12) for x in [str(n)] * 3]
    for n in (10, 11, 12):
        assert [_record(raw, n, k)["status"] for k in (0, 1)] == ["ok", "ok"]
        assert _record(raw, n, 0)["metrics"]["output_throughput"] == float(n)
        assert f"benchmark output for {n}" in (raw / f"L{n}.log").read_text()  # each cell's output in its log
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_dead_worker_fails_its_cell_only_and_the_next_cell_gets_a_new_one(fake_vllm, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with BenchWorker() as worker:
        assert worker.run_cell(_spec(raw, 10), timeout_s=60) == (0, None)
        rc, why = worker.run_cell(_spec(raw, 13), timeout_s=60)
        assert rc == 3 and why is None
        assert not (raw / raw_name(13, 1, 0)).exists()  # the caller turns a missing record into a failure
        assert worker.run_cell(_spec(raw, 12), timeout_s=60) == (0, None)
    assert worker.starts == 2
    assert _record(raw, 12, 1)["status"] == "ok"


def test_a_hung_cell_is_stopped_at_its_time_limit_with_its_whole_group(fake_vllm, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with BenchWorker() as worker:
        worker.run_cell(_spec(raw, 10), timeout_s=60)
        hung_pid = worker.proc.pid
        rc, why = worker.run_cell(_spec(raw, 14), timeout_s=1)
        assert rc == -1 and "time limit of 1 s" in why
        assert not psutil.pid_exists(hung_pid) or psutil.Process(hung_pid).status() == psutil.STATUS_ZOMBIE
        assert worker.run_cell(_spec(raw, 11), timeout_s=60) == (0, None)
    assert worker.starts == 2


def test_an_interrupt_ends_the_worker(fake_vllm, tmp_path, monkeypatch):
    import select

    raw = tmp_path / "raw"
    raw.mkdir()
    worker = BenchWorker()
    worker.run_cell(_spec(raw, 10), timeout_s=60)
    pid = worker.proc.pid
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(select, "select", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.run_cell(_spec(raw, 14), timeout_s=60)
    assert calls and worker.proc is None
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
