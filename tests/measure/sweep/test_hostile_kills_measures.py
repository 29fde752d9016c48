"""The kill matrix for the commands whose cells run in the benchmark worker: `./vllm-t4 sweep` and
`./vllm-t4 capacity`, each signalled with SIGINT, SIGTERM or SIGKILL while its first benchmark call runs and
between two records. vLLM's `bench serve` is the stand-in package of tests/helpers/stand_ins/bench.py on the worker's
PYTHONPATH (each call takes STAND_IN_BENCH_SLEEP_S, and names its worker), and a stand-in HTTP server answers what the
command asks the server itself (/v1/models, /metrics, /version, /health).

The two commands' contracts differ and so do the assertions. Every case: the worker ends with the command (a
SIGKILL too: its parent watch), SIGINT and SIGTERM exit 130 / 143 with one last line and no traceback. A sweep's
folder is resumable by design: what it holds after the kill is whole records only (a SIGKILL may leave a
temporary, which the next write sweeps), and `--resume` then measures exactly the repeats not yet recorded. A
capacity search's folder appears only when complete: SIGINT and SIGTERM leave nothing in --out, SIGKILL leaves its
`.partial` folder, which the next write there sweeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.stand_ins import bench as stand_in_bench
from tests.helpers.fixtures import ROOT
from tests.helpers.kill_matrix import SIGNALS, all_gone, assert_ended, assert_swept_by_the_next_write, cli, signal_when

PHASES = ["in-first-call", "between-records"]
SLOW_S = "0.4"  # each benchmark call


@pytest.fixture
def bench(tmp_path):
    return stand_in_bench.child_env(tmp_path, ROOT, SLOW_S)


def _calls(pids: Path) -> dict[int, int]:
    """Benchmark calls so far, by worker pid."""
    return {int(f.name): len(f.read_text().split()) for f in pids.iterdir()}


def _records(folder: Path) -> list[Path]:
    """The repeats recorded (raw/L<len>-<load>-r<k>.json; raw/ holds each cell's spec too)."""
    return sorted(folder.rglob("raw/L*-r[0-9]*.json")) if folder.is_dir() else []


def _kill_at(argv: list[str], env: dict, pids: Path, out: Path, phase: str, sig: str) -> tuple[int, str, list[int]]:
    """Runs the command until `phase`, sends `sig`; returns (exit status, stderr, the worker pids seen)."""
    def settle() -> None:
        assert phase != "in-first-call" or not _records(out)

    proc = cli(argv, env)
    err = signal_when(proc, lambda: bool(_calls(pids) if phase == "in-first-call" else _records(out)), sig, phase,
                      settle=settle)
    return proc.returncode, err, list(_calls(pids))


def _ended_as_told(sig: str, rc: int, err: str, workers: list[int]) -> None:
    assert_ended(sig, rc, err)
    assert workers and all_gone(workers)


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_sweep_keeps_whole_records_and_resume_measures_only_the_rest(sig, phase, measure_stand_in, bench,
                                                                             tmp_path):
    env, pids = bench
    out = tmp_path / "ev"
    argv = ["sweep", "--base-url", measure_stand_in, "--out", str(out), "--input-lens", "10,11", "--concurrency", "1",
            "--repeats", "2", "--output-len", "4", "--no-warmup", "--label", "k", "--cell-timeout", "60"]
    rc, err, workers = _kill_at(argv, env, pids, out, phase, sig)
    _ended_as_told(sig, rc, err, workers)
    (run,) = out.iterdir()
    kept = _records(run)
    for rec in kept:  # whole records only: each one parses
        assert json.loads(rec.read_text())["repeat_result"]["status"] == "ok"
    leftovers = [p.name for p in run.rglob("*") if ".tmp" in p.name]
    assert not leftovers or sig == "SIGKILL", leftovers
    before = _calls(pids)

    done = subprocess.run([sys.executable, "-m", "tools.cli", *argv, "--resume", "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["run_id"] == run.name
    resumed = {p: n for p, n in _calls(pids).items() if p not in before}
    assert sum(resumed.values()) == 4 - len(kept)  # the repeats recorded before the kill are not measured again
    assert len(_records(run)) == 4
    assert not [p.name for p in run.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_capacity_search_leaves_nothing_the_next_write_keeps(sig, phase, measure_stand_in, bench,
                                                                      tmp_path):
    env, pids = bench
    out = tmp_path / "ev"
    out.mkdir()
    argv = ["capacity", "--base-url", measure_stand_in, "--out", str(out), "--input-len", "10", "--output-len", "4",
            "--slo", "ttft_p99_ms=1000", "--start", "1", "--max", "64", "--repeats", "2", "--no-warmup",
            "--label", "k", "--cell-timeout", "60"]
    rc, err, workers = _kill_at(argv, env, pids, out, phase, sig)
    _ended_as_told(sig, rc, err, workers)
    if sig != "SIGKILL":
        assert os.listdir(out) == []
    else:
        assert_swept_by_the_next_write(out)
