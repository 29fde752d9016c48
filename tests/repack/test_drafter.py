"""A gemma4_assistant drafter as a repack source: recognised, probed, refused off the grid, packed as the target is.

The drafters here are numpy-made, in the tiny drafter's layout (repack.stand_ins.tiny_model.build_tiny_drafter): its
tensor names and shapes, values on the 4-bit grid (or not)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from repack.grid import grid
from repack.build.build import BuildOptions, build_checkpoint
from repack.source.checkpoint import open_checkpoint
from repack.build.probe import probe_checkpoint
from repack.stand_ins.synthetic import grid_words, random_words, write_safetensors

from tests.helpers.fixtures import IN_PROCESS_TORCH, one_line_error, repack_cli

LINEARS = {
    "pre_projection.weight": (64, 256), "post_projection.weight": (128, 64),
    **{f"model.layers.{i}.{m}.weight": s for i in range(2) for m, s in (
        ("self_attn.q_proj", (64 * (i + 1), 64)), ("self_attn.o_proj", (64, 64 * (i + 1))),
        ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)), ("mlp.down_proj", (64, 128)))},
}
CONFIG = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
          "backbone_hidden_size": 128, "tie_word_embeddings": True, "dtype": "bfloat16",
          "text_config": {"model_type": "gemma4_text", "hidden_size": 64, "vocab_size": 512,
                          "num_hidden_layers": 2, "tie_word_embeddings": True, "intermediate_size": 128,
                          "num_attention_heads": 2, "head_dim": 32, "global_head_dim": None,
                          "layer_types": ["sliding_attention", "full_attention"],
                          "per_layer_config": {"1": {"head_dim": 64}}}}
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def write_drafter(out: Path, *, on_grid: bool = True, seed: int = 0, config: dict | None = None,
                  drop: tuple[str, ...] = (), shapes: dict | None = None) -> Path:
    """A drafter in the tiny drafter's layout; `config` replaces its config.json, `drop` leaves tensors out,
    `shapes` gives tensors another shape."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    (out / "tokenizer.json").write_text("{}")
    words = (lambda r, c: grid_words(r, c, rng)) if on_grid else (lambda r, c: random_words((r, c), rng))
    linears = {**LINEARS, **{n: s for n, s in (shapes or {}).items() if n in LINEARS}}
    t = [(n, "BF16", s, words(*s)) for n, s in linears.items()]
    t += [("model.embed_tokens.weight", "BF16", (512, 64), grid_words(512, 64, rng)),
          ("model.norm.weight", "BF16", (64,), random_words((64,), rng))]
    t += [(f"model.layers.{i}.{n}", "BF16", (k,), random_words((k,), rng))
          for i in range(2) for n, k in [*((f"{m}.weight", 64) for m in NORMS),
                                          ("self_attn.q_norm.weight", 32 * (i + 1)), ("layer_scalar", 1)]]
    write_safetensors(out / "model.safetensors", [x for x in t if x[0] not in drop])
    return out


def _arr(info, dtype) -> np.ndarray:
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        return np.frombuffer(f.read(info.nbytes), dtype=dtype).reshape(info.shape)


def test_a_drafter_is_recognised_and_not_taken_for_a_multimodal_checkpoint(tmp_path):
    ck = open_checkpoint(write_drafter(tmp_path / "d"))
    assert ck.drafter and not ck.multimodal  # it has a text_config, but not the multimodal layout


def test_probe_says_whether_the_drafters_linears_are_on_the_grid(tmp_path):
    on = probe_checkpoint(write_drafter(tmp_path / "on"))
    assert on.drafter == {"model_type": "gemma4_assistant", "linears_on_grid": 12, "linears_off_grid": 0,
                          "packable": True, "member": None, "line": on.drafter["line"]}
    assert "12 linear layers on the 4-bit grid, 0 off; repack packs them int4" in on.format_table()
    off = probe_checkpoint(write_drafter(tmp_path / "off", on_grid=False))
    assert off.drafter["linears_off_grid"] == 12 and not off.drafter["packable"]
    assert "not a QAT drafter: repack refuses it" in off.format_table()
    # a target is no drafter
    from repack.stand_ins.synthetic import write_small_checkpoint
    assert probe_checkpoint(write_small_checkpoint(tmp_path / "target")).drafter is None


