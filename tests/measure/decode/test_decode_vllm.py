"""The decode benchmark and the drafter table against real vLLM CPU servers of the tiny text build with its tiny
drafter: one decode-sweep over 0 and 2 draft tokens (two server starts); the command line's `decode` runs against
the sweep's drafter server while it is up; then the drafter's int4 build (python -m repack build) at 2 draft tokens
(one more start), compared with the bf16 drafter's runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.helpers.fixtures import ROOT, SERVE_MAX_MODEL_LEN, free_port, in_process_engine

pytestmark = pytest.mark.vllm

# vLLM 0.32's CPU backend serves the gemma4_assistant drafter as gemma4_mtp (see the README's decode section).
METHOD = "mtp"


@pytest.fixture(scope="module")
def tiny_drafter(tiny_qat, tmp_path_factory) -> Path:
    from repack.stand_ins.tiny_model import build_tiny_drafter

    info = build_tiny_drafter(tmp_path_factory.mktemp("drafter") / "gemma-4-tiny-assistant", tiny_qat)
    assert info.accuracy > 0.95, f"tiny drafter did not learn the pattern (accuracy {info.accuracy:.3f})"
    return info.path


@pytest.fixture(scope="module")
def int4_drafter(tiny_drafter) -> Path:
    from repack.build.build import BuildOptions, build_checkpoint
    from repack.build.probe import probe_checkpoint

    assert probe_checkpoint(tiny_drafter).drafter["packable"]  # the tiny drafter is QAT-like: on the grid
    out = tiny_drafter.parent / "gemma-4-tiny-assistant-int4"
    build_checkpoint(tiny_drafter, out, BuildOptions())
    return out


def test_decode_sweep_writes_the_drafter_table_and_measures_real_acceptance(bf16_text_build, tiny_drafter,
                                                                           int4_drafter, tmp_path, monkeypatch):
    from tools.measure.decode.sweep import DecodeSweepParams, compare_decode_runs, run_decode_sweep
    from tools.serving.config import load_config
    from tools.serving.server.server import server_status

    monkeypatch.setenv("GEMMA4_T4_MODELS_ROOTS", str(tiny_drafter.parent))
    in_process_engine(monkeypatch)  # three starts; the decode sweep's own process handling is tested without it
    overrides = dict(model=str(bf16_text_build), served_name="gemma-4-tiny-text-sweep", host="127.0.0.1",
                     port=free_port(), state_dir=str(tmp_path / "state"), max_model_len=SERVE_MAX_MODEL_LEN,
                     max_num_seqs=8, cpu_kvcache_space_gib=1, extra_args="", start_timeout_s=900.0)
    params = DecodeSweepParams(draft_tokens=[0, 2], prompts=3, max_tokens=24, out=tmp_path / "ev",
                               **({"method": "ngram"} if METHOD == "ngram" else {"drafter": str(tiny_drafter)}))
    base_url = load_config(None, **overrides).base_url
    cli: dict[str, subprocess.CompletedProcess] = {}

    def progress(done: int, total: int, msg: str) -> None:
        # The command line's --json against the drafter server, before the sweep measures it.
        if msg.startswith("2 draft tokens") and not cli:
            cli["decode"] = subprocess.run(
                [str(ROOT / "vllm-t4"), "decode", "--base-url", base_url, "--prompts", "2", "--max-tokens", "16",
                 "--out", str(tmp_path / "cli"), "--json"], capture_output=True, text=True, timeout=600)

    res = run_decode_sweep(params, progress=progress, **overrides)
    assert not server_status(load_config(None, **overrides)).alive  # stopped after the last setting
    rows = {r.draft_tokens: r for r in res.comparison.rows}
    assert rows[0].acceptance_rate is None and rows[0].speedup is None
    assert rows[2].acceptance_rate > 0 and rows[2].speedup is not None
    assert rows[2].greedy_checked  # the no-drafter token ids were compared, prompt by prompt
    table = (Path(res.run_dir) / "table.md").read_text()
    assert "| No drafter, greedy |" in table and "| 2 draft tokens" in table
    assert len(res.runs) == 2 and all((Path(r) / "summary.json").is_file() for r in res.runs)
    # decode-compare prints the same table from the run folders
    out = subprocess.run([str(ROOT / "vllm-t4"), "decode-compare", *res.runs], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == res.comparison.markdown.strip()

    # The drafter run: real acceptance from vLLM's counters, its raw records and provenance.
    (run,) = [Path(r) for r in res.runs if json.loads((Path(r) / "summary.json").read_text())["label"] == "k2-greedy"]
    s = json.loads((run / "summary.json").read_text())
    assert s["draft_tokens"] > 0 and s["accepted_tokens"] > 0 and 0 < s["acceptance_rate"] <= 1
    assert s["mean_accepted_length"] > 1 and len(s["per_position_acceptance"]) == 2
    assert s["median_tpot_ms"] > 0 and s["median_ttft_ms"] > 0 and s["decode_tok_s"] > 0
    assert len(s["prompts"]) == 3 and all(p["output_tokens"] == len(p["token_ids"]) > 1 for p in s["prompts"])
    assert s["acceptance_rate"] == rows[2].acceptance_rate  # the table is the runs' figures
    assert sorted(f.name for f in (run / "raw").iterdir()) == [
        "00-code-python-fib.json", "01-code-sql-join.json", "02-code-bash-rename.json"]
    prov = json.loads((run / "provenance.json").read_text())
    assert "--speculative-config" in prov["server_argv"]
    assert prov["speculative_config"]["num_speculative_tokens"] == 2
    if METHOD == "mtp":
        assert prov["drafter_config_sha256"]

    assert "decode" in cli, "the sweep never reported its drafter setting"
    assert cli["decode"].returncode == 0, cli["decode"].stderr[-2000:]
    data = json.loads(cli["decode"].stdout)
    for key in ("median_tpot_ms", "median_ttft_ms", "decode_tok_s", "draft_tokens", "accepted_tokens",
                "acceptance_rate"):
        assert data[key] is not None, key
    assert data["acceptance_rate"] > 0

    # The int4 drafter served with the same target: vLLM reads its compressed-tensors config (the linears are only
    # there as weight_packed), its drafts are accepted as the bf16 drafter's are and greedy output is unchanged.
    int4 = run_decode_sweep(params.model_copy(update={"drafter": str(int4_drafter), "draft_tokens": [2],
                                                      "label": "decode-sweep-int4"}), **overrides)
    (row,) = compare_decode_runs([*res.runs, *int4.runs]).rows[2:]
    assert row.draft_tokens == 2 and row.acceptance_rate > 0 and row.greedy_checked and not row.greedy_diffs
    assert row.acceptance_rate == pytest.approx(rows[2].acceptance_rate, abs=0.1)
    prov = json.loads((Path(int4.runs[0]) / "provenance.json").read_text())
    assert str(int4_drafter) in json.dumps(prov["speculative_config"])
