"""Tiny stand-ins shaped as other members (repack/stand_ins/tiny_model.py SHAPES): the E4B-shaped one (2 KV heads,
single-width MLP) and the MoE-shaped one (experts beside the dense MLP, k_eq_v, no PLE) build all-4-bit, and each
build, decompressed by compressed-tensors, gives the source's logits in transformers. For the MoE this is the
proof of the expert layout: vLLM's CPU backend does not run Gemma 4's W4A16 experts (evidence/moe-tiny-cpu.md)."""

from __future__ import annotations

import json

import pytest

from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint
from repack.stand_ins.tiny_shapes import SHAPES
from tests.helpers.fixtures import repack_cli


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("family")
    # a few training steps: what these check is the layout, not what the model learned
    return {s: cached_tiny_qat_checkpoint(root / s, shape=s, train_steps=20) for s in ("e4b", "moe")}


def _decompressed_state(build):
    """The build's tensors with every packed module decompressed by compressed-tensors (float32)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open

    cfg = json.loads((build / "config.json").read_text())
    scheme = QuantizationConfig.model_validate(cfg["quantization_config"]).config_groups["group_0"]
    raw: dict[str, torch.Tensor] = {}
    for f in sorted(build.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            raw.update({k: st.get_tensor(k) for k in st.keys()})
    state: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name.endswith(".weight_packed"):
            mod = name.removesuffix(".weight_packed")
            sd = {k: raw[f"{mod}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape")}
            state[mod + ".weight"] = PackedQuantizationCompressor.decompress(sd, scheme)["weight"].float()
        elif not name.endswith((".weight_scale", ".weight_shape")):
            state[name] = t.float()
    return cfg, state


def _logits_agree(src, build, fuse_experts=False):
    """The build decompressed into transformers' Gemma4ForCausalLM gives the source's logits."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    cfg, state = _decompressed_state(build)
    if fuse_experts:
        state = _fused_experts(state, cfg["num_experts"])
    text_cfg = {k: v for k, v in cfg.items() if k != "quantization_config"}
    model = Gemma4ForCausalLM(Gemma4TextConfig(**text_cfg)).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k or k.endswith("layer_scalar") for k in missing), missing
    source = Gemma4ForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    ids = torch.tensor([[2, 40, 41, 42, 100, 200, 300, 17, 18, 19, 20, 21]])
    with torch.no_grad():
        a, b = source(input_ids=ids).logits, model(input_ids=ids).logits
    # every decoded value is the source's within one bf16 unit in the last place: the logits agree to that order
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max().item() < 0.05
    return state


def _fused_experts(state, experts):
    """The per-expert modules compressed-tensors decompressed, stacked back into the fused parameters transformers'
    Gemma4TextExperts holds: gate_up_proj [experts, 2 x inter, hidden] (each expert's gate rows, then its up rows),
    down_proj [experts, hidden, inter]."""
    import re

    import torch

    out = {k: v for k, v in state.items() if not re.search(r"\.experts\.\d+\.", k)}
    layers = {m.group(1) for k in state if (m := re.search(r"^(.*\.experts)\.\d+\.", k))}
    for base in layers:
        out[base + ".gate_up_proj"] = torch.stack([torch.cat([state[f"{base}.{e}.gate_proj.weight"],
                                                              state[f"{base}.{e}.up_proj.weight"]])
                                                   for e in range(experts)])
        out[base + ".down_proj"] = torch.stack([state[f"{base}.{e}.down_proj.weight"] for e in range(experts)])
    return out


def test_e4b_shaped_stand_in_builds_all_4_bit_and_keeps_the_sources_logits(stand_ins, tmp_path, capsys):
    src = stand_ins["e4b"].path
    tc = json.loads((src / "config.json").read_text())["text_config"]
    assert tc["num_key_value_heads"] == 2 and tc["use_double_wide_mlp"] is False
    rc, err = repack_cli(capsys, "build", src, tmp_path / "emb4", "--text-only", "--embed-int4", "--embed-tokens")
    assert rc == 0, err
    state = _logits_agree(src, tmp_path / "emb4")
    assert any(k.endswith("embed_tokens_per_layer.weight") for k in state) and "lm_head.weight" in state


