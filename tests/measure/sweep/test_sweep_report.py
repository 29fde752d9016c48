"""Sweep tables, comparison and bookkeeping without a server: the article's own figures are the fixture."""

from __future__ import annotations

import os

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tools.core.errors import ToolFailure
from tools.measure.sweep.cells import prompt_seed
from tools.measure.sweep.params import RepeatResult, SweepParams, aggregate
from tools.measure.sweep.run import _run_dir
from tools.measure.sweep.report import compare_runs, cost_per_million, load_run, markdown_run

ROOT = Path(__file__).resolve().parents[3]
ARTICLE = ROOT / "evidence" / "article-t4"
RUNS = [ARTICLE / "bf16", ARTICLE / "qat-w4a16", ARTICLE / "emb4"]


def test_article_reference_runs_reproduce_the_article_tables():
    cmp = compare_runs(RUNS, price_per_hour=0.5241, cost_cell=(512, 8))
    md = cmp.markdown
    # The article's "512-Token Prompts" rows in the one ratio format: emb4 vs QAT +37% is 1.37x, emb4 vs bf16
    # 2.30x; only medians were published, so no interval and no verdict.
    for row in ("| 1 | 37.04 | 62.27 | 85.28 | 1.37x (no repeats) | 2.30x (no repeats) |",
                "| 4 | 109.05 | 157.49 | 183.08 | 1.16x (no repeats) | 1.68x (no repeats) |",
                "| 8 | 164.62 | 215.91 | 239.64 | 1.11x (no repeats) | 1.46x (no repeats) |",
                "| 16 | 164.36 | 213.79 | 237.08 | 1.11x (no repeats) | 1.44x (no repeats) |"):
        assert row in md, row
    # "4096-Token Prompts": emb4 vs QAT +7% / +3%.
    assert "| 1 | 12.11 | 14.00 | 15.03 | 1.07x (no repeats) |" in md
    assert "| 16 | 15.46 | 15.75 | 16.17 | 1.03x (no repeats) |" in md
    assert md.count("+37%") == 1 and "written as 1.37x (= +37%)" in md  # one format, said once in the header
    # "What Does It Cost?": $0.88, $0.67, $0.61 per million output tokens.
    assert [f"${r.usd_per_million:.2f}" for r in cmp.cost] == ["$0.88", "$0.67", "$0.61"]
    cell = next(c for c in cmp.cells if (c.input_len, c.concurrency) == (512, 1))
    assert cell.ratios["emb4 vs qat-w4a16"] == pytest.approx(85.28 / 62.27)
    assert cell.intervals["emb4 vs bf16"].verdict == "no repeats"


def test_default_cost_cell_is_where_the_candidate_peaks():
    cmp = compare_runs(RUNS)
    assert cmp.cost_cell == (512, 8)


def test_cost_per_million():
    assert cost_per_million(239.64, 0.5241) == pytest.approx(0.6075, abs=1e-4)
    assert cost_per_million(None, 0.5241) is None


def test_compare_needs_two_runs_and_real_run_folders(tmp_path):
    with pytest.raises(ToolFailure, match="two or more"):
        compare_runs(RUNS[:1])
    with pytest.raises(ToolFailure, match="no summary.json"):
        compare_runs([RUNS[0], tmp_path])
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(ToolFailure, match="not a sweep summary"):
        load_run(tmp_path)


def test_run_markdown_has_article_form_and_statuses():
    run = load_run(ARTICLE / "emb4")
    md = markdown_run(run)
    assert "## 512-token prompts" in md and "## 4096-token prompts" in md
    assert "| c | out tok/s |" in md
    assert "| 8 | 239.64 |" in md


def test_aggregate_median_and_spread():
    reps = [RepeatResult(repeat=i, seed=i, status="ok", num_prompts=4, metrics={"output_throughput": v})
            for i, v in enumerate([100.0, 110.0, 105.0])]
    reps.append(RepeatResult(repeat=3, seed=3, status="failed", num_prompts=4, metrics={"output_throughput": 1.0}))
    med, spread = aggregate(reps)
    assert med["output_throughput"] == 105.0
    assert spread["output_throughput"] == pytest.approx(10 / 105 * 100)
    assert med["mean_ttft_ms"] is None