def test_an_off_grid_drafter_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys):
    src = write_drafter(tmp_path / "off", on_grid=False)
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out")
    assert rc == 2
    one_line_error(err, str(src), "gemma4_assistant drafter", "off the 4-bit grid", "does not quantize")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["off"]


def test_a_drafter_is_not_quantized_by_another_scheme(tmp_path, capsys):
    src = write_drafter(tmp_path / "on")
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out", "--scheme", "w8a8")
    assert rc == 2
    one_line_error(err, "--scheme w4a16", "would quantize it")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("drafter")
    src = write_drafter(root / "src")
    # the library's defaults (text_only, embed_int4): a drafter keeps its layout and its bf16 embedding anyway
    build_checkpoint(src, root / "int4", BuildOptions())
    return src, root / "int4"


def test_the_packed_drafter_keeps_its_config_and_declares_the_targets_scheme(packed):
    src, out = packed
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == CONFIG  # not promoted to a text model, head still tied
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["ignore"] == ["lm_head"] and list(qc["config_groups"]) == ["group_0"]
    g = qc["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"] and g["weights"]["num_bits"] == 4 and g["weights"]["group_size"] == 32
    names = set(open_checkpoint(out).tensors)
    for n in LINEARS:
        mod = n.removesuffix(".weight")
        assert {f"{mod}.weight_packed", f"{mod}.weight_scale", f"{mod}.weight_shape"} <= names and n not in names
    src_ck, out_ck = open_checkpoint(src), open_checkpoint(out)
    for n in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.layer_scalar"):  # bf16, as they were
        assert np.array_equal(_arr(out_ck.tensors[n], "<u2"), _arr(src_ck.tensors[n], "<u2")), n


