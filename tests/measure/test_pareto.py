"""The Pareto view from recorded sweep and capacity run folders: table, PNG, frontier."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.measure.capacity_fixtures import capacity_run
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
