"""Noise-aware comparisons: intervals from the repeats and a verdict, on recorded runs.

tests/measure/data/noise holds the CPU demo's int4-emb sweep (evidence/mcp-demo-cpu/sweeps/int4-emb) twice,
each with three repeats per cell: rerun-a with a modest spread, rerun-b (the same build measured again, under
load) with a wide one. See that folder's README.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tools.measure.decode.sweep import compare_decode_runs
from tools.measure.sweep.report import compare_runs, load_run, markdown_run
from tools.measure.uncertainty import estimate, paired_ratio, ratio, t_quantile

DATA = Path(__file__).resolve().parent / "data" / "noise"
RERUN_A, RERUN_B = DATA / "rerun-a", DATA / "rerun-b"


def _doubled(src: Path, dst: Path) -> Path:
    d = json.loads((src / "summary.json").read_text())
    d["run_id"] += "-doubled"
    for cell in d["cells"]:
        for r in cell["repeats"]:
            r["metrics"]["output_throughput"] *= 2
        cell["median"]["output_throughput"] *= 2
    dst.mkdir()
    (dst / "summary.json").write_text(json.dumps(d))
    return dst


def test_two_runs_of_one_build_are_within_noise():
    # Medians alone say 2.17x at c=4 (606.99 / 280.00): the repeats say the two runs cannot be told apart.
    for runs in ((RERUN_B, RERUN_A), (RERUN_A, RERUN_B)):
        cmp = compare_runs(runs)
        for cell in cmp.cells:
            (r,) = cell.intervals.values()
            assert r.verdict == "within noise" and r.low < 1 < r.high, (cell.concurrency, r)
    c4 = next(c for c in compare_runs([RERUN_B, RERUN_A]).cells if c.concurrency == 4)
    assert c4.ratios == {k: v.value for k, v in c4.intervals.items()}
    assert "| 4 | 316.10 (131.82–757.98) | 597.26 (473.17–753.89) | 1.89x (0.84–4.23) within noise |" \
        in compare_runs([RERUN_B, RERUN_A]).markdown


def test_doubled_throughput_is_faster(tmp_path):
    doubled = _doubled(RERUN_A, tmp_path / "doubled")
    cmp = compare_runs([RERUN_A, doubled])
    for cell in cmp.cells:
        (r,) = cell.intervals.values()
        assert r.value == pytest.approx(2.0) and r.verdict == "faster" and 1 < r.low < 2 < r.high
        assert r.cell().startswith("2.00x (") and r.cell().endswith(") faster")
    back = compare_runs([doubled, RERUN_A])
    assert all(v.verdict == "slower" and v.text() == "0.50x" for c in back.cells for v in c.intervals.values())
    assert "2.00x (" in cmp.markdown and "faster" in cmp.markdown


def test_run_table_prints_each_cells_interval():
    md = markdown_run(load_run(RERUN_A))
    assert "| 1 | 91.34 (74.47–112.03) |" in md and "95% confidence interval" in md
    ci = load_run(RERUN_A).cells[0].output_throughput_ci
    assert (ci.n, round(ci.low, 2), round(ci.high, 2)) == (3, 74.47, 112.03)
    assert "output_throughput_ci" in load_run(RERUN_A).to_dict()["cells"][0]


def test_one_method_small_samples():
    assert t_quantile(1) == pytest.approx(12.7062, abs=1e-3)
    assert t_quantile(2) == pytest.approx(4.3027, abs=1e-3)
    assert t_quantile(4) == pytest.approx(2.7764, abs=1e-3)
    assert t_quantile(30) == pytest.approx(2.0423, abs=1e-3)
    one = estimate([100.0])
    assert one.mean == 100.0 and one.low is None and ratio(one, estimate([50.0, 51.0])).verdict == "no repeats"
    assert estimate([], recorded=85.28).mean == 85.28
    e = estimate([100.0, 110.0, 105.0])
    assert e.mean == pytest.approx(math.prod([100.0, 110.0, 105.0]) ** (1 / 3))
    same = ratio(estimate([5.0, 5.0]), estimate([2.5, 2.5]))
    assert same.value == pytest.approx(2.0) and same.verdict == "faster"
    assert paired_ratio([(10.0, 8.0), (10.0, 8.0), (10.0, 8.0)]).verdict == "faster"
    assert paired_ratio([(10.0, 8.0)], recorded=1.25).cell() == "1.25x (no repeats)"


DECODE_CPU = Path(__file__).resolve().parents[2] / "evidence" / "decode-sweep-cpu-tiny" / "runs"
ARTICLE_DECODE = Path(__file__).resolve().parents[2] / "evidence" / "article-t4" / "decode"


def _decode_run(label: str) -> Path:
    (path,) = DECODE_CPU.glob(f"*-{label}")
    return path


def test_drafter_speedup_carries_its_interval():
    # The tiny CPU model's k3 run against no drafter: the medians say 0.23x; per prompt the runs are within noise.
    cmp = compare_decode_runs([_decode_run("k0-greedy"), _decode_run("k3-greedy")])
    row = cmp.rows[1]
    assert row.speedup_interval.verdict == "within noise" and row.speedup == row.speedup_interval.value
    assert f"| {row.speedup_interval.cell()} |" in cmp.markdown and "within noise" in cmp.markdown


def test_drafter_that_halves_time_per_token_is_faster(tmp_path):
    src = _decode_run("k0-greedy")
    d = json.loads((src / "summary.json").read_text())
    d["speculative_config"] = {"model": "/m/d", "num_speculative_tokens": 3}
    for p in d["prompts"]:
        p["tpot_ms"] = p["tpot_ms"] / 2 if p["tpot_ms"] else p["tpot_ms"]
    d["median_tpot_ms"] /= 2
    (tmp_path / "halved").mkdir()
    (tmp_path / "halved" / "summary.json").write_text(json.dumps(d))
    row = compare_decode_runs([src, tmp_path / "halved"]).rows[1]
    assert row.speedup == pytest.approx(2.0) and row.speedup_interval.verdict == "faster"
    assert row.speedup_interval.cell().startswith("2.00x (")


def test_article_drafter_speedups_keep_their_published_figures():
    cmp = compare_decode_runs([ARTICLE_DECODE / n for n in ("k0-greedy", "k3-greedy", "k0-checkpoint",
                                                            "k3-checkpoint")])
    assert "| 3 draft tokens, greedy | 7.4 ms | 38% | 2.13 | 1.34x (no repeats) |" in cmp.markdown
    assert "| 3 draft tokens, default sampling | 8.7 ms | 37% | — | 1.13x (no repeats) |" in cmp.markdown


def test_comparison_summary_line_uses_the_one_format():
    cmp = compare_runs([RERUN_B, RERUN_A])
    assert cmp.summary() == ("compared int4-emb (int4-emb-rerun-b), int4-emb (int4-emb-rerun-a) over 2 cells (verdicts: 2 within noise); "
                             "first cell int4-emb (int4-emb-rerun-a) vs int4-emb (int4-emb-rerun-b): "
                             "1.21x (0.62–2.38) within noise")
