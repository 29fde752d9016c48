"""Two of each run-writing command at once: `./vllm-t4 sweep`, `capacity`, `pareto`, `decode` (each writes a run
folder named by the second it started in) and `compare record`, `fidelity record` (each writes one file). Every
pair runs against the stand-in servers of the kill matrices, under a clock fixed to one second, so that the two
runs always ask for the same folder name. A run folder is never shared: both runs exit 0 and print two folders,
each whole (its summary, its own records), with nothing else left in --out. A file written by two records at
once has one winner: the other exits 2 in one line and overwrites nothing.

Below them, the reservation itself (tools.core.atomic_files): a name that is taken gets a suffix, a held folder
cannot be held twice, and a run whose name was taken by something else is published where its message says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.stand_ins import bench as stand_in_bench
from tests.helpers.fixtures import ROOT
from tests.helpers.stand_ins.measure import DecodeStandIn, serve_in_thread, writer_stand_in
from tools.core.atomic_files import HeldFolder, TempFolder, names_held, reserve_name
from tools.core.errors import ToolFailure

# `./vllm-t4 ARGV` with every run-naming clock at one second: the two runs of a pair collide on the name for sure
FIXED_CLOCK = """
import datetime as d, sys
class Fixed(d.datetime):
    @classmethod
    def now(cls, tz=None):
        return d.datetime(2026, 1, 1, 12, 0, 0, tzinfo=tz)
