"""The decode benchmark without a server: /metrics deltas, the drafter table, the greedy check, evidence folders,
and bad input refused before any server starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tools.core.errors import ToolFailure
from tools.measure import evidence
from tools.measure.decode.run import DecodeResult, PromptRecord, load_prompts, summarize
from tools.measure.decode.sweep import (DecodeSweepParams, compare_decode_runs, first_divergence, run_decode_sweep,
                                        speculative_json)
from tools.measure.spec_metrics import parse_spec_counters, spec_delta
from tools.serving.preflight.speculative import validate_speculative_config
from tools.core.errors import BadInput

from tests.helpers.fixtures import IN_PROCESS_TORCH

ROOT = Path(__file__).resolve().parents[3]
ARTICLE = ROOT / "evidence" / "article-t4" / "decode"

METRICS_BEFORE = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 99.0
"""
METRICS_AFTER = """\
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 110.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 0.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 330.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 162.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 87.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 54.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 21.0
"""


def test_spec_counters_deltas_give_acceptance_and_per_position():
    before, after = parse_spec_counters(METRICS_BEFORE), parse_spec_counters(METRICS_AFTER)
    assert before["per_pos"] == {0: 7.0, 1: 4.0, 2: 1.0}
    stats, found = spec_delta(before, after)
    assert found
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (100.0, 300.0, 150.0)
    assert stats.acceptance_rate == pytest.approx(0.5)
    assert stats.mean_accepted_length == pytest.approx(2.5)
    assert stats.per_position == pytest.approx([0.8, 0.5, 0.2])


def test_no_spec_counters_means_no_acceptance():
    stats, found = spec_delta(parse_spec_counters(""), parse_spec_counters("vllm:other_total 3.0\n"))
    assert not found and stats.acceptance_rate is None and stats.per_position == []


def _rec(pid: str, ids: list[int], ttft: float = 10.0, e2e: float = 100.0) -> PromptRecord:
    n = len(ids)
    return PromptRecord(id=pid, kind="short", ttft_ms=ttft, e2e_ms=e2e, output_tokens=n, token_ids=ids,
                        tpot_ms=(e2e - ttft) / (n - 1) if n > 1 else None)


def test_summary_medians_and_decode_rate():
    recs = [_rec("a", [1, 2, 3, 4], ttft=10, e2e=40), _rec("b", [1, 2], ttft=20, e2e=30),
            _rec("c", [1, 2, 3], ttft=30, e2e=70)]
    s = summarize(recs)
    assert s["median_ttft_ms"] == 20 and s["median_tpot_ms"] == 10 and s["mean_output_tokens"] == 3
    assert s["decode_tok_s"] == pytest.approx((3 + 1 + 2) / ((30 + 10 + 40) / 1e3))


def _result(label: str, k: int, sampling: str, tpot: float, prompts: list[PromptRecord], acc=None) -> DecodeResult:
    return DecodeResult(run_id=label, run_dir=label, label=label, sampling=sampling, sampling_params={},
                        speculative_config={"model": "/m/d", "num_speculative_tokens": k} if k else None,
                        max_tokens=8, prompts=prompts, median_tpot_ms=tpot, acceptance_rate=acc)


def test_table_speedup_and_greedy_divergence():
    # Per-prompt times agree with the medians: 10 ms, 8 ms and 5 ms per token after the first.
    base = _result("k0", 0, "greedy", 10.0, [_rec("a", [1, 2, 3], e2e=30), _rec("b", [4, 5, 6], e2e=30)])
    same = _result("k2", 2, "greedy", 8.0, [_rec("a", [1, 2, 3], e2e=26), _rec("b", [4, 5, 6], e2e=26)], acc=0.5)
    diff = _result("k3", 3, "greedy", 5.0, [_rec("a", [1, 2, 3], e2e=20), _rec("b", [4, 9, 6, 7], e2e=25)],
                   acc=0.4)
    sampled = _result("k3s", 3, "checkpoint", 9.0, [_rec("a", [7])], acc=0.3)
    cmp = compare_decode_runs([base, same, diff, sampled])
    rows = {r.label: r for r in cmp.rows}
    assert rows["k2"].speedup == pytest.approx(1.25) and rows["k2"].greedy_checked and not rows["k2"].greedy_diffs
    d = rows["k3"].greedy_diffs
    assert [(x.id, x.first_divergence, x.tokens_reference, x.tokens_candidate) for x in d] == [("b", 1, 3, 4)]
    assert d[0].reference_ids == [5, 6] and d[0].candidate_ids == [9, 6, 7]
    assert rows["k3s"].speedup is None  # no no-drafter run with checkpoint sampling to compare with
    assert "| 2 draft tokens, greedy | 8.0 ms | 50% |" in cmp.markdown and "| all identical |" in cmp.markdown
    assert "| 3 draft tokens, greedy | 5.0 ms | 40% |" in cmp.markdown and "1 differ" in cmp.markdown
    assert "| b | 1 | 3 / 4 | [5, 6] / [9, 6, 7] |" in cmp.markdown


