"""Against a second, different build served by a server this module owns: token divergences between builds,
and a sweep whose server dies mid-run (the module kills its own server last)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.measure.compare_tokens import CompareParams, check_against, compare_live, record_reference
from tools.measure.sweep import SweepParams, raw_name, run_sweep

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def other_server(serve_config_factory, tmp_path_factory):
    """The tiny model trained on another pattern (seed 1), built text-only with bf16 embeddings like
    `bf16_text_build`, served for this module only."""
    from repack.build import BuildOptions, build_checkpoint
    from tools.demo.tiny_model import cached_tiny_qat_checkpoint
    from tools.serving.vllm_server import start_server, stop_server

    src = cached_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny-seed1") / "gemma-4-tiny-qat-seed1", seed=1)
    assert src.accuracy > 0.95
    out = tmp_path_factory.mktemp("seed1-text") / "gemma-4-tiny-seed1-text"
    build_checkpoint(src.path, out, BuildOptions(quantize_linears=True, text_only=True, embed_int4=False,
                                                 embed_tokens=False))
    cfg = serve_config_factory(out, "gemma-4-tiny-seed1-text")
    start_server(cfg)
    try:
        yield cfg
    finally:
        stop_server(cfg)


def test_different_builds_report_divergences_with_positions(emb4_server, other_server):
    res = compare_live(emb4_server.base_url, other_server.base_url, CompareParams(max_tokens=32))
    assert res.total == 8
    assert res.identical < 8, res.text()
    for p in res.prompts:
        if p.same_tokens:
            continue
        assert p.verdict in ("near-tie", "divergence", "length")
        assert isinstance(p.first_divergence, int) and 0 <= p.first_divergence < 32
        if p.verdict != "length":
            assert p.reference_token != p.candidate_token
            assert p.candidate_in_reference_topk is not None and p.reference_in_candidate_topk is not None
    text = res.text()
    assert "SAME TOKENS: False" in text and "first divergence at token" in text
    assert f"{res.identical} of 8 prompts token-identical" in text


def test_recorded_reference_against_another_build(emb4_server, other_server, tmp_path):
    ref = tmp_path / "emb4.json"
    rec = record_reference(ref, CompareParams(base_url=emb4_server.base_url, max_tokens=24, top_logprobs=3))
    res = check_against(ref, CompareParams(base_url=other_server.base_url))
    assert res.total == 8 and res.identical < 8
    # The recorded side's tokens are what the check compared against.
    for p, g in zip(res.prompts, rec.generations):
        assert p.reference_len == len(g.token_ids)
        if not p.same_tokens and p.verdict != "length":
            assert g.token_ids[p.first_divergence] == p.reference_token


def test_server_dying_mid_run_keeps_finished_cells_and_fails_the_rest(other_server, tmp_path):
    """Runs last in this module: it stops the module's own server while the sweep's second cell starts."""
    from tools.serving.vllm_server import stop_server

    def progress(done: int, total: int, msg: str) -> None:
        if "c=2: measuring" in msg:  # after the health check of cell 2, before its benchmark process
            stop_server(other_server, grace_s=5)

    params = SweepParams(base_url=other_server.base_url, input_lens=[32], output_len=8, concurrencies=[1, 2, 3],
                         repeats=2, prompts_per_concurrency=1, min_prompts=2, label="dies", out=tmp_path,
                         cell_timeout_s=300)
    res = run_sweep(params, progress=progress)
    assert [c.status for c in res.cells] == ["ok", "failed", "failed"], [c.reason for c in res.cells]
    raw = Path(res.run_dir) / "raw"
    assert all((raw / raw_name(32, 1, k)).is_file() for k in range(2))
    c2, c3 = res.cells[1], res.cells[2]
    assert all(r.status == "failed" and r.reason for r in c2.repeats + c3.repeats)
    assert "/health" in c3.reason  # the server was already gone when cell 3 came up
    saved = json.loads((Path(res.run_dir) / "summary.json").read_text())
    assert [c["status"] for c in saved["cells"]] == ["ok", "failed", "failed"]
    assert saved["cells"][0]["median"]["completed"] == 2
    assert (Path(res.run_dir) / "plot.png").is_file()
