"""The newcomer's one command, on this machine's CPU: tiny model -> two builds -> two servers in turn -> tokens,
sweeps, comparison, report. One test: it starts two vLLM servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.demo import demo

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.vllm
@pytest.mark.vllm_lane(1)  # evens out the lanes: lane 0 holds the tests on the shared servers and the router
def test_demo_runs_the_whole_pipeline_on_cpu(tmp_path, monkeypatch):
    from tests.helpers.fixtures import in_process_engine

    in_process_engine(monkeypatch)  # two starts; the demo's own process handling is tested without vLLM
    lines: list[str] = []
    report = demo.run_demo(demo.DemoOptions(work=tmp_path / "work", evidence=tmp_path / "evidence", gpu=False,
                                            concurrencies=[1, 2], input_lens=[32], output_len=8, max_tokens=16),
                           log=lines.append)
    ev = tmp_path / "evidence"
    assert report.platform == "cpu" and report.probe_verdict == "qat"
    assert [b.label for b in report.builds] == ["bf16-emb", "int4-emb"]
    sizes = {b.label: b.total_bytes_after for b in report.builds}
    assert sizes["int4-emb"] < sizes["bf16-emb"]  # int4 embeddings and head are smaller than bf16 ones
    assert [s.label for s in report.served] == ["bf16-emb", "int4-emb"]
    assert all(s.platform == "cpu" for s in report.served)
    # the tiny model is trained to be confident: int4 embeddings change no greedy token
    assert report.tokens_total == 8 and report.tokens_identical == report.tokens_total
    for s in report.served:
        summary = json.loads((Path(s.sweep_dir) / "summary.json").read_text())
        assert [c["status"] for c in summary["cells"]] == ["ok", "ok"]
    md = (ev / "report.md").read_text()
    assert "8 of 8 prompts identical" in md and "bf16-emb" in md and "int4-emb" in md and "vs" in md
    written = json.loads((ev / "report.json").read_text())
    assert written["tokens_identical"] == 8 and written["finished_at"].endswith("+00:00")
    assert (ev / "tokens-bf16-emb.json").is_file() and (ev / "repack-int4-emb.json").is_file()
    assert any("[6/6]" in line for line in lines)
    # every server was stopped: nothing left in the state dir
    assert not list((tmp_path / "work" / "run").glob("*.json"))


def test_demo_on_gpu_needs_the_source_checkpoint(tmp_path):
    env_file = tmp_path / "tpu.env"
    env_file.write_text((ROOT / "tpu.env").read_text() + "\nSOURCE_CHECKPOINT=\n")
    out = subprocess.run([sys.executable, "-m", "tools.demo", "--platform", "gpu", "--env-file", str(env_file),
                          "--work", str(tmp_path / "w"), "--evidence", str(tmp_path / "e")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in __import__("os").environ.items() if k != "SOURCE_CHECKPOINT"})
    assert out.returncode == 2
    assert "SOURCE_CHECKPOINT is not set" in out.stderr and out.stderr.count("\n") == 1


def test_the_report_carries_its_own_time_and_prints_it():
    """gemma4-t4://demo/latest orders reports by this time: a checkout resets the files' times."""
    r = demo.DemoReport(platform="cpu", source="s", evidence_dir="e", probe_verdict="qat", builds=[], served=[],
                        tokens_identical=8, tokens_total=8, tokens_report="", sweep_comparison="", wall_s=1.0,
                        report_path="e/report.md", finished_at="2026-12-01T08:00:00+00:00")
    assert demo.render_markdown(r).splitlines()[2].startswith("2026-12-01 08:00 UTC, ")