def test_first_divergence_counts_a_length_difference():
    assert first_divergence([1, 2], [1, 2]) is None
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([1, 5], [1, 2]) == 1


def test_article_reference_reproduces_the_drafter_table():
    runs = sorted(p for p in ARTICLE.iterdir() if p.is_dir())
    order = ["k0-greedy", "k2-greedy", "k3-greedy", "k4-greedy", "k6-greedy", "k0-checkpoint", "k3-checkpoint"]
    cmp = compare_decode_runs([ARTICLE / n for n in order])
    md = cmp.markdown
    for row in ("| No drafter, greedy | 9.9 ms |", "| 2 draft tokens, greedy | 7.9 ms | 48% |",
                "| 3 draft tokens, greedy | 7.4 ms | 38% |", "| 4 draft tokens, greedy | 7.3 ms | 32% |",
                "| 6 draft tokens, greedy | 7.5 ms | 23% |", "| No drafter, default sampling | 9.8 ms |",
                "| 3 draft tokens, default sampling | 8.7 ms | 37% |"):
        assert row in md, row
    rows = {r.label: r for r in cmp.rows}
    assert f"{rows['k3-checkpoint'].speedup:.2f}" == "1.13"
    assert rows["k3-greedy"].acceptance_rate == pytest.approx(2339 / 6186)
    assert len(runs) == len(order)
    # decode-compare prints the same table from the folders
    out = subprocess.run([str(ROOT / "vllm-t4"), "decode-compare", *map(str, (ARTICLE / n for n in order))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == md.strip()


def test_shipped_prompts_are_twenty_varied_with_unique_ids():
    items = load_prompts(20)
    assert len(items) == 20 and len({p["id"] for p in items}) == 20
    assert {p["kind"] for p in items} == {"code", "prose", "list", "translation", "short", "long"}
    assert load_prompts(3) == items[:3]


def test_evidence_run_is_invisible_until_finished(tmp_path):
    run = evidence.EvidenceRun.create(tmp_path, "decode-x")
    run.write_raw("00-a", {"v": 1})
    files = run.write_summary({"ok": True}, "# t\n")
    [partial] = tmp_path.glob(".decode-x.partial-*")
    assert not (tmp_path / "decode-x").exists() and (partial / "raw" / "00-a.json").is_file()
    run.finish()
    assert json.loads(Path(files["summary_json"]).read_text()) == {"ok": True}
    assert not list(tmp_path.glob(".decode-x.*"))
    assert not list(tmp_path.rglob("*.tmp"))
    again = evidence.EvidenceRun.create(tmp_path, "decode-x")  # the name is taken: the run gets a suffix
    assert (again.name, again.path) == ("decode-x-2", tmp_path / "decode-x-2")
    again.abandon()
    run2 = evidence.EvidenceRun.create(tmp_path, "decode-y")
    run2.abandon()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode-x"]
    with pytest.raises(ToolFailure, match="must be a name"):
        evidence.EvidenceRun.create(tmp_path, "../escape")


def test_collect_provenance_takes_the_argv_of_a_server_the_caller_started(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    prov = evidence.collect_provenance(None, server_argv=["python", "--model", str(model)])
    assert prov.server_argv == ["python", "--model", str(model)]
    assert prov.checkpoint_config_sha256 is not None
    assert evidence.argv_option(["x", "--speculative-config", '{"a": 1}'], "--speculative-config") == '{"a": 1}'
    assert evidence.argv_option(["--speculative-config={}"], "--speculative-config") == "{}"


# ---------------------------------------------------------------------------------------------- bad input


def _ckpt(folder: Path, cfg: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture()
def models(tmp_path):
    root = tmp_path / "models"
    target = _ckpt(root / "target", {"text_config": {"vocab_size": 512, "hidden_size": 128}})
    good = _ckpt(root / "drafter", {"model_type": "gemma4_assistant", "backbone_hidden_size": 128,
                                     "text_config": {"vocab_size": 512, "hidden_size": 64}})
    return root, target, good


def test_drafter_checks(models, tmp_path):
    root, target, good = models
    roots = (root.resolve(),)
    ok = validate_speculative_config(json.dumps({"model": str(good), "num_speculative_tokens": 3}), str(target),
                                     models_roots=roots)
    assert ok["num_speculative_tokens"] == 3
    outside = _ckpt(tmp_path / "elsewhere" / "d", {"backbone_hidden_size": 128, "text_config": {"vocab_size": 512}})
    with pytest.raises(BadInput, match="outside the models roots") as e:
        validate_speculative_config(json.dumps({"model": str(outside)}), str(target), models_roots=roots)
    assert e.value.detail["field"] == "drafter"
    vocab = _ckpt(root / "vocab", {"backbone_hidden_size": 128, "text_config": {"vocab_size": 256}})
    with pytest.raises(BadInput, match="vocab_size 256 does not match the target's 512"):
        validate_speculative_config(json.dumps({"model": str(vocab)}), str(target), models_roots=roots)
    width = _ckpt(root / "width", {"backbone_hidden_size": 1536, "text_config": {"vocab_size": 512}})
    with pytest.raises(BadInput, match="backbone_hidden_size 1536 does not match the target's hidden_size 128"):
        validate_speculative_config(json.dumps({"model": str(width)}), str(target), models_roots=roots)
    with pytest.raises(BadInput, match="not JSON"):
        validate_speculative_config("{model: x", str(target), models_roots=roots)
    # a hub id is vLLM's to fetch and check
    assert validate_speculative_config('{"model": "google/x-assistant"}', str(target), models_roots=roots)


def test_speculative_json_per_setting():
    p = DecodeSweepParams(drafter="/m/d")
    assert speculative_json(p, 0, None) == ""
    assert json.loads(speculative_json(p, 3, None)) == {"model": "/m/d", "num_speculative_tokens": 3}
    from_env = DecodeSweepParams()
    assert json.loads(speculative_json(from_env, 2, '{"model": "/x", "num_speculative_tokens": 3}'))["model"] == "/x"
    ngram = json.loads(speculative_json(DecodeSweepParams(method="ngram"), 4, None))
    assert ngram["method"] == "ngram" and ngram["num_speculative_tokens"] == 4
    with pytest.raises(BadInput, match="needs a drafter"):
        speculative_json(DecodeSweepParams(), 2, None)


def _cli(args: list[str], env_extra: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([str(ROOT / "vllm-t4"), *args], capture_output=True, text=True, timeout=120, env=env,
                          cwd=cwd)


@pytest.mark.parametrize("case", ["outside", "vocab", "backbone", "not-json"])
def test_decode_sweep_refuses_bad_input_before_starting(models, tmp_path, capsys, monkeypatch, case):
    root, target, good = models
    state = tmp_path / "state"
    out = tmp_path / "ev"
    env = {"GEMMA4_T4_MODELS_ROOTS": str(root), "MODEL_NAME": str(target), "STATE_DIR": str(state)}
    args = ["decode-sweep", "--draft-tokens", "0,3", "--out", str(out)]
    if case == "outside":
        d = _ckpt(tmp_path / "away", {"backbone_hidden_size": 128, "text_config": {"vocab_size": 512}})
        args += ["--drafter", str(d)]
    elif case == "vocab":
        args += ["--drafter", str(_ckpt(root / "v", {"backbone_hidden_size": 128, "text_config": {"vocab_size": 9}}))]
    elif case == "backbone":
        args += ["--drafter", str(_ckpt(root / "b", {"backbone_hidden_size": 7, "text_config": {"vocab_size": 512}}))]
    else:
        env["SPECULATIVE_CONFIG"] = "{not json"
    if case == "outside":  # as the script
        r = _cli(args, env, tmp_path)
        rc, err = r.returncode, r.stderr
    else:  # the script's main(), in this process
        from tools.cli import main

        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.chdir(tmp_path)
        capsys.readouterr()
        rc, err = main(args), capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-t4 decode-sweep: ")
    assert not state.exists() and not out.exists()  # nothing started, nothing written


def test_decode_refuses_a_bad_label_with_status_2(tmp_path):
    r = _cli(["decode", "--label", "a b", "--base-url", "http://127.0.0.1:9"], {}, tmp_path)
    assert r.returncode == 2 and "label" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_decode_sweep_refuses_negative_draft_tokens():
    # the parameter model refuses it (the rule every numeric option keeps), for the CLI and MCP alike
    with pytest.raises(ValidationError, match="draft_tokens"):
        DecodeSweepParams(draft_tokens=[0, -1], drafter="/m/d")
    with pytest.raises(BadInput, match="draft_tokens"):  # the parameter, plainly (the CLI renders --draft-tokens)
        run_decode_sweep(DecodeSweepParams.model_construct(draft_tokens=[0, -1], drafter="/m/d"))


def test_sweep_records_acceptance_per_cell():
    from tools.measure.sweep.params import CellResult, RepeatResult, SweepResult, cell_acceptance
    from tools.measure.sweep.report import markdown_run

    reps = [RepeatResult(repeat=0, seed=1, status="ok", num_prompts=2,
                         spec_decode={"draft_tokens": 30.0, "accepted_tokens": 12.0}),
            RepeatResult(repeat=1, seed=2, status="ok", num_prompts=2,
                         spec_decode={"draft_tokens": 10.0, "accepted_tokens": 8.0}),
            RepeatResult(repeat=2, seed=3, status="failed", num_prompts=2,
                         spec_decode={"draft_tokens": 100.0, "accepted_tokens": 0.0})]
    assert cell_acceptance(reps) == pytest.approx(0.5)
    assert cell_acceptance([RepeatResult(repeat=0, seed=1, status="ok", num_prompts=2)]) is None
    cell = CellResult(input_len=64, output_len=8, concurrency=4, num_prompts=2, status="ok", repeats=reps,
                      acceptance_rate=cell_acceptance(reps))
    res = SweepResult(run_id="r", run_dir="r", label="b", params={}, started="now", cells=[cell],
                      speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert "Drafts accepted per cell: in=64 c=4: 50%" in markdown_run(res)


def _stand_in_target(folder: Path, width: int = 128) -> Path:
    """A stand-in for the tiny target: only what the drafter build reads (the embedding) and its config."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    name = "model.language_model.embed_tokens.weight"
    save_file({name: torch.randn(512, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)},
              str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "model-00001-of-00001.safetensors"}}))
    (folder / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 512, "hidden_size": width}}))
    return folder


@IN_PROCESS_TORCH
def test_tiny_drafter_has_the_assistant_layout_and_learns_the_pattern(tmp_path):
    from safetensors import safe_open

    from repack.stand_ins.tiny_model import build_tiny_drafter

    target = _stand_in_target(tmp_path / "models" / "target")
    # 80 steps: the pattern is learnt whole by 40 (seeds 0-2); the default 300 is margin for the served drafter.
    info = build_tiny_drafter(tmp_path / "models" / "drafter", target, train_steps=80)
    assert info.accuracy > 0.95
    cfg = json.loads((info.path / "config.json").read_text())
    assert cfg["model_type"] == "gemma4_assistant" and cfg["backbone_hidden_size"] == 128
    assert cfg["text_config"]["hidden_size"] == 64 and cfg["text_config"]["vocab_size"] == 512
    with safe_open(str(info.path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("pre_projection.weight").get_shape() == [64, 256]
    assert not any(".k_proj." in n or ".v_proj." in n for n in names)  # every layer reads the target's KV cache
    validate_speculative_config(json.dumps({"model": str(info.path), "num_speculative_tokens": 3}), str(target),
                                models_roots=((tmp_path / "models").resolve(),))
    with pytest.raises(ValueError, match="expected"):
        build_tiny_drafter(tmp_path / "d2", _stand_in_target(tmp_path / "wide", width=256))


def test_stream_chat_reads_token_ids_usage_and_sends_the_sampling():
    import httpx

    from tools.measure.decode.run import stream_chat

    sent = {}

    def handler(request: httpx.Request) -> httpx.Response:
        sent.update(json.loads(request.content))
        chunks = [{"choices": [{"delta": {"role": "assistant", "content": ""}, "token_ids": []}]},
                  {"choices": [{"delta": {"content": "ab"}, "token_ids": [20, 21]}]},  # two tokens in one step
                  {"choices": [{"delta": {"content": "c"}, "token_ids": [22], "finish_reason": "length"}]},
                  {"choices": [], "usage": {"completion_tokens": 3}}]
        body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        r = stream_chat(client, "http://x", "m", "hi", max_tokens=3, sampling={"temperature": 1.0, "top_k": 64},
                        seed=7, timeout=10)
    assert r["token_ids"] == [20, 21, 22] and r["output_tokens"] == 3 and r["text"] == "abc"
    assert r["finish_reason"] == "length" and 0 < r["ttft_ms"] <= r["e2e_ms"]
    assert sent["stream"] and sent["return_token_ids"] and sent["stream_options"] == {"include_usage": True}
    assert (sent["temperature"], sent["top_k"], sent["seed"]) == (1.0, 64, 7)


def test_checkpoint_sampling_reads_generation_config(tmp_path):
    from tools.measure.decode.params import checkpoint_sampling

    f = tmp_path / "generation_config.json"
    f.write_text(json.dumps({"temperature": 1.0, "top_k": 64, "top_p": 0.95, "do_sample": True}))
    assert checkpoint_sampling(f) == {"temperature": 1.0, "top_k": 64, "top_p": 0.95}
    with pytest.raises(BadInput, match="no generation_config.json"):
        checkpoint_sampling(tmp_path / "missing.json")


def _sweep_args(*argv: str) -> DecodeSweepParams:
    import argparse

    p = argparse.ArgumentParser()
    DecodeSweepParams.add_cli_args(p)
    return DecodeSweepParams.from_cli_args(p.parse_args(list(argv)))


def test_decode_sweep_sampling_flag_replaces_the_default_and_is_checked():
    assert _sweep_args().sampling == ["greedy"]
    assert _sweep_args("--sampling", "checkpoint").sampling == ["checkpoint"]  # not added to the default
    assert _sweep_args("--sampling", "greedy,checkpoint").sampling == ["greedy", "checkpoint"]
    assert _sweep_args("--sampling", "greedy", "--sampling", "checkpoint").sampling == ["greedy", "checkpoint"]
    for bad in ("bogus", ","):
        with pytest.raises(BadInput, match="--sampling") as e:
            _sweep_args("--sampling", bad)
        assert e.value.detail["field"] == "sampling"


def test_decode_sweep_runs_record_the_paths_they_have_once_finished(models, tmp_path, monkeypatch):
    """Each setting's summary.json names its folder inside the finished sweep folder, not the .partial one."""
    import types

    from tools.measure.decode import sweep as decode_mod
    from tools.serving.server import server as server_mod  # the Server's own start and stop

    root, target, _ = models
    monkeypatch.setenv("GEMMA4_T4_MODELS_ROOTS", str(root))
    monkeypatch.setattr(server_mod, "start_server",
                        lambda cfg, **kw: types.SimpleNamespace(startup_s=1.0, base_url="http://127.0.0.1:9",
                                                                argv=["x"]))
    monkeypatch.setattr(server_mod, "stop_server", lambda cfg, **kw: None)

    def stand_in_run_decode(params, **kw):  # what run_decode writes: a finished run folder under params.out
        run = evidence.EvidenceRun.create(params.out, params.label)
        res = DecodeResult(run_id=run.name, run_dir=str(run.path), label=params.label, sampling=params.sampling,
                           sampling_params={}, max_tokens=params.max_tokens, prompts=[])
        res.files = run.write_summary(res, "# r\n")
        run.finish()
        return res

    monkeypatch.setattr(decode_mod, "run_decode", stand_in_run_decode)
    res = run_decode_sweep(DecodeSweepParams(draft_tokens=[0], method="ngram", out=tmp_path / "ev"),
                           model=str(target), state_dir=str(tmp_path / "state"))
    [one] = res.runs
    data = json.loads((Path(one) / "summary.json").read_text())
    assert data["run_dir"] == one and Path(one).is_dir() and ".partial" not in one
    assert all(Path(v).is_file() for v in data["files"].values())


def test_a_decode_sweep_stopped_before_any_run_leaves_no_partial_folder(models, tmp_path, monkeypatch):
    """A first start that is refused (a server already runs) or interrupted (Ctrl-C, SIGTERM) leaves nothing in
    --out: an empty .partial folder per try would pile up."""
    from tools.serving.server import server as vllm_server  # the start and stop of the sweep's Server

    root, target, _ = models
    monkeypatch.setenv("GEMMA4_T4_MODELS_ROOTS", str(root))
    stops = []
    monkeypatch.setattr(vllm_server, "stop_server", lambda cfg, **kw: stops.append(cfg))
    for exc in (ToolFailure("a server started from the state dir is already running"), KeyboardInterrupt()):
        def refused(cfg, exc=exc, **kw):
            raise exc
        monkeypatch.setattr(vllm_server, "start_server", refused)
        with pytest.raises(type(exc)):
            run_decode_sweep(DecodeSweepParams(draft_tokens=[0, 2], method="ngram", out=tmp_path / "ev"),
                             model=str(target), state_dir=str(tmp_path / "state"))
        assert list((tmp_path / "ev").iterdir()) == []
    assert stops == []  # nothing was started: a server the refusal names is not this sweep's to stop


def test_decode_report_gives_the_rate_as_a_share_of_the_roofline(tmp_path, monkeypatch):
    from tools.measure.decode.run import decode_roofline, markdown_run, mean_context_tokens
    from tools.measure.roofline import Bandwidth

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 1, "num_attention_heads": 1,
                                                      "num_key_value_heads": 1, "head_dim": 8}))
    from repack.stand_ins.synthetic import write_safetensors

    write_safetensors(tmp_path / "model.safetensors", [("model.embed_tokens.weight", "BF16", (4, 8), b"\0" * 64),
                                                      ("model.layers.0.mlp.up_proj.weight", "BF16", (2, 8),
                                                       b"\0" * 32)])
    recs = [PromptRecord(id="a", kind="short", ttft_ms=1, tpot_ms=1, e2e_ms=3, output_tokens=4, prompt_tokens=10)]
    assert mean_context_tokens(recs) == 12
    res = DecodeResult(run_id="r", run_dir=str(tmp_path), label="x", sampling="greedy", sampling_params={},
                       max_tokens=4, prompts=recs, decode_tok_s=10.0)
    bw = Bandwidth(bytes_per_s=1e6, device="cpu", method="numpy copy of 256 MiB")
    import tools.measure.roofline as roofline_mod

    orig = roofline_mod.single_stream_roofline
    monkeypatch.setattr(roofline_mod, "single_stream_roofline", lambda *a, **k: orig(*a, **k, bandwidth=bw))
    res.roofline, res.roofline_note = decode_roofline(res, str(tmp_path))
    # 32 (linear) + 64 (tied output) + 16 (one row) + K and V at 12 tokens (2 x 8 x 12 x 2 = 384)
    assert res.roofline.step_bytes == 496 and res.roofline.fraction == pytest.approx(10 * 496 / 1e6)
    # 496 bytes a step: no share of the roofline means anything at that size, and none is printed as 0%
    assert "n/a: a step reads 0.00 MiB" in markdown_run(res) and "0% of" not in markdown_run(res)
    assert res.roofline.applicable is False and res.roofline.model_dump()["applicable"] is False
    assert decode_roofline(res, "google/gemma-4-E2B-it")[0] is None
    assert "not a local folder" in decode_roofline(res, "google/gemma-4-E2B-it")[1]
    res.speculative_config = {"model": "d"}
    assert "drafter" in decode_roofline(res, str(tmp_path))[1]
    res.roofline, res.roofline_note = None, "no decode rate measured"
    assert "Roofline: none (no decode rate measured)" in markdown_run(res)


def test_an_unreadable_build_costs_the_roofline_not_the_run(tmp_path):
    from tools.measure.decode.run import decode_roofline

    (tmp_path / "config.json").write_text("{not json")
    res = DecodeResult(run_id="r", run_dir=str(tmp_path), label="x", sampling="greedy", sampling_params={},
                       max_tokens=4, decode_tok_s=10.0)
    fig, note = decode_roofline(res, str(tmp_path))
    assert fig is None and "could not be read" in note
