"""The sweep's benchmark worker: one process for many cells, and the failure rules around it.

vLLM's benchmark is replaced by a stand-in package on the worker's PYTHONPATH (it shadows the installed
`vllm.benchmarks.serve`, with the module-level functions its `main` looks up the same way), so these tests need no
vLLM server and can make a cell crash or hang on purpose. Where counters matter, a small HTTP server stands in
for the server's /metrics and the stand-in benchmark adds its requests' tokens to them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import psutil
import pytest

from tests.helpers.stand_ins import bench as stand_in_bench
from tests.helpers.stand_ins.measure import prefix_cache_stand_in, serve_in_thread
from tools.measure.sweep.params import CellSpec, SweepParams, SweepResult, raw_name
from tools.measure.sweep.worker import BenchWorker
from tools.measure.sweep.run import _run_cells



@pytest.fixture
def stand_in_vllm(tmp_path, monkeypatch):
    root, pids, log = stand_in_bench.install(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("STAND_IN_BENCH_PIDS", str(pids))
    monkeypatch.setenv("STAND_IN_BENCH_LOG", str(log))
    return pids


@pytest.fixture
def metrics_server():
    """A stand-in for the server's /metrics: prefix-cache counters that GET /add?N raises by N queries (and N//4
    hits); yields (base_url, state) where state counts the /metrics reads."""
    state = {"queries": 0, "hits": 0, "reads": 0}
    with serve_in_thread(prefix_cache_stand_in(state)) as url:
        yield url, state


def _spec(raw: Path, input_len: int, repeats=(0, 1), *, concurrency: int = 1, base_url: str = "http://127.0.0.1:9",
          warmup: bool = True) -> CellSpec:
    return CellSpec(base_url=base_url, model="m", tokenizer="t", input_len=input_len, output_len=4,
                    concurrency=concurrency, num_prompts=2, repeats=repeats, seeds={k: 100 + k for k in repeats},
                    warmup_seed=7 if warmup else None, warmup_prompts=concurrency, raw_dir=str(raw),
                    log_file=str(raw / f"L{input_len}.log"))


def _record(raw: Path, input_len: int, k: int, concurrency: int = 1) -> dict:
    return json.loads((raw / raw_name(input_len, concurrency, k)).read_text())["repeat_result"]


def test_one_worker_serves_every_cell(stand_in_vllm, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with BenchWorker() as worker:
        for n in (10, 11, 12):
            assert worker.run_cell(_spec(raw, n), timeout_s=60) == (0, None)
        pid = worker.proc.pid
    assert worker.starts == 1
    assert [p.name for p in stand_in_vllm.iterdir()] == [str(pid)]  # every cell ran in that one process
    # warm-up + two repeats per cell, in order
    assert (stand_in_vllm / str(pid)).read_text().split() == [x for n in (10, 11, 12) for x in [str(n)] * 3]
    for n in (10, 11, 12):
        assert [_record(raw, n, k)["status"] for k in (0, 1)] == ["ok", "ok"]
        assert _record(raw, n, 0)["metrics"]["output_throughput"] == float(n)
        assert f"benchmark output for {n}" in (raw / f"L{n}.log").read_text()  # each cell's output in its log
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_dead_worker_fails_its_cell_only_and_the_next_cell_gets_a_new_one(stand_in_vllm, tmp_path):
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


def test_a_hung_cell_is_stopped_at_its_time_limit_with_its_whole_group(stand_in_vllm, tmp_path):
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


def test_an_interrupt_ends_the_worker(stand_in_vllm, tmp_path, monkeypatch):
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


def test_the_tokenizer_is_loaded_once_per_worker_and_vllm_reads_no_metrics_itself(stand_in_vllm, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with BenchWorker() as worker:
        for n, c in ((10, 1), (10, 2), (11, 1)):  # two cells with the same lengths, and one more
            assert worker.run_cell(_spec(raw, n, concurrency=c), timeout_s=60) == (0, None)
        assert worker.stats["bench_calls"] == 9  # per cell: one warm-up and two measured repeats
        assert worker.stats["tokenizer_loads"] == 1
    log = tmp_path / "bench-log"
    assert (log / "tokenizer-loads").read_text().split() == ["t"]  # vLLM's loader ran once, for nine calls
    assert not (log / "vllm-metrics-reads").exists()  # its /metrics reads are the worker's, not four per call
    assert _record(raw, 10, 1, concurrency=2)["status"] == "ok"


def test_one_metrics_read_per_repeat_and_the_counters_stay_exact(stand_in_vllm, metrics_server, tmp_path):
    url, state = metrics_server
    raw = tmp_path / "raw"
    raw.mkdir()
    with BenchWorker() as worker:
        worker.run_cell(_spec(raw, 10, base_url=url), timeout_s=60)                  # warm-up, then 2 repeats
        worker.run_cell(_spec(raw, 11, (0, 1, 2), base_url=url, warmup=False), timeout_s=60)
        worker.run_cell(_spec(raw, 12, base_url=url), timeout_s=60)
        assert worker.stats["metrics_reads"] == state["reads"]
    # After each warm-up one read starts the cell; every repeat ends with one read, which starts the next
    # repeat, and the next cell too when no warm-up comes between.
    assert state["reads"] == (1 + 2) + 3 + (1 + 2)
    for n, repeats in ((10, 2), (11, 3), (12, 2)):
        for k in range(repeats):
            rec = _record(raw, n, k)
            assert rec["status"] == "ok"
            # exactly the measured requests' tokens: no warm-up, no other repeat, no other cell
            assert (rec["prefix_cache_queries"], rec["prefix_cache_hits"]) == (n * 2, n * 2 // 4)


def test_requests_that_fail_fail_the_cell_from_their_results(stand_in_vllm, tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    with BenchWorker() as worker:
        assert worker.run_cell(_spec(raw, 15), timeout_s=60) == (0, None)
        assert worker.run_cell(_spec(raw, 15, warmup=False), timeout_s=60) == (0, None)
    assert worker.starts == 1
    rec = _record(raw, 15, 0)
    assert rec["status"] == "failed"
    assert rec["reason"] == "0 of 2 requests completed, 2 failed: Cannot connect to host"
    (raw / raw_name(15, 1, 0)).unlink()
    (raw / raw_name(15, 1, 1)).unlink()
    with BenchWorker() as worker:
        worker.run_cell(_spec(raw, 15), timeout_s=60)
    for k in (0, 1):
        assert _record(raw, 15, k)["reason"] == "warm-up failed: 0 of 1 requests completed, 1 failed: Cannot connect to host"


def test_health_is_asked_only_after_a_failed_cell(stand_in_vllm, tmp_path, monkeypatch):
    from tools.serving.server import health

    asked: list[str] = []
    answers = iter([False, False, True])

    def healthy(base_url, *, client=None, timeout=3.0):
        asked.append(base_url)
        return next(answers)

    monkeypatch.setattr(health, "answers", healthy)
    run_dir = tmp_path / "run"
    (run_dir / "raw").mkdir(parents=True)
    params = SweepParams(input_lens=[10], concurrencies=[1], repeats=2, prompts_per_concurrency=2, min_prompts=2,
                         out=tmp_path)
    res = SweepResult(run_id="run", run_dir=str(run_dir), label="t", params={}, started="now")
    with BenchWorker() as worker:
        _run_cells(params, [(10, 1), (11, 1), (13, 1), (16, 1), (12, 1)], res, worker, base_url="http://127.0.0.1:9",
                   model="m", tokenizer="t", max_len=None, raw_dir=run_dir / "raw", run_dir=run_dir, progress=None,
                   total=10, t0=0.0)
    # 10 and 11 ran without a /health. 13 killed its worker: one /health for its reason (down), one before 16
    # (down: 16 fails without being sent), one before 12 (up again: 12 runs).
    assert [c.status for c in res.cells] == ["ok", "ok", "failed", "failed", "ok"]
    assert len(asked) == 3
    assert "no longer answers /health" in res.cells[2].reason
    assert "did not answer /health" in res.cells[3].reason
    sent = [x for f in stand_in_vllm.iterdir() for x in f.read_text().split()]
    assert "16" not in sent and sent.count("12") == 3
    assert json.loads((run_dir / "summary.json").read_text())["cells"][4]["status"] == "ok"


# A sweep stopped from outside: the CLI's main() running a command that holds a worker inside a hung cell.
_HOLDER = '''
import argparse, sys
from tools import cli
from tools.measure.sweep.params import CellSpec
from tools.measure.sweep.worker import BenchWorker

def hold(args):
    with BenchWorker() as worker:
        worker.run_cell(CellSpec.model_validate_json(sys.argv[1]), timeout_s=600)
    return 0

def parser(command=None):
    p = argparse.ArgumentParser()
    p.set_defaults(func=hold)
    return p

cli.build_parser = parser
raise SystemExit(cli.main([]))
'''


def _hold_a_hung_cell(stand_in_vllm, tmp_path):
    import subprocess
    import sys
    import time

    raw = tmp_path / "raw"
    raw.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, _spec(raw, 14, warmup=False).model_dump_json()],
                            cwd=str(Path(__file__).resolve().parents[3]))
    deadline = time.monotonic() + 60
    while not any(stand_in_vllm.iterdir()):  # the worker is inside the hung benchmark call
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    return proc, int(next(stand_in_vllm.iterdir()).name)


def _gone(pid: int, wait_s: float = 30) -> bool:
    try:
        psutil.Process(pid).wait(wait_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def test_sigterm_ends_the_worker_and_exits_143(stand_in_vllm, tmp_path):
    import signal

    proc, worker = _hold_a_hung_cell(stand_in_vllm, tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 143
        assert _gone(worker, 0)  # ended before the command returned, not left to finish its cell
    finally:
        for pid in (proc.pid, worker):
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_worker_ends_when_the_sweep_is_killed(stand_in_vllm, tmp_path):
    import signal

    proc, worker = _hold_a_hung_cell(stand_in_vllm, tmp_path)
    try:
        proc.kill()
        proc.wait(60)
        assert _gone(worker)  # not left running its cell for minutes with no sweep to answer
    finally:
        if psutil.pid_exists(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_cells_spec_keeps_its_seeds_and_is_recorded_with_each_repeat(stand_in_vllm, tmp_path):
    """The sweep's cells and the capacity search's points get their spec from one builder: the prompt seeds of
    earlier runs (so builds stay comparable and resumed sweeps measure the same prompts), the log beside the
    records, and the spec in raw/<stem>.spec.json and in each repeat's record with that repeat's seed."""
    from tools.measure.sweep.cells import Tally, load_done, measure_repeats, prompt_seed
    from tools.measure.sweep.params import CellResult

    run_dir = tmp_path / "run"
    raw = run_dir / "raw"
    raw.mkdir(parents=True)
    params = SweepParams(input_lens=[10], concurrencies=[1], repeats=2, prompts_per_concurrency=2, min_prompts=2,
                         out=tmp_path, seed=5)
    res = SweepResult(run_id="run", run_dir=str(run_dir), label="t", params={}, started="now")
    with BenchWorker() as worker:
        _run_cells(params, [(10, 1)], res, worker, base_url="http://127.0.0.1:9", model="m", tokenizer="t",
                   max_len=None, raw_dir=raw, run_dir=run_dir, progress=None, total=2, t0=0.0)
        rate_point = CellResult(input_len=10, output_len=4, concurrency=0, request_rate=2.5, num_prompts=2,
                                status="ok")
        measure_repeats(params, rate_point, [2, 3], worker, base_url="http://127.0.0.1:9", model="m",
                        tokenizer="t", raw_dir=raw, tally=Tally(2, None), goodput={"ttft": 100.0})
    spec = CellSpec.model_validate_json((raw / "L10-c1.spec.json").read_text())
    assert spec.seeds == {k: prompt_seed(5, 10, 1, k) for k in (0, 1)}
    assert (spec.warmup_seed, spec.warmup_prompts) == (prompt_seed(5, 10, 1, 0, "warmup"), 1)
    assert spec.log_file == str(raw / "L10-c1.log") and "benchmark output for 10" in Path(spec.log_file).read_text()
    for k in (0, 1):
        rec = json.loads((raw / raw_name(10, 1, k)).read_text())
        assert rec["spec"] == {**spec.model_dump(mode="json"), "seed": spec.seeds[k]}
        assert load_done(raw, 10, 1, k).seed == spec.seeds[k]  # what a resumed sweep reads
    point = CellSpec.model_validate_json((raw / "L10-q2.5.spec.json").read_text())
    assert point.seeds == {k: prompt_seed(5, 10, 2500, k, "rate") for k in (2, 3)}  # the rate in mreq/s
    assert point.warmup_seed == prompt_seed(5, 10, 2500, 2, "rate-warmup")  # one warm-up per round
    assert (point.request_rate, point.goodput, point.warmup_prompts) == (2.5, {"ttft": 100.0}, 2)
    assert [r.status for r in rate_point.repeats] == ["ok", "ok"]