@IN_PROCESS_TORCH
def test_compressed_tensors_decompresses_the_drafters_linears_to_the_source(packed):
    """Oracle: compressed-tensors parses the config and decompresses every packed linear to the source values."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    src, out = (open_checkpoint(p) for p in packed)
    qc = QuantizationConfig.model_validate(json.loads((packed[1] / "config.json").read_text())["quantization_config"])
    scheme = qc.config_groups["group_0"]
    for n in LINEARS:
        mod = n.removesuffix(".weight")
        sd = {k: torch.from_numpy(_arr(out.tensors[f"{mod}.{k}"], dt).copy())
              for k, dt in (("weight_packed", "<i4"), ("weight_scale", "<f2"), ("weight_shape", "<i8"))}
        w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"].numpy()
        words = _arr(src.tensors[n], "<u2")
        assert w.shape == words.shape
        assert np.array_equal(w, grid.decode(sd["weight_packed"].numpy(), sd["weight_scale"].numpy())
                              .astype(np.float16)), n
        ref = (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        ulp = np.ldexp(1.0, np.maximum(((words >> 7) & 0xFF).astype(int), 1) - 134)
        assert (np.abs(w.astype(np.float64) - ref) <= ulp).all(), n


# -- a damaged drafter is refused before a byte is written ---------------------------------------------------------

def _config(**text: object) -> dict:
    cfg = json.loads(json.dumps(CONFIG))
    for k, v in text.items():
        if v is ...:
            del cfg["text_config"][k]
        else:
            cfg["text_config"][k] = v
    return cfg


def _without_text_config() -> dict:
    cfg = json.loads(json.dumps(CONFIG))
    del cfg["text_config"]
    return cfg


def _list_model_type() -> dict:
    return {**json.loads(json.dumps(CONFIG)), "model_type": ["gemma4_assistant"]}


@pytest.mark.parametrize("kwargs, needles", [
    (dict(drop=("model.layers.1.self_attn.q_proj.weight",)), ["model.layers.1.self_attn.q_proj.weight", "missing"]),
    (dict(drop=("model.layers.0.self_attn.q_norm.weight",)), ["model.layers.0.self_attn.q_norm.weight", "missing"]),
    (dict(drop=("pre_projection.weight",)), ["pre_projection.weight", "missing"]),
    (dict(config=_without_text_config()), ["config.json", "text_config is missing"]),
    (dict(config=_config(num_hidden_layers=0)), ["text_config.num_hidden_layers is 0"]),
    (dict(config=_config(num_hidden_layers=5)), ["text_config.layer_types", "num_hidden_layers"]),
    (dict(config=_config(num_hidden_layers=5, layer_types=..., per_layer_config=...)),
     ["model.layers.2.self_attn.q_proj.weight", "missing", "num_hidden_layers 5"]),
    (dict(config=_config(num_hidden_layers=1, layer_types=["sliding_attention"], per_layer_config=...)),
     ["model.layers.1.", "beyond text_config.num_hidden_layers 1"]),
    (dict(config=_list_model_type()), ["model_type is ['gemma4_assistant']"]),
    (dict(config=_config(per_layer_config=[{"head_dim": 64}])), ["text_config.per_layer_config is not an object"]),
    (dict(config=_config(per_layer_config={"7": {"head_dim": 64}})), ["text_config.per_layer_config has '7'"]),
    (dict(config=_config(hidden_size=128)), ["model.embed_tokens.weight has shape [512, 64]", "[512, 128]"]),
    (dict(config=_config(intermediate_size=256)), ["model.layers.0.mlp.gate_proj.weight", "[256, 64]"]),
    (dict(shapes={"model.layers.1.self_attn.q_proj.weight": (64, 64)}),
     ["model.layers.1.self_attn.q_proj.weight has shape [64, 64]", "[128, 64]"]),
    (dict(config=_config(num_attention_heads=3)), ["model.layers.0.self_attn.q_proj.weight", "[96, 64]"]),
], ids=["no-q_proj", "no-q_norm", "no-pre_projection", "no-text_config", "layers-0", "layers-5-types",
        "layers-5", "layers-1", "list-model_type", "list-per_layer_config", "per_layer-key",
        "hidden", "intermediate", "q-shape", "heads"])
def test_a_damaged_drafter_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, kwargs, needles):
    src = write_drafter(tmp_path / "src", **kwargs)
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out")
    assert rc == 2
    one_line_error(err, str(src), "damaged gemma4_assistant drafter", *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_drafter_shape_of_the_wrong_type_is_refused_by_the_config_reader(tmp_path, capsys):
    """A boolean where a whole number goes: refused by the one config reader (repack.family.config.validate), as for
    any checkpoint, before the drafter's own checks count with it."""
    src = write_drafter(tmp_path / "src", config=_config(num_hidden_layers=True))
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out")
    assert rc == 2
    one_line_error(err, str(src), "text_config.num_hidden_layers is True (a boolean), not a whole number")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@IN_PROCESS_TORCH
def test_the_tiny_drafters_layout_passes_the_check(tmp_path):
    """The layout check against what transformers writes for the tiny drafter (config and tensor shapes)."""
    from repack.family import drafter
    from repack.stand_ins.tiny_model import DRAFTER_TEXT_CONFIG, TEXT_CONFIG

    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    cfg = Gemma4AssistantConfig(text_config=dict(DRAFTER_TEXT_CONFIG, model_type="gemma4_text"),
                                backbone_hidden_size=int(TEXT_CONFIG["hidden_size"]))
    cfg.save_pretrained(tmp_path)
    shapes = {k: tuple(v.shape) for k, v in Gemma4AssistantForCausalLM(cfg).state_dict().items()}
    drafter.check_layout(tmp_path, json.loads((tmp_path / "config.json").read_text()), shapes)
    with pytest.raises(drafter.RepackError, match="model.layers.1.self_attn.q_proj.weight is missing"):
        drafter.check_layout(tmp_path, json.loads((tmp_path / "config.json").read_text()),
                             {k: v for k, v in shapes.items() if k != "model.layers.1.self_attn.q_proj.weight"})


# -- the family's drafters: one path, the member named, a pairing across members refused -----------------------------