def test_prompt_seeds_are_distinct_per_cell_and_stable():
    seeds = {prompt_seed(0, L, c, r) for L in (512, 4096) for c in (1, 4, 8, 16) for r in range(3)}
    assert len(seeds) == 24
    assert prompt_seed(0, 512, 1, 0) == prompt_seed(0, 512, 1, 0)
    assert prompt_seed(0, 512, 1, 0) != prompt_seed(0, 512, 1, 0, "warmup")
    assert prompt_seed(0, 512, 1, 0) != prompt_seed(1, 512, 1, 0)


def _folder(params: SweepParams, out: Path) -> Path:
    """The folder a sweep with `params` would write (created, as the sweep does, and let go again)."""
    with _run_dir(params, out) as held:
        return held.path


def test_resume_picks_the_latest_matching_run_folder(tmp_path):
    p = SweepParams(label="emb4", out=tmp_path)
    first = _folder(p, tmp_path)
    assert first.is_dir()
    assert _folder(SweepParams(label="emb4", out=tmp_path, resume=True), tmp_path) == first
    # Different measurement (another seed) or another label: a new folder.
    assert _folder(SweepParams(label="emb4", out=tmp_path, resume=True, seed=1), tmp_path) != first
    assert _folder(SweepParams(label="bf16", out=tmp_path, resume=True), tmp_path) != first
    # a new run (in the same second as `first` or later): a folder of its own, which resume finds as the latest
    second = _folder(p, tmp_path)
    assert second != first and second.name > first.name
    assert _folder(SweepParams(label="emb4", out=tmp_path, resume=True), tmp_path) == second


def test_a_sweep_folder_being_written_is_refused_to_a_second_sweep(tmp_path):
    p = SweepParams(label="emb4", out=tmp_path)
    with _run_dir(p, tmp_path) as held:
        with pytest.raises(ToolFailure, match="being written by another run"):
            _run_dir(SweepParams(label="emb4", out=tmp_path, resume=True), tmp_path)
        with pytest.raises(ToolFailure, match="being written by another run"):
            _run_dir(SweepParams(label="emb4", out=tmp_path, run_id=held.path.name), tmp_path)
    _folder(SweepParams(label="emb4", out=tmp_path, resume=True), tmp_path)  # released: it resumes


def test_resume_refuses_a_run_folder_holding_links(tmp_path):
    from tools.measure.sweep.run import _refuse_links

    out, outside = tmp_path / "ev", tmp_path / "outside"
    (outside / "raw").mkdir(parents=True)
    p = SweepParams(label="emb4", out=out, resume=True)
    out.mkdir()
    linked = _folder(SweepParams(label="emb4", out=out), out)
    linked.rmdir()
    linked.symlink_to(outside)  # the folder itself a link out
    with _run_dir(p, out) as first:
        with pytest.raises(ToolFailure, match="is a symbolic link, which a resumed sweep would read and write "
                                              "through"):
            _refuse_links(first.path, out)
    linked.unlink()
    linked.mkdir()
    (linked / "raw").symlink_to(outside / "raw")  # raw/ a link out
    with pytest.raises(ToolFailure, match=r"raw is a symbolic link"):
        _refuse_links(_folder(p, out), out)
    (linked / "raw").unlink()
    (linked / "raw").mkdir()
    (linked / "raw" / "in512-c1-r0.log").symlink_to(outside / "victim.log")  # a cell's log, appended to
    with pytest.raises(ToolFailure, match=r"in512-c1-r0.log is a symbolic link"):
        _refuse_links(_folder(p, out), out)
    (linked / "raw" / "in512-c1-r0.log").unlink()
    _refuse_links(_folder(p, out), out)  # a folder of its own files resumes