from tools.core import clock  # every run folder's time (evidence.run_id)
clock.datetime = Fixed
from tools.cli import main
sys.exit(main(sys.argv[1:]))
"""
ARTICLE = ROOT / "evidence" / "article-t4"


def _pair(argv: list[str], env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """Two runs of `argv` started together; (exit status, stdout, stderr) of each."""
    env = env or dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", FIXED_CLOCK, *argv], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        results = []
        for p in procs:
            o, e = p.communicate(timeout=180)
            results.append((p.returncode, o, e))
        return results
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _two_whole_runs(results: list[tuple[int, str, str]], out: Path, summary: str) -> list[Path]:
    """Both exited 0 and printed a folder of their own, each holding its summary; nothing else in `out`."""
    for rc, _, err in results:
        assert rc == 0, err
    folders = [Path(o.strip().splitlines()[-1]) for _, o, _ in results]
    assert folders[0] != folders[1], folders
    for f in folders:
        assert f.parent == out and (f / summary).is_file(), f
        json.loads((f / summary).read_text())
    assert sorted(os.listdir(out)) == sorted(f.name for f in folders)
    return folders


@pytest.fixture
def bench_env(tmp_path):
    return stand_in_bench.child_env(tmp_path, ROOT, "0.2")[0]


def test_two_sweeps_at_once_write_two_whole_runs(measure_stand_in, bench_env, tmp_path):
    out = tmp_path / "ev"
    argv = ["sweep", "--base-url", measure_stand_in, "--out", str(out), "--input-lens", "10,11", "--concurrency", "1",
            "--repeats", "2", "--output-len", "4", "--no-warmup", "--label", "k", "--cell-timeout", "60"]
    a, b = _two_whole_runs(_pair(argv, bench_env), out, "summary.json")
    for run in (a, b):
        recs = sorted(run.glob("raw/L*-r[0-9]*.json"))
        assert len(recs) == 4 and all(json.loads(r.read_text())["repeat_result"]["status"] == "ok" for r in recs)
        assert json.loads((run / "summary.json").read_text())["run_id"] == run.name
    assert sorted(p.name for p in (a, b))[1] == sorted(p.name for p in (a, b))[0] + "-2"


def test_two_capacity_searches_at_once_write_two_whole_runs(measure_stand_in, bench_env, tmp_path):
    out = tmp_path / "ev"
    argv = ["capacity", "--base-url", measure_stand_in, "--out", str(out), "--input-len", "10", "--output-len", "4",
            "--slo", "ttft_p99_ms=1000", "--start", "1", "--max", "2", "--repeats", "1", "--no-warmup",
            "--label", "k", "--cell-timeout", "60"]
    for run in _two_whole_runs(_pair(argv, bench_env), out, "capacity.json"):
        assert json.loads((run / "capacity.json").read_text())["run_dir"] == str(run)


def test_two_pareto_views_at_once_write_two_whole_runs(tmp_path):
    out = tmp_path / "ev"
    argv = ["pareto", str(ARTICLE / "bf16"), str(ARTICLE / "emb4"), "--out", str(out)]
    for run in _two_whole_runs(_pair(argv), out, "pareto.json"):
        assert json.loads((run / "pareto.json").read_text())["labels"] == ["bf16", "emb4"]


def test_two_decodes_at_once_write_two_whole_runs(tmp_path):
    out = tmp_path / "ev"
    with serve_in_thread(DecodeStandIn) as url:
        results = _pair(["decode", "--base-url", url, "--out", str(out), "--prompts", "2", "--max-tokens", "3"])
    for run in _two_whole_runs(results, out, "summary.json"):
        assert json.loads((run / "summary.json").read_text())["run_id"] == run.name
        assert len(list((run / "raw").glob("*.json"))) >= 2


@pytest.fixture
def writer_server():
    with serve_in_thread(writer_stand_in(Counter())) as url:
        yield url


def _one_winner(results: list[tuple[int, str, str]], out: Path, name: str) -> None:
    """One record exited 0; the other exited 2 with one line naming the file and the switch that replaces it; the
    file is whole and nothing else is left beside it."""
    assert sorted(rc for rc, _, _ in results) == [0, 2], [r[2] for r in results]
    (err,) = [e for rc, _, e in results if rc == 2]
    assert "Traceback" not in err and str(out / name) in err.strip().splitlines()[-1] and "--force" in err, err
    assert os.listdir(out) == [name]


def test_two_compare_records_of_one_file_at_once_have_one_winner(writer_server, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    out = tmp_path / "ev"
    out.mkdir()
    results = _pair(["compare", "record", "--base-url", writer_server, "--out", str(out / "tokens.json"),
                     "--prompts", str(prompts), "--max-tokens", "2", "--top-logprobs", "2"])
    _one_winner(results, out, "tokens.json")
    assert len(json.loads((out / "tokens.json").read_text())["generations"]) == 2


def test_two_fidelity_records_of_one_file_at_once_have_one_winner(writer_server, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 3)
    out = tmp_path / "ev"
    out.mkdir()
    results = _pair(["fidelity", "record", "--base-url", writer_server, "--out", str(out / "REF.json"),
                     "--corpus", str(corpus), "--window", "16", "--max-corpus-tokens", "32", "--top-k", "2"])
    _one_winner(results, out, "REF.json")
    assert json.loads((out / "REF.json").read_text())["footer"]["complete"] is True


# -- the reservation ---------------------------------------------------------------------------------------------

def test_a_taken_name_gets_a_suffix_and_a_live_runs_temporary_counts_as_taken(tmp_path):
    (tmp_path / "run").mkdir()  # a finished run of that name
    first = TempFolder.open(tmp_path, "run")
    second = TempFolder.open(tmp_path, "run")  # the first is still measuring: its name is not free either
    assert (first.final.name, second.final.name) == ("run-2", "run-3")
    with names_held(tmp_path):
        assert reserve_name(tmp_path, "run") == "run-4"
    assert second.publish() == tmp_path / "run-3"
    first.discard()
    assert sorted(os.listdir(tmp_path)) == ["run", "run-3"]


def test_a_name_taken_after_it_was_reserved_publishes_where_the_message_says(tmp_path):
    run = TempFolder.open(tmp_path, "run")
    (run.path / "summary.json").write_text("{}")
    (tmp_path / "run").mkdir()  # forced: something that reserves no names made the folder meanwhile
    with pytest.raises(ToolFailure) as e:
        run.publish()
    kept = Path(e.value.detail["kept"])
    assert str(kept) in str(e.value) and kept == tmp_path / "run-2" and (kept / "summary.json").is_file()
    run.discard()  # what a caller does on the failure: the kept run stays
    assert sorted(os.listdir(tmp_path)) == ["run", "run-2"] and os.listdir(tmp_path / "run") == []


def test_a_held_run_folder_is_refused_to_a_second_run_until_released(tmp_path):
    a = HeldFolder.reserve(tmp_path, "run")
    b = HeldFolder.reserve(tmp_path, "run")
    assert (a.path.name, b.path.name) == ("run", "run-2")
    with pytest.raises(ToolFailure, match="being written by another run"):
        HeldFolder.hold(a.path)
    with pytest.raises(ToolFailure, match="being written by another run"):
        HeldFolder.reserve(tmp_path, "run", exact=True)
    a.release()
    with HeldFolder.hold(a.path):
        pass
    b.release()
