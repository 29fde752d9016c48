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
                          "num_hidden_layers": 2, "tie_word_embeddings": True}}


def write_drafter(out: Path, *, on_grid: bool = True, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(CONFIG))
    (out / "tokenizer.json").write_text("{}")
    words = (lambda r, c: grid_words(r, c, rng)) if on_grid else (lambda r, c: random_words((r, c), rng))
    t = [(n, "BF16", s, words(*s)) for n, s in LINEARS.items()]
    t += [("model.embed_tokens.weight", "BF16", (512, 64), grid_words(512, 64, rng)),
          ("model.norm.weight", "BF16", (64,), random_words((64,), rng))]
    t += [(f"model.layers.{i}.{n}", "BF16", (k,), random_words((k,), rng))
          for i in range(2) for n, k in (("input_layernorm.weight", 64), ("layer_scalar", 1))]
    write_safetensors(out / "model.safetensors", t)
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
