"""compare_tokens' bookkeeping without a server: divergence position, near-tie verdict, record and prompt files."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from tools.measure.tokens.compare import (DEFAULT_PROMPTS, Generation, TokenCompareParams, TokenRecord,
                                          compare_generations, compare_records, compare_tokens, load_prompts,
                                          load_record, save_record)
from tools.core.errors import ToolFailure


def gen(ids, tops=None, prompt="p"):
    return Generation(prompt=prompt, token_ids=ids, text="", top_logprobs=tops or [])


def test_default_prompts_hold_the_articles_three():
    assert len(DEFAULT_PROMPTS) == 8
    joined = " ".join(DEFAULT_PROMPTS)
    assert "capital of France" in joined and "first ten prime numbers, comma separated" in joined
    assert "HTTP status code 418" in joined


def test_identical_tokens():
    r = compare_generations(gen([5, 6, 7]), gen([5, 6, 7]))
    assert r.same_tokens and r.verdict == "identical" and r.first_divergence is None


def test_near_tie_when_each_token_is_in_the_others_topk():
    ref = gen([5, 6, 7], [{5: -0.1}, {6: -0.69, 9: -0.70}, {7: -0.1}])
    cand = gen([5, 9, 3], [{5: -0.1}, {9: -0.68, 6: -0.71}, {3: -0.1}])
    r = compare_generations(ref, cand)
    assert not r.same_tokens
    assert (r.first_divergence, r.reference_token, r.candidate_token) == (1, 6, 9)
    assert r.verdict == "near-tie"
    assert r.logprob_gap == pytest.approx(0.01)


def test_real_divergence_when_the_other_token_is_outside_topk():
    ref = gen([5, 6], [{5: -0.1}, {6: -0.01, 8: -5.0}])
    cand = gen([5, 9], [{5: -0.1}, {9: -0.01, 11: -5.0}])
    r = compare_generations(ref, cand)
    assert r.verdict == "divergence" and r.candidate_in_reference_topk is False
    assert r.reference_in_candidate_topk is False and r.logprob_gap is None


def test_one_side_stopping_early_is_a_length_difference():
    r = compare_generations(gen([5, 6, 7]), gen([5, 6]))
    assert r.verdict == "length" and r.first_divergence == 2


def test_records_round_trip_and_compare(tmp_path):
    rec = TokenRecord(created="now", base_url="http://x", model="m", max_tokens=3, top_logprobs=2,
                      generations=[gen([1, 2, 3], prompt="a"), gen([4, 5], prompt="b")])
    path = save_record(rec, tmp_path / "ref.json")
    back = load_record(path)
    assert back.generations == rec.generations
    other = rec.model_copy(deep=True)
    other.generations[1].token_ids = [4, 6]
    cmp = compare_records(back, other)
    assert (cmp.identical, cmp.total) == (1, 2)
    assert cmp.prompts[1].first_divergence == 1
    assert "1 of 2 prompts token-identical" in cmp.text()
    other.generations[0].prompt = "changed"
    with pytest.raises(ToolFailure, match="different prompts"):
        compare_records(back, other)


def test_bad_reference_and_prompt_files(tmp_path):
    with pytest.raises(ToolFailure, match="not found"):
        load_record(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text(json.dumps({"kind": "something else"}))
    with pytest.raises(ToolFailure, match="not a token record"):
        load_record(tmp_path / "x.json")
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    assert load_prompts(tmp_path / "p.txt") == ["first", "second"]
    (tmp_path / "p.json").write_text(json.dumps(["a", 3]))
    with pytest.raises(ToolFailure, match="list of non-empty prompt strings"):
        load_prompts(tmp_path / "p.json")


def test_modes_need_their_arguments():
    with pytest.raises(ToolFailure, match="needs reference"):
        compare_tokens(TokenCompareParams(mode="record"))
    with pytest.raises(ToolFailure, match="needs other_url"):
        compare_tokens(mode="live", base_url="http://127.0.0.1:9")
    with pytest.raises(ValidationError, match="'record', 'check' or 'live'"):  # the parameter model refuses
        compare_tokens(mode="nope", reference="x")
