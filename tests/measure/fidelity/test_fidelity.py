"""Logprob fidelity (`./vllm-t4 fidelity record|check`): the metric, bad input, and the real engine.

The fast tests run against a stand-in server in this process (tests/helpers/stand_ins/fidelity.py) that speaks the
few vLLM endpoints the tool uses, with a bigram "model" whose logits a test can perturb; the `vllm` tests use real vLLM CPU servers of the tiny builds,
including a negative control: a build whose scales were deliberately damaged must fail every metric.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.stand_ins.fidelity import VOCAB, StandInVllm, log_softmax
from tools.cli import main as cli_main
from tools.measure.fidelity import files, run as fid

# ---------------------------------------------------------------------------------------------------------------
# The metric against brute force on full distributions


def _topk(lp, k):
    idx = np.argsort(-lp)[:k]
    return {int(i): float(lp[i]) for i in idx}


def _full_kl(lp_p, lp_q):
    p = np.exp(lp_p)
    return float((p * (lp_p - lp_q)).sum())


def test_identical_distributions_score_zero():
    lp = log_softmax(np.random.default_rng(0).normal(size=50))
    s = fid.score_position(_topk(lp, 5), (7, lp[7]), _topk(lp, 5), (7, lp[7]))
    assert s.kld == pytest.approx(0.0, abs=1e-12)
    assert s.kld_lower_bound == pytest.approx(0.0, abs=1e-12)
    assert s.same_top1
    assert s.matched_mass == pytest.approx(s.listed_mass)


@pytest.mark.parametrize("seed", range(20))
def test_partition_kld_bounds_and_converges_to_full_kld(seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=40) * 3
    lp_p = log_softmax(a)
    lp_q = log_softmax(a + rng.normal(size=40) * (0.05 + seed / 10))
    tok = int(rng.integers(40))
    full = _full_kl(lp_p, lp_q)
    s = fid.score_position(_topk(lp_p, 5), (tok, lp_p[tok]), _topk(lp_q, 5), (tok, lp_q[tok]))
    # merging tokens into one bucket can only lose divergence (log-sum inequality)
    assert 0.0 <= s.kld_lower_bound <= full + 1e-9
    assert s.kld_lower_bound <= s.kld + 1e-12
    assert 0.0 <= s.matched_mass <= s.listed_mass <= 1.0 + 1e-9
    assert s.same_top1 == (int(np.argmax(lp_p)) == int(np.argmax(lp_q)))
    # with the whole vocabulary listed there is nothing to bound: the exact KLD
    everything = fid.score_position(_topk(lp_p, 40), (tok, lp_p[tok]), _topk(lp_q, 40), (tok, lp_q[tok]))
    assert everything.kld == pytest.approx(full, rel=1e-9, abs=1e-12)
    assert everything.matched_mass == pytest.approx(1.0)


def test_missing_token_gets_the_candidates_kth_probability_at_most():
    # Reference: token 9 at 40%; the candidate's top-2 are 1 and 2, its 2nd at logprob log(0.2).
    ref_top = {1: math.log(0.5), 9: math.log(0.4)}
    cand_top = {1: math.log(0.5), 2: math.log(0.2)}
    s = fid.score_position(ref_top, (1, math.log(0.5)), cand_top, (1, math.log(0.5)))
    # 9 gets q = 0.2 (the bound), the tail: p 0.1 vs q 1 - 0.5 - 0.2 = 0.3
    expect = 0.4 * math.log(0.4 / 0.2) + 0.1 * math.log(0.1 / 0.3)
    assert s.kld == pytest.approx(expect, rel=1e-9)
    assert s.matched_mass == pytest.approx(0.5)
    assert s.listed_mass == pytest.approx(0.9)
    assert s.same_top1


# ---------------------------------------------------------------------------------------------------------------
# Record and check against the stand-in server (tests/helpers/stand_ins/fidelity.py)


@pytest.fixture
def corpus(tmp_path) -> Path:
    p = tmp_path / "corpus.txt"
    p.write_text("the quick brown fox jumps over the lazy dog, " * 30)  # 1350 bytes = tokens
    return p


def _cli(capsys, *argv):
    rc = cli_main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_record_then_check_same_server_is_perfect_agreement(tmp_path, corpus, capsys):
    ref = tmp_path / "ref.json"
    with StandInVllm() as srv:
        rc, out, err = _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(corpus),
                            "--window", "100", "--max-corpus-tokens", "450", "--base-url", srv.url, "--json")
        assert rc == 0, err
        rec = json.loads(out)
        assert rec["windows"] == 4 and rec["tokens"] == 400  # whole windows only; BOS in front of each
        assert json.loads(ref.read_text())["footer"]["complete"] is True  # the streamed file is one JSON object
        rc, out, err = _cli(capsys, "fidelity", "check", str(ref), "--base-url", srv.url, "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert res["tokens"] == 400
    assert res["mean_kld"] == pytest.approx(0.0, abs=1e-9) and res["max_kld"] == pytest.approx(0.0, abs=1e-9)
    assert res["top1_agreement"] == 1.0
    assert res["ppl_reference"] == pytest.approx(res["ppl_candidate"])
    assert res["matched_mass"] == pytest.approx(1.0)
    # the same build: the ratio's interval over the 4 windows holds 1
    low, high = res["ppl_ratio_interval"]
    assert low <= 1.0 <= high and res["ppl_verdict"] == "within noise"


def test_check_against_a_perturbed_model_fails_the_metrics(tmp_path, corpus, capsys):
    ref = tmp_path / "ref.json"
    with StandInVllm() as srv:
        assert _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(corpus), "--window", "200",
                    "--base-url", srv.url)[0] == 0
    with StandInVllm(noise=1.0) as srv:
        rc, out, err = _cli(capsys, "fidelity", "check", str(ref), "--base-url", srv.url, "--json", "--worst", "3")
        rc_text, text, _ = _cli(capsys, "fidelity", "check", str(ref), "--base-url", srv.url)
    assert rc == 0 and rc_text == 0, err
    res = json.loads(out)
    assert res["mean_kld"] > 0.01
    assert res["p99_kld"] >= res["median_kld"] and res["max_kld"] >= res["p99_kld"]
    assert res["top1_agreement"] < 1.0
    assert res["ppl_ratio"] != pytest.approx(1.0, abs=1e-4)
    low, high = res["ppl_ratio_interval"]  # noise of 1.0 on every logit: the candidate is clearly less sure
    assert low <= res["ppl_ratio"] <= high and res["ppl_verdict"] in ("higher", "lower")
    assert ("higher" if low > 1 else "lower") == res["ppl_verdict"]
    assert "over windows" in text
    assert len(res["worst_positions"]) == 3 and res["worst_positions"][0]["kld"] == pytest.approx(res["max_kld"])
    for key in ("mean KLD", "p99 KLD", "max KLD", "top-1 agreement", "PPL reference", "largest KLD"):
        assert key in text


def test_record_streams_one_window_at_a_time(tmp_path, corpus, monkeypatch):
    """Each window is on disk before the next is scored."""
    ref = tmp_path / "ref.json"
    seen = []
    real = files.RefWriter.window

    def spy(self, obj):
        real(self, obj)
        self.f.flush()
        seen.append(self.f.tmp.read_text().count('"index":'))

    monkeypatch.setattr(files.RefWriter, "window", spy)
    with StandInVllm() as srv:
        fid.record_logprobs(fid.RecordLogprobsParams(out=str(ref), corpus=str(corpus), window=100,
                                                     base_url=srv.url))
    assert seen == list(range(1, 14))


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing written or overwritten


@pytest.mark.parametrize("content, words", [(b"", "empty"), (b"  \n\n", "empty"), (b"caf\xe9 au lait", "UTF-8")])
def test_unusable_corpus_is_refused(tmp_path, capsys, content, words):
    bad = tmp_path / "c.txt"
    bad.write_bytes(content)
    ref = tmp_path / "ref.json"
    rc, out, err = _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(bad),
                        "--base-url", "http://127.0.0.1:9")
    assert rc == 2
    assert words in err and str(bad) in err and len(err.strip().splitlines()) == 1
    assert not ref.exists() and list(tmp_path.iterdir()) == [bad]


def test_corpus_shorter_than_one_window_is_refused(tmp_path, capsys):
    short = tmp_path / "c.txt"
    short.write_text("only a few tokens")
    ref = tmp_path / "ref.json"
    with StandInVllm() as srv:
        rc, _, err = _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(short),
                          "--base-url", srv.url)
    assert rc == 2 and "shorter than one window" in err and "--window" in err
    assert list(tmp_path.iterdir()) == [short]


def test_existing_out_is_kept_unless_force(tmp_path, corpus, capsys):
    ref = tmp_path / "ref.json"
    ref.write_text("precious")
    with StandInVllm() as srv:
        rc, _, err = _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(corpus),
                          "--base-url", srv.url)
        assert rc == 2 and "--force" in err and ref.read_text() == "precious"
        assert srv.requests == 0
        rc, _, err = _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(corpus), "--force",
                          "--window", "500", "--base-url", srv.url)
    assert rc == 0, err
    assert json.loads(ref.read_text())["kind"] == files.RECORD_KIND
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "ref.json"]  # no temporary left


def test_failure_midway_leaves_no_reference(tmp_path, corpus, monkeypatch):
    ref = tmp_path / "ref.json"
    calls = []
    real = fid.ServerClient.prompt_logprobs

    def fail_third(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(fid.ServerClient, "prompt_logprobs", fail_third)
    with StandInVllm() as srv, pytest.raises(KeyboardInterrupt):
        fid.record_logprobs(fid.RecordLogprobsParams(out=str(ref), corpus=str(corpus), window=100,
                                                     base_url=srv.url))
    assert list(tmp_path.iterdir()) == [corpus]


def test_server_without_prompt_logprobs_is_refused(tmp_path, corpus, capsys):
    ref = tmp_path / "ref.json"
    with StandInVllm(prompt_logprobs=False) as srv:
        rc, _, err = _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(corpus),
                          "--base-url", srv.url)
    assert rc == 2 and "prompt_logprobs" in err and len(err.strip().splitlines()) == 1
    assert not ref.exists()


def test_reference_from_another_tokenizer_is_refused(tmp_path, corpus, capsys):
    ref = tmp_path / "ref.json"
    with StandInVllm() as srv:
        assert _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(corpus), "--window", "500",
                    "--base-url", srv.url)[0] == 0
    before = ref.read_bytes()
    with StandInVllm(token_offset=3) as srv:
        rc, out, err = _cli(capsys, "fidelity", "check", str(ref), "--base-url", srv.url)
        assert srv.requests == 0
    assert rc == 2 and "tokenizer" in err and out == ""
    assert ref.read_bytes() == before


def test_reference_from_another_shape_is_refused(tmp_path, corpus, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, layers in ((a, 6), (b, 8)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"text_config": {"vocab_size": VOCAB, "hidden_size": 128,
                                                                        "num_hidden_layers": layers}}))
    ref = tmp_path / "ref.json"
    with StandInVllm(root=a) as srv:
        assert _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(corpus), "--window", "500",
                    "--base-url", srv.url)[0] == 0
    assert json.loads(ref.read_text())["header"]["vocab_size"] == VOCAB
    with StandInVllm(root=b) as srv:
        rc, _, err = _cli(capsys, "fidelity", "check", str(ref), "--base-url", srv.url)
    assert rc == 2 and "num_hidden_layers" in err


def test_window_longer_than_the_candidates_context_is_refused(tmp_path, corpus, capsys):
    ref = tmp_path / "ref.json"
    with StandInVllm(max_model_len=512) as srv:
        assert _cli(capsys, "fidelity", "record", "--out", str(ref), "--corpus", str(corpus), "--window", "400",
                    "--base-url", srv.url)[0] == 0
    with StandInVllm(max_model_len=256) as srv:
        rc, _, err = _cli(capsys, "fidelity", "check", str(ref), "--base-url", srv.url)
    assert rc == 2 and "max_model_len" in err


@pytest.mark.parametrize("text", ["", "{\"kind\": \"gemma4-t4/token-record\"}\n", "not json at all"])
def test_not_a_reference_is_refused(tmp_path, capsys, text):
    ref = tmp_path / "ref.json"
    ref.write_text(text)
    rc, _, err = _cli(capsys, "fidelity", "check", str(ref), "--base-url", "http://127.0.0.1:9")
    assert rc == 2 and "fidelity record" in err


def test_bad_option_is_one_line_exit_2(tmp_path, capsys):
    rc, _, err = _cli(capsys, "fidelity", "record", "--out", str(tmp_path / "r.json"), "--top-k", "50")
    assert rc == 2 and "--top-k" in err and len(err.strip().splitlines()) == 1


def test_no_server_is_exit_1(tmp_path, corpus, capsys):
    rc, _, err = _cli(capsys, "fidelity", "record", "--out", str(tmp_path / "r.json"), "--corpus", str(corpus),
                      "--base-url", "http://127.0.0.1:9")
    assert rc == 1 and "no vLLM server" in err


def test_shipped_corpus_is_utf8_text_of_several_windows():
    path, text, _ = files.load_corpus(None)
    assert path == files.DEFAULT_CORPUS
    assert len(text.encode()) > 4 * 1024  # byte-level tiny model: several 1024-token windows


def test_compare_logprobs_dispatches_both_modes(tmp_path, corpus):
    ref = tmp_path / "ref.json"
    with StandInVllm() as srv:
        rec = fid.compare_logprobs(fid.CompareLogprobsParams(mode="record", reference=str(ref), corpus=str(corpus),
                                                             window=200, base_url=srv.url))
        res = fid.compare_logprobs(fid.CompareLogprobsParams(mode="check", reference=str(ref), base_url=srv.url))
    assert isinstance(rec, fid.RecordLogprobsResult) and rec.windows == 6
    assert isinstance(res, fid.CheckLogprobsResult) and res.tokens == rec.tokens and res.top1_agreement == 1.0


# ---------------------------------------------------------------------------------------------------------------
# The real engine: vLLM's CPU backend serving the tiny builds


def _record(server_cfg, out: Path, **kw) -> fid.RecordLogprobsResult:
    return fid.record_logprobs(fid.RecordLogprobsParams(out=str(out), base_url=server_cfg.base_url, **kw))


@pytest.mark.vllm
def test_vllm_same_build_agrees_with_itself(emb4_server, tmp_path):
    ref = tmp_path / "emb4.json"
    rec = _record(emb4_server, ref, window=256, max_corpus_tokens=1024)
    assert rec.windows == 4 and rec.tokens > 0 and rec.vocab_size is not None
    res = fid.check_logprobs(fid.CheckLogprobsParams(reference=str(ref), base_url=emb4_server.base_url))
    assert res.tokens == rec.tokens
    assert res.mean_kld == pytest.approx(0.0, abs=1e-6)
    assert res.top1_agreement == 1.0
    assert res.ppl_ratio == pytest.approx(1.0, abs=1e-5)


@pytest.mark.vllm
def test_vllm_bf16_embedding_build_against_emb4(bf16_server, emb4_server, tmp_path):
    """The article's comparison through the real engine: the two builds of one QAT model are one model to the
    fingerprint, and the KLD is small (their weights are the same grid values)."""
    ref = tmp_path / "bf16.json"
    rec = _record(bf16_server, ref, window=256, max_corpus_tokens=1024)
    res = fid.check_logprobs(fid.CheckLogprobsParams(reference=str(ref), base_url=emb4_server.base_url))
    assert res.tokens == rec.tokens >= 4 * 255
    assert res.matched_mass > 0.99
    assert res.top1_agreement > 0.9


@pytest.mark.vllm
def test_vllm_negative_control_perturbed_scales_fail_the_metrics(perturbed_server, emb4_server, tmp_path):
    """The reference from the int4-embedding build, checked against a copy of it with wrong scales
    (conftest.perturb_scales): the fidelity metrics and the greedy tokens must both say so."""
    from tools.measure.tokens.compare import TokenCompareParams, check_against, record_reference

    cfg, changed = perturbed_server
    assert any(n.startswith("lm_head") for n in changed)
    ref = tmp_path / "emb4.json"
    _record(emb4_server, ref, window=256, max_corpus_tokens=1024)
    tokens_ref = tmp_path / "emb4-tokens.json"
    record_reference(tokens_ref, TokenCompareParams(base_url=emb4_server.base_url, max_tokens=48))

    res = fid.check_logprobs(fid.CheckLogprobsParams(reference=str(ref), base_url=cfg.base_url))
    greedy = check_against(tokens_ref, TokenCompareParams(base_url=cfg.base_url))
    assert res.mean_kld > 0.01
    assert res.top1_agreement < 1.0
    assert res.ppl_ratio != pytest.approx(1.0, abs=1e-3)
    assert greedy.identical < greedy.total


# ---------------------------------------------------------------------------------------------------------------
# Long-context greedy identity: needle prompts sized with the served tokenizer


def test_long_prompts_hit_their_targets_within_max_model_len():
    from tools.measure.tokens.long_prompts import DEFAULT_TARGETS, build_long_prompts, needle_prompt

    def count(prompt):  # a byte-level tokenizer plus a few template tokens, like the tiny model's
        return len(prompt.encode()) + 7

    built = build_long_prompts(count, 16384, max_tokens=160)
    assert [t for t in DEFAULT_TARGETS] == [2048, 8192, 14336]
    assert len(built) == 3
    for (prompt, n), target in zip(built, DEFAULT_TARGETS):
        assert n == count(prompt)
        assert 0.98 * target <= n <= target
        _, answer = needle_prompt(target, 10)
        assert prompt.index(answer) < 0.1 * len(prompt)  # the fact early
        assert prompt.rstrip().endswith("Answer with the code word only.")  # the question last
    assert build_long_prompts(count, 16384, max_tokens=160) == built  # deterministic
    assert [n for _, n in build_long_prompts(count, 9000, max_tokens=160)] == [n for _, n in built[:2]]
    assert build_long_prompts(count, 2048, max_tokens=160) == []


def test_compare_record_long_adds_the_needle_prompts(tmp_path, monkeypatch, capsys):
    import tools.measure.tokens.compare as ct

    asked = {}
    monkeypatch.setattr(ct, "long_prompts", lambda base, **kw: asked.setdefault("long", ["NEEDLE PROMPT"]))

    def stand_in_generate(base, prompts, **kw):
        asked["prompts"] = prompts
        return ct.TokenRecord(created="now", base_url=base, max_tokens=kw["max_tokens"],
                              top_logprobs=kw["top_logprobs"],
                              generations=[ct.Generation(prompt=p, token_ids=[1], text="", prompt_tokens=9)
                                           for p in prompts])

    monkeypatch.setattr(ct, "generate", stand_in_generate)
    out = tmp_path / "tokens.json"
    rc = cli_main(["compare", "record", "--out", str(out), "--long", "--base-url", "http://127.0.0.1:9"])
    assert rc == 0
    assert asked["prompts"][-1] == "NEEDLE PROMPT" and asked["prompts"][:-1] == list(ct.DEFAULT_PROMPTS)
    rc = cli_main(["compare", "check", str(out), "--json", "--base-url", "http://127.0.0.1:9"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and [p["prompt_tokens"] for p in res["prompts"]] == [9] * 9


@pytest.mark.vllm
def test_vllm_long_prompts_sized_by_the_served_tokenizer(emb4_server, tmp_path):
    from tools.measure.tokens.compare import TokenCompareParams, check_against, record_reference
    from tools.measure.tokens.long_prompts import long_prompts

    prompts = long_prompts(emb4_server.base_url, max_tokens=16, targets=(200, 400, 4096))
    assert len(prompts) == 2  # 4096 does not fit the fixture's max_model_len
    ref = tmp_path / "long.json"
    record_reference(ref, TokenCompareParams(base_url=emb4_server.base_url, prompts=prompts, max_tokens=16))
    res = check_against(ref, TokenCompareParams(base_url=emb4_server.base_url))
    sizes = [p.prompt_tokens for p in res.prompts]
    assert 196 <= sizes[0] <= 200 and 392 <= sizes[1] <= 400
    assert res.identical == res.total
