"""A gemma4_assistant drafter as a repack source: recognised, probed, refused off the grid, packed as the target is.

The drafters here are numpy-made, in the tiny drafter's layout (repack.tiny_model.build_tiny_drafter): its tensor
names and shapes, values on the 4-bit grid (or not)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from repack import grid
from repack.build import BuildOptions, build_checkpoint
from repack.checkpoint import open_checkpoint
from repack.probe import probe_checkpoint
from repack.synthetic import grid_words, random_words, write_safetensors

from tests.fixtures import IN_PROCESS_TORCH, one_line_error, repack_cli

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
                          "packable": True, "line": on.drafter["line"]}
    assert "12 linear layers on the 4-bit grid, 0 off; repack packs them int4" in on.format_table()
    off = probe_checkpoint(write_drafter(tmp_path / "off", on_grid=False))
    assert off.drafter["linears_off_grid"] == 12 and not off.drafter["packable"]
    assert "not a QAT drafter: repack refuses it" in off.format_table()
    # a target is no drafter
    from repack.synthetic import write_small_checkpoint
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
    (dict(config=_config(num_hidden_layers=True)), ["text_config.num_hidden_layers is True"]),
    (dict(config=_list_model_type()), ["model_type is ['gemma4_assistant']"]),
    (dict(config=_config(per_layer_config=[{"head_dim": 64}])), ["text_config.per_layer_config is not an object"]),
    (dict(config=_config(per_layer_config={"7": {"head_dim": 64}})), ["text_config.per_layer_config has '7'"]),
    (dict(config=_config(hidden_size=128)), ["model.embed_tokens.weight has shape [512, 64]", "[512, 128]"]),
    (dict(config=_config(intermediate_size=256)), ["model.layers.0.mlp.gate_proj.weight", "[256, 64]"]),
    (dict(shapes={"model.layers.1.self_attn.q_proj.weight": (64, 64)}),
     ["model.layers.1.self_attn.q_proj.weight has shape [64, 64]", "[128, 64]"]),
    (dict(config=_config(num_attention_heads=3)), ["model.layers.0.self_attn.q_proj.weight", "[96, 64]"]),
], ids=["no-q_proj", "no-q_norm", "no-pre_projection", "no-text_config", "layers-0", "layers-5-types",
        "layers-5", "layers-1", "layers-bool", "list-model_type", "list-per_layer_config", "per_layer-key",
        "hidden", "intermediate", "q-shape", "heads"])
def test_a_damaged_drafter_is_refused_in_one_line_and_nothing_is_written(tmp_path, capsys, kwargs, needles):
    src = write_drafter(tmp_path / "src", **kwargs)
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out")
    assert rc == 2
    one_line_error(err, str(src), "damaged gemma4_assistant drafter", *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


@IN_PROCESS_TORCH
def test_the_tiny_drafters_layout_passes_the_check(tmp_path):
    """The layout check against what transformers writes for the tiny drafter (config and tensor shapes)."""
    from repack import drafter
    from repack.tiny_model import DRAFTER_TEXT_CONFIG, TEXT_CONFIG

    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    cfg = Gemma4AssistantConfig(text_config=dict(DRAFTER_TEXT_CONFIG, model_type="gemma4_text"),
                                backbone_hidden_size=int(TEXT_CONFIG["hidden_size"]))
    cfg.save_pretrained(tmp_path)
    shapes = {k: tuple(v.shape) for k, v in Gemma4AssistantForCausalLM(cfg).state_dict().items()}
    drafter.check_layout(tmp_path, json.loads((tmp_path / "config.json").read_text()), shapes)
    with pytest.raises(drafter.RepackError, match="model.layers.1.self_attn.q_proj.weight is missing"):
        drafter.check_layout(tmp_path, json.loads((tmp_path / "config.json").read_text()),
                             {k: v for k, v in shapes.items() if k != "model.layers.1.self_attn.q_proj.weight"})
