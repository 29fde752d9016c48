"""run_sweep and compare_tokens against the real vLLM CPU server of the int4-embedding tiny build (shared)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.measure.tokens.compare import (TokenCompareParams, check_against, compare_live, load_record,
                                          record_reference)
from tools.measure.sweep.params import SweepParams
from tools.measure.sweep.run import run_sweep
from tools.measure.sweep.params import raw_name

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[3]
INPUT_LEN, OUTPUT_LEN = 48, 16


@pytest.fixture(scope="module")
def reference(emb4_server, tmp_path_factory) -> Path:
    """Tokens of the served build recorded before anything else in this module ran against it."""
    out = tmp_path_factory.mktemp("tokens") / "emb4-reference.json"
    record_reference(out, TokenCompareParams(base_url=emb4_server.base_url, max_tokens=48))
    return out


@pytest.fixture(scope="module")
def sweep(emb4_server, reference, tmp_path_factory):
    """One small sweep: one feasible input length and one too long for the server, two concurrencies, two
    repeats. Returns (params, result, progress calls)."""
    calls: list[tuple[int, int, str]] = []
    params = SweepParams(base_url=emb4_server.base_url, input_lens=[INPUT_LEN, 600], output_len=OUTPUT_LEN,
                         concurrencies=[1, 2], repeats=2, prompts_per_concurrency=2, min_prompts=2, label="emb4",
                         out=tmp_path_factory.mktemp("evidence"))
    res = run_sweep(params, progress=lambda d, t, m: calls.append((d, t, m)), serve_config=emb4_server)
    return params, res, calls


def test_small_sweep_adds_up_exactly(sweep, emb4_server):
    params, res, calls = sweep
    ok = [c for c in res.cells if c.status == "ok"]
    assert [(c.input_len, c.concurrency) for c in ok] == [(INPUT_LEN, 1), (INPUT_LEN, 2)], res.cells
    for cell in ok:
        assert len(cell.repeats) == 2
        for r in cell.repeats:
            m = r.metrics
            assert r.status == "ok", r.reason
            assert m["completed"] == cell.num_prompts == params.num_prompts(cell.concurrency)
            assert m["failed"] == 0
            # ignore_eos: every request produced exactly output_len tokens, as counted by the server's usage.
            assert m["total_output_tokens"] == cell.num_prompts * OUTPUT_LEN
            assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration"], rel=1e-6)
            assert r.prefix_cache_queries is not None and r.prefix_cache_queries >= m["total_input_tokens"]
        vals = [r.metrics["output_throughput"] for r in cell.repeats]
        assert cell.median["output_throughput"] == pytest.approx(sum(vals) / 2)
        assert cell.spread_pct["output_throughput"] == pytest.approx(abs(vals[0] - vals[1]) / (sum(vals) / 2) * 100)
        # Distinct prompts per repeat (seeds), the same for every build.
        assert cell.repeats[0].seed != cell.repeats[1].seed
    assert calls[-1][0] == calls[-1][1] == 4  # 2 cells x 2 repeats; the infeasible cell is not planned


def test_infeasible_cells_are_not_run(sweep):
    _, res, _ = sweep
    run_dir = Path(res.run_dir)
    bad = [c for c in res.cells if c.input_len == 600]
    assert res.max_model_len == 512
    assert [c.status for c in bad] == ["infeasible", "infeasible"]
    assert all(not c.repeats and "max_model_len 512" in c.reason for c in bad)
    assert not list((run_dir / "raw").glob("L600-*"))


def test_evidence_folder_has_tables_plot_and_provenance(sweep, emb4_server, emb4_build):
    _, res, _ = sweep
    run_dir = Path(res.run_dir)
    assert run_dir.name.endswith("-emb4-" + run_dir.name.rsplit("-", 1)[1])
    for name in ("summary.json", "summary.csv", "summary.md", "plot.png", "provenance.json"):
        assert (run_dir / name).is_file(), name
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (run_dir / "summary.md").read_text()
    assert f"## {INPUT_LEN}-token prompts" in md and "| c | out tok/s |" in md
    csv_rows = (run_dir / "summary.csv").read_text().strip().splitlines()
    assert len(csv_rows) == 1 + 4
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["run_id"] == res.run_id and len(summary["cells"]) == 4
    prov = json.loads((run_dir / "provenance.json").read_text())
    assert prov["vllm_version_server"] == "0.32.0"
    assert prov["cpu_model"] or prov["gpu_name"]
    assert prov["server_argv"] and str(emb4_build) in prov["server_argv"]
    assert prov["server_start_fields"] is not None
    assert prov["checkpoint_config_sha256"] == hashlib.sha256((emb4_build / "config.json").read_bytes()).hexdigest()
    for k in range(2):
        raw = json.loads((run_dir / "raw" / raw_name(INPUT_LEN, 1, k)).read_text())
        assert raw["vllm_bench_result"]["completed"] == 2
        assert raw["spec"]["seed"] == raw["repeat_result"]["seed"]


def test_resume_skips_finished_repeats(sweep):
    params, res, _ = sweep
    raw = Path(res.run_dir) / "raw"
    kept = raw / raw_name(INPUT_LEN, 1, 0)
    dropped = raw / raw_name(INPUT_LEN, 2, 1)
    before = {p.name: p.stat().st_mtime_ns for p in raw.glob("*.json") if not p.name.endswith(".spec.json")}
    dropped.unlink()
    calls: list[str] = []
    again = run_sweep(params, progress=lambda d, t, m: calls.append(m), resume=True)
    assert again.run_dir == res.run_dir
    after = {p.name: p.stat().st_mtime_ns for p in raw.glob("*.json") if not p.name.endswith(".spec.json")}
    assert after.keys() == before.keys()
    changed = {n for n in after if after[n] != before[n]}
    assert changed == {dropped.name}, changed  # only the missing repeat was measured again
    assert kept.stat().st_mtime_ns == before[kept.name]
    assert any("already measured, skipped" in m for m in calls)
    assert [c.status for c in again.cells] == [c.status for c in res.cells]
    old = res.cell(INPUT_LEN, 1).median["output_throughput"]
    assert again.cell(INPUT_LEN, 1).median["output_throughput"] == old


def test_compare_tokens_of_a_build_with_itself_is_identical(emb4_server):
    res = compare_live(emb4_server.base_url, emb4_server.base_url, TokenCompareParams(max_tokens=32))
    assert (res.identical, res.total) == (8, 8)
    assert all(p.first_divergence is None and p.verdict == "identical" for p in res.prompts)
    assert all(p.reference_len == 32 or p.reference_len < 32 for p in res.prompts)


def test_recorded_reference_still_matches_later(reference, emb4_server, sweep):
    rec = load_record(reference)
    assert len(rec.generations) == 8
    assert "capital of France" in rec.generations[0].prompt
    assert all(g.token_ids and len(g.top_logprobs) == len(g.token_ids) for g in rec.generations)
    res = check_against(reference, TokenCompareParams(base_url=emb4_server.base_url))
    assert res.identical == res.total == 8, res.text()


def test_cli_compare_check_prints_per_prompt_lines(reference, emb4_server):
    out = subprocess.run([sys.executable, "-m", "tools.cli", "compare", "check", str(reference),
                          "--base-url", emb4_server.base_url], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("SAME TOKENS: True") == 8
    assert "8 of 8 prompts token-identical" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "tools.cli", "compare", "check", str(reference) + ".nope",
                              "--base-url", emb4_server.base_url], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "reference file not found" in missing.stderr  # bad input
