"""capacity-compare and compare_sweeps on recorded capacity run folders (tests/measure/capacity_fixtures.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.helpers.capacity import capacity_run
from tools.core.errors import ToolFailure
from tools.measure.capacity.report import compare_capacity, load_capacity
from tools.measure.sweep.report import load_run



def test_a_capacity_run_folder_is_a_sweep_folder_with_its_answer(tmp_path):
    d = capacity_run(tmp_path, "emb4", ttft_per_user=90)  # 1000 / 90: 11 users
    res = load_capacity(d)
    assert res.status == "found" and (res.capacity, res.last_pass, res.first_fail) == (11, 11, 12)
    assert res.goodput.mean and res.out_tok_s.mean and res.usd_per_million == pytest.approx(
        0.5241 / (res.out_tok_s.mean * 3600) * 1e6)
    assert res.statement.startswith("capacity: 11 concurrent users within ttft_p99_ms=1000 (bracket: 11 passes, "
                                    "12 fails); there: goodput ")
    assert "points measured" in res.statement
    md = (d / "capacity.md").read_text()
    # 11 users give 990 ms against 1000: within noise after a second round, decided by the mean.
    assert "| 11 | pass (within noise) | 2 | 4 |" in md and "| 12 | fail |" in md and "95% interval" in md
    assert [c.concurrency for c in load_run(d).cells] == [1, 2, 4, 8, 10, 11, 12, 16]  # the sweep view, by load




def test_statements_for_none_lower_bound_and_max_num_seqs(tmp_path):
    none = load_capacity(capacity_run(tmp_path / "a", "strict", ttft_per_user=2000))
    assert none.status == "none" and none.statement.startswith("capacity: none: even 1 fails ttft_p99_ms=1000 "
                                                               "(ttft_p99_ms 1,999.9")
    low = load_capacity(capacity_run(tmp_path / "b", "loose", ttft_per_user=1, max_load=8))
    assert low.status == "lower_bound" and "at least 8 concurrent users" in low.statement
    assert "a lower bound" in low.statement
    capped = load_capacity(capacity_run(tmp_path / "c", "capped", ttft_per_user=1, max_num_seqs=4))
    assert capped.status == "bounded_by_max_num_seqs"
    # A bound, said as the headline, with the way past it: the start's argument and the search's ceiling.
    assert capped.statement.startswith("capacity: at least 4 concurrent users within ttft_p99_ms=1000, a bound set "
                                       "by the engine's max_num_seqs 4, not by the SLO")
    assert "restart the server with max_num_seqs 8" in capped.statement and "max_load 8" in capped.statement


CPU_PROV = {"gpu_count": 0, "cpu_model": "Intel Xeon", "server": {"model_root": "/m/tiny-emb4", "model_id": "m"}}
GPU_PROV = {"gpu_count": 1, "gpu_name": "Tesla T4", "server": {"model_root": "/m/emb4", "model_id": "m"}}


def test_capacity_says_where_it_was_measured_and_how_the_cost_was_priced(tmp_path):
    cpu = load_capacity(capacity_run(tmp_path / "a", "cpu", ttft_per_user=90, prov=CPU_PROV))
    assert cpu.platform == "cpu" and cpu.measured_on == "CPU stand-in (vLLM CPU backend, Intel Xeon), build tiny-emb4"
    assert "measured on CPU stand-in (vLLM CPU backend, Intel Xeon), build tiny-emb4)" in cpu.statement
    assert ("per million output tokens at the T4 VM's $0.5241/h applied to this CPU's throughput, not a T4 cost"
            in cpu.statement)
    priced = load_capacity(capacity_run(tmp_path / "b", "cpu", ttft_per_user=90, prov=CPU_PROV,
                                        price_per_hour=0.12))
    assert priced.cost_basis == "$0.12/h" and "per million output tokens at $0.12/h" in priced.statement
    gpu = load_capacity(capacity_run(tmp_path / "c", "t4", ttft_per_user=90, prov=GPU_PROV))
    assert gpu.platform == "cuda" and "measured on Tesla T4, build emb4)" in gpu.statement
    assert "at $0.5241/h" in gpu.statement


def test_capacity_compare_gives_a_verdict_only_where_brackets_do_not_overlap(tmp_path):
    bf16 = capacity_run(tmp_path, "bf16", ttft_per_user=180)   # 5 users
    emb4 = capacity_run(tmp_path, "emb4", ttft_per_user=90)    # 11 users
    same = capacity_run(tmp_path, "emb4b", ttft_per_user=95)   # 10 users: [10, 11) touches [11, 12)
    cmp = compare_capacity([bf16, same, emb4])
    assert cmp.verdicts == [
        "the emb4 build serves 11 users within the SLO against 10 for emb4b: more (the brackets do not overlap)",
        "the emb4 build serves 11 users within the SLO against 5 for bf16: more (the brackets do not overlap)"]
    assert "| bf16 | 5 | [5, 6) | found |" in cmp.markdown
    low = capacity_run(tmp_path / "x", "loose", ttft_per_user=1, max_load=8)  # [8, open) overlaps [11, 12)
    assert compare_capacity([emb4, low]).verdicts[0].endswith("no verdict (the brackets overlap)")
    other_slo = capacity_run(tmp_path / "y", "other", ttft_per_user=90, slo="ttft_p99_ms=500")
    with pytest.raises(ToolFailure, match="different questions"):
        compare_capacity([emb4, other_slo])
    with pytest.raises(ToolFailure, match="no capacity.json"):
        compare_capacity([emb4, tmp_path])


def test_the_command_prints_the_comparison_and_json(tmp_path, capsys):
    from tools.cli import main

    a = capacity_run(tmp_path, "bf16", ttft_per_user=180)
    b = capacity_run(tmp_path, "emb4", ttft_per_user=90)
    assert main(["capacity-compare", str(a), str(b), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["capacity"] for r in got["rows"]] == [5, 11] and "more" in got["verdicts"][0]
    assert main(["capacity-compare", str(a)]) == 2
    err = capsys.readouterr().err
    assert "two or more capacity run folders" in err and len(err.strip().splitlines()) == 1


def _damage(run: Path, **fields: str) -> Path:
    """capacity.json with raw JSON text (NaN, Infinity, numbers) put in for the given fields."""
    f = run / "capacity.json"
    data = json.loads(f.read_text())
    for k in fields:
        data[k] = f"@{k}@"
    text = json.dumps(data)
    for k, v in fields.items():
        text = text.replace(f'"@{k}@"', v)
    f.write_text(text)
    return f


@pytest.mark.parametrize("fields, named", [({"capacity": "NaN"}, "capacity is nan"),
                                           ({"last_pass": "Infinity"}, "last_pass is inf"),
                                           ({"last_pass": "12", "first_fail": "12"}, "last_pass 12 is not below"),
                                           ({"capacity": "-5"}, "capacity is -5, not a number from 0"),
                                           ({"capacity": "1e308"}, "capacity is 1e+308, not a number from 0"),
                                           ({"price_per_hour": "-1"}, "price_per_hour is -1")])
def test_a_damaged_capacity_json_is_refused_naming_the_file_and_field(tmp_path, capsys, fields, named):
    from tools.cli import main

    a = capacity_run(tmp_path, "bf16", ttft_per_user=180)
    b = capacity_run(tmp_path, "emb4", ttft_per_user=90)
    f = _damage(b, **fields)
    assert main(["capacity-compare", str(a), str(b)]) == 2
    out, err = capsys.readouterr()
    assert not out and len(err.strip().splitlines()) == 1
    assert str(f) in err and "damaged capacity result" in err and named in err and "more" not in err


def test_a_capacity_json_field_of_the_wrong_type_is_named(tmp_path, capsys):
    from tools.cli import main

    a = capacity_run(tmp_path, "bf16", ttft_per_user=180)
    f = _damage(capacity_run(tmp_path, "emb4", ttft_per_user=90), input_len='"many"')
    assert main(["capacity-compare", str(a), str(f.parent)]) == 2
    err = capsys.readouterr().err
    assert str(f) in err and "'input_len'" in err and len(err.strip().splitlines()) == 1


def test_missing_or_wrong_kind_capacity_inputs_exit_2(tmp_path, capsys):
    from tools.cli import main

    a = capacity_run(tmp_path, "bf16", ttft_per_user=180)
    sweep_only = tmp_path / "sweep"
    sweep_only.mkdir()
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "capacity.json").write_bytes(b'{"run_id": ')
    for other in (sweep_only, junk, tmp_path / "absent"):
        assert main(["capacity-compare", str(a), str(other)]) == 2
        err = capsys.readouterr().err
        assert str(other) in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_compare_sweeps_over_mcp_takes_capacity_runs(tmp_path):
    from fastmcp import Client

    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    (tmp_path / "models").mkdir()
    ev = tmp_path / "evidence"
    a = capacity_run(ev, "bf16", ttft_per_user=180)
    b = capacity_run(ev, "emb4", ttft_per_user=90)
    roots = Roots.from_env([str(tmp_path / "models")], [str(ev)], environ={})
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}),
                        toolsets="measure")

    async def go():
        async with Client(mcp) as c:
            return (await c.call_tool("compare_sweeps", {"run_dirs": [str(a), str(b)]})).structured_content

    got = asyncio.run(go())
    assert got["capacity"].startswith("the emb4 build serves 11 users within the SLO against 5 for bf16: more")
    assert got["markdown"].startswith("## Capacity within ttft_p99_ms=1000")
    assert got["cells"]  # the per-load sweep comparison follows


def test_request_rate_runs_compare_and_read_as_sweeps(tmp_path):
    from tools.measure.pareto import pareto
    from tools.measure.sweep.report import compare_runs

    a = capacity_run(tmp_path, "bf16", ttft_per_user=400, rate=True)   # 2.5 req/s
    b = capacity_run(tmp_path, "emb4", ttft_per_user=200, rate=True)   # 5 req/s
    ra, rb = load_capacity(a), load_capacity(b)
    assert ra.load == "rate" and ra.last_pass <= 2.5 < ra.first_fail and rb.last_pass <= 5 < rb.first_fail
    assert "requests/s within ttft_p99_ms=1000" in rb.statement
    assert compare_capacity([a, b]).verdicts[0].endswith("more (the brackets do not overlap)")
    assert "req/s |" in (b / "summary.md").read_text()
    cmp = compare_runs([a, b])  # rate cells keyed by their rate
    assert cmp.cells and all(isinstance(c.concurrency, float) for c in cmp.cells)
    assert any(p.load.endswith("req/s") for p in pareto([a, b]).points)