def test_moe_shaped_stand_in_builds_all_4_bit_and_keeps_the_sources_logits(stand_ins, tmp_path, capsys):
    """Every expert packed int4 as its own gate/up/down module (the names vLLM's compressed-tensors MoE loading
    reads), the router kept bf16; decompressed and stacked back, the experts give the source's logits."""
    from repack.build.probe import probe_checkpoint

    src = stand_ins["moe"].path
    tc = json.loads((src / "config.json").read_text())["text_config"]
    assert tc["enable_moe_block"] and tc["num_experts"] == SHAPES["moe"]["num_experts"]
    rep = probe_checkpoint(src)
    experts = [t for t in rep.tensors if t.name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts and all(t.on_grid for t in experts) and rep.verdict == "qat"  # the experts' rows are sampled
    assert rep.build_preview["builds"]["all-4-bit"]["tables_bytes"]["experts"] > 0
    rc, err = repack_cli(capsys, "build", src, tmp_path / "emb4", "--text-only", "--embed-int4", "--embed-tokens")
    assert rc == 0, err
    report = json.loads((tmp_path / "emb4" / "repack-report.json").read_text())
    t = {x["name"]: x for x in report["tables"]}["experts"]
    assert t["offgrid_groups"] == 0 and t["groups"] == tc["num_hidden_layers"] * tc["num_experts"] * 3 * \
        tc["moe_intermediate_size"] * tc["hidden_size"] // 32
    cfg = json.loads((tmp_path / "emb4" / "config.json").read_text())
    names = json.loads((tmp_path / "emb4" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.experts.0.gate_proj.weight_packed" in names and "model.layers.0.router.proj.weight" in names
    assert r"re:.*router\.proj$" in cfg["quantization_config"]["ignore"]
    state = _logits_agree(src, tmp_path / "emb4", fuse_experts=True)
    assert "lm_head.weight" in state and not any("per_layer" in k for k in state)


def test_the_command_line_takes_the_shape_from_the_mcp_tools_model(tmp_path, capsys, monkeypatch):
    """`python -m repack.tiny_model --shape` comes from repack.params.TinyModelParams, the model the MCP tool
    make_tiny_model's signature derives from: the same choices, the shape passed to the build, another refused
    with status 2 and nothing written."""
    from repack import tiny_model as tiny_cli
    from repack.stand_ins import tiny_model
    from repack.params import TinyModelParams

    made: list[tuple[str, str]] = []
    monkeypatch.setattr(tiny_model, "cached_tiny_qat_checkpoint", lambda out, **kw: made.append(
        (out, kw["shape"])) or tiny_model.TinyModelInfo(tmp_path, 1.0, [], 0))
    assert tiny_cli.main([str(tmp_path / "a")]) == 0
    assert tiny_cli.main([str(tmp_path / "b"), "--shape", "e4b"]) == 0
    assert made == [(str(tmp_path / "a"), "e2b"), (str(tmp_path / "b"), "e4b")]
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        tiny_cli.main([str(tmp_path / "c"), "--shape", "e8b"])
    err = capsys.readouterr().err
    assert ei.value.code == 2 and "--shape" in err and "e4b" in err and not (tmp_path / "c").exists()
    assert tuple(TinyModelParams.model_fields) == ("out", "force", "shape") and len(made) == 2
    assert set(SHAPES) == set(TinyModelParams.model_fields["shape"].annotation.__args__)


def test_stand_ins_keep_the_members_order_of_size():
    """A rehearsal of a move to a bigger member moves to a bigger stand-in: the stand-ins' text parameters order as
    the members' do (E2B < E4B < 26B-A4B), counted on the meta device from the configs they are built from."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from repack.family.members import by_name, text_tables
    from repack.stand_ins.tiny_model import text_config
    from repack.stand_ins.tiny_shapes import MEMBER_OF

    def tiny(shape: str) -> int:
        with torch.device("meta"):
            model = Gemma4ForCausalLM(Gemma4TextConfig(**text_config(shape)))
        return sum(p.numel() for p in model.parameters())

    def member(shape: str) -> int:
        return sum(t.params for t in text_tables(by_name(MEMBER_OF[shape])).values())

    assert set(MEMBER_OF) == set(SHAPES)
    by_member = sorted(SHAPES, key=member)
    assert sorted(SHAPES, key=tiny) == by_member == ["e2b", "e4b", "moe"]
    sizes = [tiny(s) for s in by_member]
    assert all(b > 1.1 * a for a, b in zip(sizes, sizes[1:])), sizes  # each clearly bigger, not by a rounding