def test_bad_options_are_refused_in_one_line():
    with pytest.raises(ValidationError, match="concurrencies"):  # the model itself: CLI and MCP alike
        SweepParams(concurrencies=[0])
    with pytest.raises(ToolFailure, match="label"):
        SweepParams(label="a b").validate()


def test_cli_sweep_compare_prints_tables_and_json():
    out = subprocess.run([sys.executable, "-m", "tools.cli", "sweep-compare", *map(str, RUNS), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["labels"] == ["bf16", "qat-w4a16", "emb4"]
    assert len(d["cells"]) == 8
    bad = subprocess.run([sys.executable, "-m", "tools.cli", "sweep-compare", str(RUNS[0])],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "runs: List should have at least 2 items" in bad.stderr  # bad input: 2


def test_report_module_does_not_import_the_runner():
    """sweep_report reads results; it must not import sweep (which imports it): no import cycle."""
    code = "import sys, tools.measure.sweep.report; print('tools.measure.sweep.run' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_cli_flags_and_mcp_signature_come_from_the_parameter_model():
    """One definition: every SweepParams field is a `./vllm-t4 sweep` flag, and the MCP signature is the model's
    fields minus the machine-local ones."""
    import argparse

    from tools.measure.sweep.params import SweepParams

    parser = argparse.ArgumentParser()
    SweepParams.add_cli_args(parser)
    dests = {a.dest for a in parser._actions} - {"help"}
    assert dests == set(SweepParams.model_fields)
    args = parser.parse_args(["--concurrency", "1,2", "--no-warmup", "--label", "x"])
    p = SweepParams.from_cli_args(args)
    assert p.concurrencies == [1, 2] and p.warmup is False and p.label == "x"
    mcp = {prm.name for prm in SweepParams.mcp_signature()}
    assert mcp == set(SweepParams.model_fields) - SweepParams.MCP_EXCLUDE
    bad = subprocess.run([str(ROOT / "vllm-t4"), "start", "--port", "70000"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "--port" in bad.stderr and "Traceback" not in bad.stderr


def test_a_stopped_sweep_is_not_compared_as_a_finished_one(tmp_path):
    """A sweep killed mid-run leaves its folder in place (for --resume) with the tables of the cells it finished;
    without its finish time it must not pass for a complete run."""
    run = json.loads((ARTICLE / "emb4" / "summary.json").read_text())
    run["finished"] = None
    (tmp_path / "summary.json").write_text(json.dumps(run))
    with pytest.raises(ToolFailure, match=r"stopped before it finished.*sweep \(resume=True, label=") as exc:
        compare_runs([RUNS[0], tmp_path])
    assert exc.value.detail["finished"] is None


@pytest.mark.parametrize("folder", ["out.md", "out.json"])
def test_comparison_output_that_is_a_folder_is_refused_before_anything_is_written(tmp_path, folder):
    from tools.measure.sweep.report import write_comparison

    cmp = compare_runs(RUNS)
    (tmp_path / folder).mkdir()
    with pytest.raises(ToolFailure, match=f"{folder} is a folder") as exc:
        write_comparison(cmp, tmp_path / "out.md", force=True)
    assert "\n" not in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder]  # no .md without its .json, no temp file
    assert not any((tmp_path / folder).iterdir())


@pytest.mark.parametrize("failing", [".json", ".md"])
def test_comparison_is_written_whole_or_not_at_all(tmp_path, monkeypatch, failing):
    from tools.measure.sweep import report as sweep_report

    cmp = compare_runs(RUNS)
    sweep_report.write_comparison(cmp, tmp_path / "out.md")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real = os.replace

    def fail_on_json(src, target):  # one file's publication fails (a full disk, a signal)
        if str(target).endswith(failing):
            raise OSError(28, "No space left on device")
        return real(src, target)

    monkeypatch.setattr(os, "replace", fail_on_json)
    with pytest.raises(ToolFailure, match="no space left"):  # one line, naming the file
        sweep_report.write_comparison(compare_runs(RUNS, price_per_hour=9.0), tmp_path / "out.md", force=True)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the old pair, untouched, no temps
