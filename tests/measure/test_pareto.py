"""The Pareto view from recorded sweep and capacity run folders: table, PNG, frontier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.capacity import capacity_run
from tools.core.errors import ToolFailure
from tools.measure.pareto import pareto, write_pareto

ROOT = Path(__file__).resolve().parents[2]
ARTICLE = ROOT / "evidence" / "article-t4"


def test_pareto_of_a_sweep_and_a_capacity_run(tmp_path):
    cap = capacity_run(tmp_path, "emb4", ttft_per_user=90)
    res = pareto([ARTICLE / "bf16", cap])
    bf16 = {(p.input_len, p.load): p for p in res.points if p.label == "bf16"}
    # The article's 512-token bf16 row: 37.04 tok/s at c=1, 164.62 at c=8 (20.58 per user).
    assert bf16[(512, "c=1")].tok_s_per_user == pytest.approx(37.04)
    assert bf16[(512, "c=8")].tok_s_per_user == pytest.approx(164.62 / 8)
    assert bf16[(512, "c=8")].tok_s_per_gpu == pytest.approx(164.62)
    # c=16 gives less per GPU than c=8 (164.36) and less per user: dominated, off the frontier.
    assert bf16[(512, "c=8")].frontier and not bf16[(512, "c=16")].frontier
    emb4 = [p for p in res.points if p.label == "emb4"]
    assert all(p.low < p.tok_s_per_gpu < p.high for p in emb4)  # two repeats: an interval
    assert "| bf16 | 512 | c=8 | 8 | 20.58 | 164.62 | yes |" in res.markdown
    assert "95% confidence interval" in res.markdown


def test_pareto_writes_png_markdown_and_json_into_a_new_evidence_folder(tmp_path):
    res = write_pareto(pareto([ARTICLE / "bf16", ARTICLE / "emb4"]), tmp_path)
    d = Path(res.run_dir)
    assert d.parent == tmp_path and d.name.startswith("pareto-")
    assert (d / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (d / "pareto.md").read_text().startswith("# Pareto")
    assert json.loads((d / "pareto.json").read_text())["labels"] == ["bf16", "emb4"]
    assert [p.name for p in tmp_path.iterdir()] == [d.name]  # nothing half written beside it


def test_the_command_and_its_refusals(tmp_path, capsys):
    from tools.cli import main

    assert main(["pareto", str(ARTICLE / "emb4"), "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(str(tmp_path / "pareto-"))
    with pytest.raises(ToolFailure, match="no summary.json"):
        pareto([tmp_path / "nothing"])


def _nan_run(tmp_path: Path, bad: dict[int, str]) -> Path:
    """The article's emb4 sweep with cell i's output tok/s replaced by raw JSON text (NaN, Infinity)."""
    d = tmp_path / "emb4-damaged"
    d.mkdir()
    data = json.loads((ARTICLE / "emb4" / "summary.json").read_text())
    for i in bad:
        data["cells"][i]["median"]["output_throughput"] = f"@{i}@"
    text = json.dumps(data)
    for i, v in bad.items():
        text = text.replace(f'"@{i}@"', v)
    (d / "summary.json").write_text(text)
    return d


def test_cells_with_nan_or_infinite_metrics_are_left_out_and_counted(tmp_path):
    d = _nan_run(tmp_path, {0: "NaN", 1: "Infinity"})
    whole = pareto([ARTICLE / "emb4"])
    res = pareto([d])
    assert res.dropped == 2 and len(res.points) == len(whole.points) - 2
    rows = [line for line in res.markdown.splitlines() if line.startswith("| emb4")]
    assert len(rows) == len(res.points) and not any("nan" in r or "inf" in r for r in rows)
    assert "Left out: 2 cells" in res.markdown and "2 cells left out" in res.summary()
    assert whole.dropped == 0 and "Left out" not in whole.markdown


def test_too_many_runs_are_refused_before_anything_is_read_or_made(tmp_path, capsys):
    from tools.cli import main
    from tools.measure.pareto import MAX_RUNS

    out = tmp_path / "new" / "out"
    runs = [str(tmp_path / f"absent{i}") for i in range(MAX_RUNS + 1)]  # absent: reading one would fail first
    assert main(["pareto", *runs, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"at most {MAX_RUNS} run folders ({MAX_RUNS + 1} given)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()


def test_a_failed_write_leaves_no_empty_out_folder(tmp_path, monkeypatch):
    from tools.measure import pareto as pareto_mod

    def broken(res, path):
        raise OSError("disk full")

    monkeypatch.setattr(pareto_mod, "plot", broken)
    res = pareto([ARTICLE / "emb4"])
    with pytest.raises(OSError, match="disk full"):
        write_pareto(res, tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    (kept / "other").mkdir(parents=True)
    with pytest.raises(OSError):
        write_pareto(res, kept)
    assert [p.name for p in kept.iterdir()] == ["other"]  # a folder that was there stays, as it was


def test_a_capacity_run_with_a_truncated_summary_names_the_capacity_command(tmp_path, capsys):
    from tools.cli import main

    cap = capacity_run(tmp_path, "emb4", ttft_per_user=90)
    f = cap / "summary.json"
    f.write_text(f.read_text()[:200])
    assert main(["pareto", str(cap), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert str(f) in err and "capacity run" in err and "./vllm-t4 capacity" in err and "sweep`" not in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