def e4b_shaped_config(**over: object) -> dict:
    """A drafter shaped as E4B's (repack.family.members: what it shares with its target, backbone 2,560, the family's
    vocabulary, head sizes 256/512, 2 KV heads; a centroid-masked head as E4B's has) at a tiny draft width."""
    tc = {"model_type": "gemma4_text", "hidden_size": 32, "vocab_size": 262144, "num_hidden_layers": 2,
          "intermediate_size": 64, "num_attention_heads": 1, "num_key_value_heads": 2, "head_dim": 256,
          "global_head_dim": 512, "layer_types": ["sliding_attention", "full_attention"], "num_kv_shared_layers": 2,
          "hidden_size_per_layer_input": 0, "tie_word_embeddings": True}
    cfg = {"architectures": ["Gemma4AssistantForCausalLM"], "model_type": "gemma4_assistant",
           "backbone_hidden_size": 2560, "use_ordered_embeddings": True, "num_centroids": 2048,
           "centroid_intermediate_top_k": 32, "tie_word_embeddings": True, "dtype": "bfloat16", "text_config": tc}
    for k, v in over.items():
        (cfg if k in cfg else tc)[k] = v  # model_type: the drafter's own
    return cfg


def write_family_drafter(out: Path, config: dict, seed: int = 0) -> Path:
    """A drafter with the tensors its config declares (what repack.family.drafter.check_layout holds it to), linears and
    embedding on the 4-bit grid."""
    rng = np.random.default_rng(seed)
    tc, bb = config["text_config"], config["backbone_hidden_size"]
    h, v, inter = tc["hidden_size"], tc["vocab_size"], tc["intermediate_size"]
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text("{}")
    lin = {"pre_projection.weight": (h, 2 * bb), "post_projection.weight": (bb, h),
           "masked_embedding.centroids.weight": (config["num_centroids"], h)}
    for i, kind in enumerate(tc["layer_types"]):
        q = tc["num_attention_heads"] * (tc["global_head_dim"] if kind == "full_attention" else tc["head_dim"])
        lin.update({f"model.layers.{i}.self_attn.q_proj.weight": (q, h), f"model.layers.{i}.self_attn.o_proj.weight":
                    (h, q), f"model.layers.{i}.mlp.gate_proj.weight": (inter, h),
                    f"model.layers.{i}.mlp.up_proj.weight": (inter, h), f"model.layers.{i}.mlp.down_proj.weight":
                    (h, inter)})
    t = [(n, "BF16", s, grid_words(*s, rng)) for n, s in lin.items()]
    t += [("model.embed_tokens.weight", "BF16", (v, h), grid_words(v, h, rng)),
          ("model.norm.weight", "BF16", (h,), random_words((h,), rng)),
          ("masked_embedding.token_ordering", "I64", (v,), rng.permutation(v).astype("<i8"))]
    for i, kind in enumerate(tc["layer_types"]):
        hd = tc["global_head_dim"] if kind == "full_attention" else tc["head_dim"]
        t += [(f"model.layers.{i}.{n}", "BF16", (k,), random_words((k,), rng))
              for n, k in [*((f"{m}.weight", h) for m in NORMS), ("self_attn.q_norm.weight", hd), ("layer_scalar", 1)]]
    write_safetensors(out / "model.safetensors", t)
    return out


