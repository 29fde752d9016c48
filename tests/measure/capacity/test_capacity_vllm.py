"""A capacity search against the real vLLM CPU server of the int4-embedding tiny build (the shared one)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tools.measure.capacity.run import CapacityParams, run_capacity
from tools.measure.sweep.params import SweepParams
from tools.measure.sweep.run import run_sweep

pytestmark = pytest.mark.vllm
INPUT_LEN, OUTPUT_LEN = 128, 8


def test_a_capacity_search_converges_in_few_points_inside_the_range(emb4_server, tmp_path):
    """The SLO's limit is set between the median TTFT a plain sweep measures at 1 and at 8 users (the server's
    max_num_seqs), on the log scale, so the answer lies inside the range whatever the machine's speed. Medians,
    not p99: over a few prompts on a shared machine a p99 is one request's hiccup."""
    shape = dict(base_url=emb4_server.base_url, output_len=OUTPUT_LEN, prompts_per_concurrency=2, min_prompts=8,
                 out=tmp_path)
    # Another seed than the search's: its prompts are not in the prefix cache when the search measures.
    plain = run_sweep(SweepParams(input_lens=[INPUT_LEN], concurrencies=[1, 8], repeats=2, label="plain", seed=1,
                                  **shape), serve_config=emb4_server)
    t1, t8 = (plain.cell(INPUT_LEN, c).estimate("p50_ttft_ms").mean for c in (1, 8))
    assert t8 > 2 * t1, (t1, t8)  # eight prompts prefilled together wait for each other
    limit = round(math.sqrt(t1 * t8), 1)

    res = run_capacity(CapacityParams(slo=f"ttft_p50_ms={limit},tpot_p99_ms=10000", input_len=INPUT_LEN,
                                      max_load=16, repeats=2, label="emb4", **shape), serve_config=emb4_server)
    print(f"plain sweep TTFT p50: c=1 {t1:.1f} ms, c=8 {t8:.1f} ms; limit {limit}\n{res.statement}\n"
          + (Path(res.run_dir) / "capacity.md").read_text())  # shown with -rP
    assert res.max_num_seqs == 8  # the engine's cap is the search's ceiling
    assert res.status == "found", (t1, t8, res.statement, [(p.load, p.terms[0].value) for p in res.search.points])
    assert 1 <= res.capacity < 8 and res.first_fail == res.capacity + 1
    loads = [p.load for p in res.search.points]
    assert len(set(loads)) <= 6 and loads[:2] == [1, 2], loads  # 1, 2, 4, 8 at most, then at most two bisections
    for p in res.search.points:  # each verdict agrees with its measured value against the limit
        ttft = p.terms[0]
        assert p.passed == (ttft.value <= limit) if p.within_noise else (
            ttft.high <= limit if p.passed else ttft.low > limit), p
    # Goodput counted by vLLM with the SLO's per-request limits, and the cost at the capacity.
    assert res.goodput.mean is not None and 0 < res.goodput.mean
    assert res.out_tok_s.mean > 0 and res.usd_per_million > 0
    assert [t.name for t in res.terms_at_capacity] == ["ttft_p50_ms", "tpot_p99_ms"]
    d = Path(res.run_dir)
    for name in ("capacity.json", "capacity.md", "summary.json", "summary.md", "plot.png", "provenance.json"):
        assert (d / name).is_file(), name
    assert all(Path(f).exists() for f in res.files.values()), res.files  # the published folder's, not the temporary
    assert all(Path(f).exists() for f in json.loads((d / "summary.json").read_text())["files"].values())
    raw = json.loads(next((d / "raw").glob(f"L{INPUT_LEN}-c1-r0.json")).read_text())
    assert raw["vllm_bench_result"]["request_goodput"] is not None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # published whole, nothing partial
