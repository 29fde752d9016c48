"""The family table (repack/family/members.py): every member registered with its source, a checkpoint's member read
from its config.json, an unknown layout refused in one line, and the probe saying what the build will hold per
table before anything is written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from repack.family import members
from repack.errors import RepackError
from repack.family.members import GIB, MEMBERS, by_name, identify, text_tables
from repack.build.probe import probe_checkpoint
from repack.stand_ins.synthetic import grid_words, write_safetensors, write_small_checkpoint
from tests.helpers.fixtures import IN_PROCESS_TORCH, one_line_error, repack_cli


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
    # a small mixture of experts is nearest the member with experts, not a dense one with fewer keys apart
    small = {**MEMBERS["12B"].text_config(), "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
             "moe_intermediate_size": 64}
    with pytest.raises(RepackError, match=r"nearest 26B-A4B"):
        identify({"text_config": small})


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
    four, bf16 = p["builds"]["all-4-bit"]["tables_bytes"], p["builds"]["repack-bf16-emb"]["tables_bytes"]
    # 64 x 64 tables: int4 is half a byte a value plus an fp16 scale per 32 (and a weight_shape), bf16 two bytes
    assert bf16["PLE"] == 64 * 64 * 2 and four["PLE"] < 64 * 64 * 0.6
    assert "lm_head" in four and "lm_head" not in bf16 and "towers" not in four
    assert "member: E2B" in rep.format_table()
    assert not (tmp_path / "out").exists()


def test_probe_of_a_stand_in_says_it_is_no_released_member(tmp_path):
    rep = probe_checkpoint(write_small_checkpoint(tmp_path / "src"))
    assert rep.build_preview["member"] is None and rep.build_preview["builds"]["all-4-bit"]["total_bytes"] > 0


E, MI = 4, 64  # experts and their intermediate width in the small MoE source below (hidden 64)


def _moe_source(tmp_path, *, num_experts=E, off_grid=None, extra_tensors=()):
    """The small checkpoint with layer 0's fused expert weights and router beside its dense MLP, in a second shard
    (the index naming both); off_grid=(expert, row of gate_up_proj) nudges one value of that row off the grid."""
    src = write_small_checkpoint(tmp_path / "moe")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"].update(enable_moe_block=True, num_experts=num_experts, top_k_experts=2,
                              moe_intermediate_size=MI)
    (src / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    p = "model.language_model.layers.0."
    gate_up = np.stack([grid_words(2 * MI, 64, rng) for _ in range(E)])
    if off_grid is not None:
        e, row = off_grid
        gate_up[e, row, 3] += 5
    extra = [(p + "experts.gate_up_proj", "BF16", (E, 2 * MI, 64), gate_up),
             (p + "experts.down_proj", "BF16", (E, 64, MI), np.stack([grid_words(64, MI, rng) for _ in range(E)])),
             (p + "router.proj.weight", "BF16", (E, 64), grid_words(E, 64, rng)), *extra_tensors]
    write_safetensors(src / "model-extra.safetensors", extra)
    from safetensors import safe_open
    with safe_open(src / "model.safetensors", "np") as f:
        names = list(f.keys())
    (src / "model.safetensors").rename(src / "model-main.safetensors")
    index = {"metadata": {}, "weight_map": {**{n: "model-main.safetensors" for n in names},
                                            **{x[0]: "model-extra.safetensors" for x in extra}}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return src, {x[0]: x[3] for x in extra}


def test_moe_expert_weights_are_packed_per_expert_on_their_grid(tmp_path, capsys):
    """Each expert's gate, up and down rows become a pack-quantized module of its own, as vLLM's compressed-tensors
    MoE loading reads them (experts.{e}.gate_proj ...), decoding to the source values exactly; the router stays
    bf16 and is ignored by the config; the probe says so before anything is written."""
    from repack.grid import grid
    from repack.source.checkpoint import open_checkpoint
    from repack.params import BuildOptions
    from repack.schemes import get

    src, words = _moe_source(tmp_path)
    p = probe_checkpoint(src).build_preview
    assert "refused" not in p and p["builds"]["all-4-bit"]["tables_bytes"]["experts"] < (E * 3 * MI * 64 * 2) * 0.3
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out", "--text-only", "--embed-int4")
    assert rc == 0, err
    out = open_checkpoint(tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert r"re:.*experts\.\d+\.(gate|up|down)_proj$" in cfg["config_groups"]["group_0"]["targets"]
    assert r"re:.*router\.proj$" in cfg["ignore"]
    assert out.tensors["model.layers.0.router.proj.weight"].dtype == "BF16"
    assert not any(".experts.gate_up_proj" in n or ".experts.down_proj" in n for n in out.tensors)

    def stored(mod):
        with open(out.tensors[mod + ".weight_packed"].file, "rb") as f:
            def arr(suffix, dtype):
                t = out.tensors[f"{mod}.{suffix}"]
                f.seek(t.offset)
                return np.frombuffer(f.read(t.nbytes), dtype=dtype).reshape(t.shape)
            return {"weight_packed": arr("weight_packed", "<i4"), "weight_scale": arr("weight_scale", "<f2"),
                    "weight_shape": arr("weight_shape", "<i8")}

    gate_up, down = words["model.language_model.layers.0.experts.gate_up_proj"], \
        words["model.language_model.layers.0.experts.down_proj"]
    for e in range(E):
        for proj, ref in (("gate_proj", gate_up[e, :MI]), ("up_proj", gate_up[e, MI:]), ("down_proj", down[e])):
            t = stored(f"model.layers.0.experts.{e}.{proj}")
            assert list(t["weight_shape"]) == list(ref.shape)
            # the expert's own rows, packed as a linear of that shape would be: byte for byte
            want, _ = get("w4a16").quantize_rows(np.ascontiguousarray(ref), BuildOptions(), 0)
            assert t["weight_packed"].tobytes() == want["packed"].tobytes(), (e, proj)
            assert t["weight_scale"].tobytes() == want["scale"].tobytes(), (e, proj)
            runtime = grid.runtime_values(grid.decode(t["weight_packed"], t["weight_scale"]), "float16")
            source = (ref.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            ulp = np.ldexp(1.0, np.maximum((ref.astype(np.int64) >> 7) & 0xFF, 1) - 134)
            assert (np.abs(runtime - source) <= 2 * ulp).all(), (e, proj)


def test_off_grid_expert_is_refused_naming_the_expert(tmp_path, capsys):
    src, _ = _moe_source(tmp_path, off_grid=(2, MI + 5))
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out", "--text-only")
    assert rc == 2
    one_line_error(err, "experts.gate_up_proj[expert 2, up_proj]: row 5, group 0", "off the 4-bit grid")
    assert not (tmp_path / "out").exists()


def test_expert_layouts_the_build_cannot_serve_are_refused_in_one_line(tmp_path, capsys):
    src, _ = _moe_source(tmp_path / "a", num_experts=8)
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out", "--text-only")
    assert rc == 2
    one_line_error(err, "experts.down_proj holds 4 experts, but config.json declares num_experts 8")
    src, _ = _moe_source(tmp_path / "b")
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out", "--text-only", "--scheme", "w8a8")
    assert rc == 2
    one_line_error(err, "packs mixture-of-experts weights only as w4a16")
    rng = np.random.default_rng(1)
    odd = ("model.language_model.layers.0.experts.w1", "BF16", (E, MI, 64),
           np.stack([grid_words(MI, 64, rng) for _ in range(E)]))
    src, _ = _moe_source(tmp_path / "c", extra_tensors=[odd])
    assert "experts.w1 is a mixture-of-experts weight [4, 64, 64] in a layout" in \
        probe_checkpoint(src).build_preview["refused"]
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out", "--text-only", "--embed-int4")
    assert rc == 2
    one_line_error(err, "experts.w1 is a mixture-of-experts weight", "layout this build does not know")
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
    count is the one public sources give for Google's drafter (repack/family/members.py cites them), to their
    rounding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = MEMBERS[name].drafter_config()
    conf = AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    n = sum(p.numel() for p in model.parameters())
    digits = len(str(public).split(".")[1])  # the public figure's own rounding
    assert round(n / unit, digits) == public, n
