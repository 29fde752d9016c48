"""Answers an assistant can repeat to its user without checking them: one statistic per figure across a result,
its summary and its files; every figure names where it was measured; no comparison across machines, models or
vLLM versions unsaid."""

from __future__ import annotations

import re

from tests.fixtures import fake_sweep_run

CPU = {"gpu_count": 0, "cpu_model": "Intel Xeon (test)", "vllm_version_server": "0.32.0",
       "server": {"model_root": "/m/tiny-e2b-emb4"}}


def test_run_sweep_gives_each_figure_in_the_statistic_its_table_gives(tmp_path):
    """run_sweep's summary said a median (50.34 out tok/s) where summary.md gave the geometric mean (48.32) of the
    same cell: the summary, the result's cells and the table now give the one figure, named as such."""
    from tools.mcp.measure_tools import sweep_reply

    # repeats whose median (50) is not their geometric mean (about 42.7)
    res = fake_sweep_run(tmp_path / "run", "a", {(512, 1): [12.0, 12.5, 11.5], (512, 4): [50.0, 30.0, 52.0]},
                         provenance=CPU)
    reply = sweep_reply(res)
    cell = res.cell(512, 4)
    geo = cell.output_throughput_ci.mean
    assert abs(geo - cell.median["output_throughput"]) > 5
    assert f"best {geo:.2f} out tok/s (geometric mean of 3 repeats) at in=512 c=4" in reply.summary
    table = (tmp_path / "run" / "summary.md").read_text()
    assert re.search(rf"\| 4 \| {geo:,.2f} \(", table), table
    rows = {c["concurrency"]: c for c in reply.result["cells"]}
    assert rows[4]["geometric_mean"]["output_throughput"] == round(geo, 3)
    assert "output_throughput" not in rows[4]["median"] and rows[4]["median"]["completed"] == 4
    assert "Intel Xeon (test)" in reply.summary  # where it was measured
