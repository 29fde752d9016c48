"""The tiny all-4-bit build served on a CPU without cpu_gemm_wna16 (AVX2): the plugin's int4 matmul (the shared
server) against its dequantize-and-matmul reference (a server started with int4_matmul.PATH_ENV=dequantize), the
same greedy tokens and next-token distributions within float noise."""

from __future__ import annotations

import pytest

PROMPTS = ["Hello.", "Name three colours and one animal.", "Count from one to twenty in words, please.",
           "Write a short sentence about the sea."]
MAX_TOKENS = 24


def _kld(ref: dict[int, float], cand: dict[int, float]) -> float:
    """KL(ref || cand) over the reference's top tokens (both logprobs known for each), in nats."""
    import math

    return sum(math.exp(lp) * (lp - cand[t]) for t, lp in ref.items() if t in cand)


@pytest.mark.vllm
@pytest.mark.vllm_lane(0)  # with the shared server it reads (a lane-1 worker would start that one again)
def test_the_int4_matmul_serves_the_tokens_of_the_dequantize_path(emb4_build, emb4_server, serve_config_factory,
                                                                   monkeypatch):
    from gemma4_t4_vllm import int4_matmul, wna16
    from tests.helpers.fixtures import in_process_engine, require_plugin
    from tools.measure.tokens.compare import compare_records, generate
    from tools.serving.server.engine_log import CPU_WNA16_MARK
    from tools.serving.server.server import start_server
    from tools.serving.server.server import stop_server

    if not wna16.op_missing():
        pytest.skip("this CPU's vLLM library has cpu_gemm_wna16: vLLM's own kernel serves, the plugin's does not")
    require_plugin()
    kernel = generate(emb4_server.base_url, PROMPTS, max_tokens=MAX_TOKENS, top_logprobs=5)
    in_process_engine(monkeypatch)
    monkeypatch.setenv(int4_matmul.PATH_ENV, "dequantize")
    cfg = serve_config_factory(emb4_build, "gemma-4-tiny-text-emb4-dequantize")
    started = start_server(cfg)
    try:
        from pathlib import Path

        assert CPU_WNA16_MARK in Path(started.log_path).read_text(errors="replace")
        reference = generate(cfg.base_url, PROMPTS, max_tokens=MAX_TOKENS, top_logprobs=5)
    finally:
        stop_server(cfg)
    comparison = compare_records(reference, kernel)
    assert comparison.identical == len(PROMPTS), comparison.text()
    klds = [_kld(r, c) for gr, gc in zip(reference.generations, kernel.generations)
            for r, c in zip(gr.top_logprobs, gc.top_logprobs)]
    assert len(klds) == len(PROMPTS) * MAX_TOKENS
    # float noise: the same float32 products summed in another order, then one float16 rounding per layer
    assert max(abs(k) for k in klds) < 1e-3 and sum(klds) / len(klds) < 1e-4, klds