@pytest.fixture(scope="module")
def e4b_drafter(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("e4b-drafter")
    src = write_family_drafter(root / "src", e4b_shaped_config())
    build_checkpoint(src, root / "int4", BuildOptions())
    return src, root / "int4"


def test_an_e4b_shaped_drafter_is_named_e4b_by_the_probe(e4b_drafter):
    rep = probe_checkpoint(e4b_drafter[0])
    assert rep.drafter["member"] == "E4B" and rep.drafter["packable"]
    assert rep.build_preview["member"] == "E4B" and "drafter of Gemma 4 E4B" in rep.build_preview["layout"]
    assert "E4B's drafter; gemma4_assistant drafter: 12 linear layers on the 4-bit grid" in rep.format_table()
    assert probe_checkpoint(write_drafter(e4b_drafter[0].parent / "tiny")).drafter["member"] is None  # a stand-in


def test_an_e4b_shaped_drafter_is_packed_as_e2bs_with_its_masked_head_as_it_was(e4b_drafter):
    src, out = (open_checkpoint(p) for p in e4b_drafter)
    cfg = json.loads((e4b_drafter[1] / "config.json").read_text())
    assert cfg.pop("quantization_config")["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    assert cfg == e4b_shaped_config()
    for mod in ("pre_projection", "post_projection", "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        assert {f"{mod}.weight_packed", f"{mod}.weight_scale"} <= set(out.tensors) and f"{mod}.weight" not in out.tensors
    # vLLM's masked head is a plain nn.Linear (and a buffer): carried bf16 and int64 as the source has them
    for n, dt in (("masked_embedding.centroids.weight", "<u2"), ("masked_embedding.token_ordering", "<i8"),
                  ("model.embed_tokens.weight", "<u2")):
        assert out.tensors[n].dtype == src.tensors[n].dtype and np.array_equal(_arr(out.tensors[n], dt),
                                                                               _arr(src.tensors[n], dt)), n


@pytest.mark.parametrize("over, needles", [
    (dict(num_key_value_heads=1), ["backbone_hidden_size 2560 is E4B's", "text_config.num_key_value_heads 1 (not 2)",
                                   "google/gemma-4-E4B-it-qat-q4_0-unquantized-assistant"]),
    (dict(model_type="gemma4_unified_assistant"), ["E4B's", "model_type 'gemma4_unified_assistant'"]),
    (dict(backbone_hidden_size=2048), ["backbone_hidden_size 2048 is no member's width", "E4B 2560"]),
], ids=["kv-heads", "unified", "width"])
def test_a_drafter_claiming_the_family_at_no_members_layout_is_refused_in_one_line(tmp_path, capsys, over, needles):
    src = write_family_drafter(tmp_path / "src", e4b_shaped_config(**over))
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out")
    assert rc == 2
    one_line_error(err, str(src / "config.json"), "not a known Gemma 4 drafter layout", *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_drafter_beside_a_target_of_another_member_is_refused_naming_both(e4b_drafter, tmp_path):
    from repack.family.members import MEMBERS
    from tools.core.errors import BadInput
    from tools.serving.preflight.speculative import validate_speculative_config

    def target(name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "gemma4",
                                                   "text_config": MEMBERS[name].text_config()}))
        return d

    spec = json.dumps({"model": str(e4b_drafter[1]), "num_speculative_tokens": 3})
    with pytest.raises(BadInput) as e:
        validate_speculative_config(spec, str(target("E2B")), enforce_roots=False)
    assert "\n" not in str(e.value)
    for needle in (f"drafter {e4b_drafter[1]} is E4B's", f"target {tmp_path / 'E2B'} is Gemma 4 E2B",
                   "use E2B's drafter (google/gemma-4-E2B-it-qat-q4_0-unquantized-assistant)"):
        assert needle in str(e.value), needle
    assert e.value.detail["drafter_member"] == "E4B" and e.value.detail["target_member"] == "E2B"
    assert validate_speculative_config(spec, str(target("E4B")), enforce_roots=False)["num_speculative_tokens"] == 3


def test_the_12b_drafters_unified_layout_is_a_drafter_of_the_12b(tmp_path):
    """The 12B's drafter is a gemma4_unified_assistant (its published config, as repack/family/members.py cites it)."""
    from repack.family import drafter
    from repack.family.members import MEMBERS, identify_drafter

    cfg = {"architectures": ["Gemma4UnifiedAssistantForCausalLM"], "model_type": "gemma4_unified_assistant",
           "backbone_hidden_size": 3840, "use_ordered_embeddings": False,
           "text_config": {"model_type": "gemma4_unified_text", "hidden_size": 1024, "intermediate_size": 8192,
                           "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8,
                           "num_global_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
                           "vocab_size": 262144, "attention_k_eq_v": True}}
    assert drafter.is_drafter(cfg) and identify_drafter(cfg) is MEMBERS["12B"]
    assert drafter.is_drafter({"architectures": ["Gemma4UnifiedAssistantForCausalLM"]})


def test_planning_a_drafter_names_its_member_and_asks_for_the_target(e4b_drafter, tmp_path, capsys):
    rc, err = repack_cli(capsys, "plan", e4b_drafter[0])
    assert rc == 2
    one_line_error(err, str(e4b_drafter[0]), "E4B's speculative-decoding drafter", "plan the target", "--member E4B")
    rc, err = repack_cli(capsys, "plan", write_drafter(tmp_path / "tiny"))
    assert rc == 2
    one_line_error(err, "a speculative-decoding drafter", "--member MEMBER")
