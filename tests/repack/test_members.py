"""The family table (repack/members.py): every member registered with its source, a checkpoint's member read
from its config.json, an unknown layout refused in one line, and the probe saying what the build will hold per
table before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from repack import members
from repack.errors import RepackError
from repack.members import GIB, MEMBERS, by_name, identify, text_tables
from repack.probe import probe_checkpoint
from repack.synthetic import grid_words, write_safetensors, write_small_checkpoint
from tests.fixtures import IN_PROCESS_TORCH, one_line_error, repack_cli


def test_every_member_is_registered_once_with_its_source():
    assert list(MEMBERS) == ["E2B", "E4B", "12B", "26B-A4B", "31B"]
    for m in MEMBERS.values():
        assert m.source and m.towers_source, m.name
        assert m.source_repo == f"google/gemma-4-{m.name}-it-qat-q4_0-unquantized"
    assert MEMBERS["26B-A4B"].w4a16_repo is None  # Google published no -qat-w4a16-ct export of the MoE
    assert by_name("e4b") is MEMBERS["E4B"]


@pytest.mark.parametrize("name", list(MEMBERS))
def test_member_is_read_from_its_config(name):
    m = MEMBERS[name]
    assert identify({"model_type": m.model_type, "text_config": m.text_config()}) is m
    assert identify(m.text_config()) is m  # a text-only build's promoted config


def test_unknown_layout_is_refused_in_one_line():
    cfg = {"text_config": {**MEMBERS["E4B"].text_config(), "hidden_size": 2048}}
    with pytest.raises(RepackError) as e:
        identify(cfg, "src/config.json")
    assert "\n" not in str(e.value)
    assert "src/config.json: not a known Gemma 4 layout (nearest E4B: hidden_size 2048 (not 2560))" in str(e.value)
    with pytest.raises(RepackError, match="not a Gemma 4 member: choose one of E2B, E4B"):
        by_name("7B")


def test_tables_follow_the_configuration():
    """E2B's tables as the article prints them (bf16: PLE 4.375 GiB, embed_tokens 0.750 GiB); the shapes the
    members differ in: PLE only where it exists, k/v only on the layers that own their KV, v not on k_eq_v full
    layers, expert weights only in the MoE."""
    e2b = text_tables(MEMBERS["E2B"])
    assert e2b["PLE"].params * 2 / GIB == pytest.approx(4.375)
    assert e2b["embed_tokens"].params * 2 / GIB == pytest.approx(0.750)
    shapes = {(n, tuple(s)): c for n, s, c in e2b["linears"].shapes}
    assert shapes[("self_attn.k_proj", (256, 1536))] == 12 and shapes[("self_attn.k_proj", (512, 1536))] == 3
    assert shapes[("mlp.up_proj", (12288, 1536))] == 20  # double-wide MLP on the 20 KV-shared layers
    t31 = text_tables(MEMBERS["31B"])
    assert "PLE" not in t31 and "experts" not in t31
    v = {tuple(s) for n, s, _ in t31["linears"].shapes if n == "self_attn.v_proj"}
    assert v == {(16 * 256, 5376)}  # sliding layers only: full layers are k_eq_v
    assert text_tables(MEMBERS["26B-A4B"])["experts"].shapes[0] == ("experts.gate_up_proj", [128, 1408, 2816], 30)


def test_probe_names_the_member_and_what_each_build_holds(tmp_path):
    src = write_small_checkpoint(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"] = MEMBERS["E2B"].text_config()
    (src / "config.json").write_text(json.dumps(cfg))
    rep = probe_checkpoint(src)
    p = rep.build_preview
    assert p["member"] == "E2B" and "google/gemma-4-E2B" in p["source"]
    four, bf16 = p["builds"]["all-4-bit"]["tables"], p["builds"]["repack-bf16-emb"]["tables"]
    # 64 x 64 tables: int4 is half a byte a value plus an fp16 scale per 32 (and a weight_shape), bf16 two bytes
    assert bf16["PLE"] == 64 * 64 * 2 and four["PLE"] < 64 * 64 * 0.6
    assert "lm_head" in four and "lm_head" not in bf16 and "towers" not in four
    assert "member: E2B" in rep.format_table()
    assert not (tmp_path / "out").exists()


def test_probe_of_a_stand_in_says_it_is_no_released_member(tmp_path):
    rep = probe_checkpoint(write_small_checkpoint(tmp_path / "src"))
    assert rep.build_preview["member"] is None and rep.build_preview["builds"]["all-4-bit"]["total"] > 0


def _moe_source(tmp_path):
    src = write_small_checkpoint(tmp_path / "moe")
    rng = np.random.default_rng(0)
    extra = [("model.language_model.layers.0.experts.gate_up_proj", "BF16", (4, 128, 64),
              np.concatenate([grid_words(128, 64, rng) for _ in range(4)]).reshape(4, 128, 64))]
    # a second shard beside the first, with the index naming both
    write_safetensors(src / "model-extra.safetensors", extra)
    from safetensors import safe_open
    with safe_open(src / "model.safetensors", "np") as f:
        names = list(f.keys())
    (src / "model.safetensors").rename(src / "model-main.safetensors")
    index = {"metadata": {}, "weight_map": {**{n: "model-main.safetensors" for n in names},
                                            extra[0][0]: "model-extra.safetensors"}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src


def test_moe_expert_weights_are_refused_by_the_build_in_one_line(tmp_path, capsys):
    src = _moe_source(tmp_path)
    rep = probe_checkpoint(src)
    assert "mixture-of-experts weight [4, 128, 64]" in rep.build_preview["refused"]
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out", "--text-only", "--embed-int4")
    assert rc == 2
    one_line_error(err, "experts.gate_up_proj is a mixture-of-experts weight", "does not pack expert weights")
    assert not (tmp_path / "out").exists()


def test_refusal_helper_ignores_two_dimensional_text_tensors():
    class Info:
        shape = (64, 64)
    members.refuse_unpackable({"model.layers.0.mlp.up_proj.weight": Info()}, "x")


@pytest.mark.parametrize("name", list(MEMBERS))
def test_every_members_published_drafter_is_registered_and_named_from_its_config(name):
    m = MEMBERS[name]
    assert m.drafter and m.drafter.source and m.drafter_repo == m.source_repo + "-assistant"
    assert members.identify_drafter(m.drafter_config()) is m
    # a target's config is no drafter's: another member's drafter is never taken for this one
    assert all(members.identify_drafter_or_none(o.drafter_config()) is not m for o in MEMBERS.values() if o is not m)


@IN_PROCESS_TORCH
@pytest.mark.parametrize("name, public, unit", [("E4B", 78.518, 1e6), ("26B-A4B", 0.42, 1e9)])
def test_the_registered_drafter_shapes_give_the_publicly_counted_parameters(name, public, unit):
    """Oracle: transformers builds the drafter from the registered figures (on the meta device) and its parameter
    count is the one public sources give for Google's drafter (repack/members.py cites them), to their rounding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = MEMBERS[name].drafter_config()
    conf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    n = sum(p.numel() for p in model.parameters())
    digits = len(str(public).split(".")[1])  # the public figure's own rounding
    assert round(n / unit, digits) == public, n
