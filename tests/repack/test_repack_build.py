"""The builds on the tiny Gemma-4-shaped QAT checkpoint: values, config, towers, head, byte identity, the three
commands against the one-pass build, and oracles the project did not write (compressed-tensors' own
decompression, transformers' Gemma4ForCausalLM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from repack import choices
from repack.grid import grid
from repack.build.build import BuildOptions, build_checkpoint
from repack.params import OTHER_DTYPE_SAMPLE
from repack.source.checkpoint import open_checkpoint

from tests.helpers.fixtures import IN_PROCESS_TORCH

pytestmark = IN_PROCESS_TORCH  # the module's builds fixture, and vLLM's, compressed-tensors' and transformers' oracles
ROOT = Path(__file__).resolve().parents[2]
TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")


def _raw(info) -> bytes:
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        return f.read(info.nbytes)


def _arr(info, dtype) -> np.ndarray:
    return np.frombuffer(_raw(info), dtype=dtype).reshape(info.shape)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def builds(tiny_qat, tmp_path_factory) -> dict[str, Path]:
    """The one-pass build and the article's three steps. The first step runs as a command, the others through
    their main() in this process (each script runs as a command in test_the_article_scripts_refuse_too, `repack
    build` in test_two_real_builds_of_one_output_at_once); each prints its report."""
    import contextlib
    import io

    from repack import embed_int4, text_only
    from tools.cli import repack_cli as cli

    d = tmp_path_factory.mktemp("repack-builds")
    out = {"src": tiny_qat, "one": d / "one", "s1": d / "s1", "s2": d / "s2", "s3": d / "s3", "bf16text": d / "t"}
    r = _run("repack/repack_q4_0.py", "repack", str(tiny_qat), str(out["s1"]))
    assert r.returncode == 0, r.stderr
    assert "table" in r.stdout and "PLE" in r.stdout  # the printed report
    for main, args in ((cli.main, ["build", str(tiny_qat), str(out["one"]), "--text-only", "--embed-int4",
                                   "--embed-tokens"]),
                       (text_only.main, [str(out["s1"]), str(out["s2"])]),
                       (embed_int4.main, [str(out["s2"]), str(out["s3"]), "--embed-tokens"]),
                       (text_only.main, [str(tiny_qat), str(out["bf16text"])])):
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(args)
        assert rc == 0, stderr.getvalue()
        assert "table" in stdout.getvalue() and "PLE" in stdout.getvalue()
    return out


def test_one_pass_build_equals_the_three_steps(builds):
    a, b = open_checkpoint(builds["one"]), open_checkpoint(builds["s3"])
    assert sorted(a.tensors) == sorted(b.tensors)
    for name in a.tensors:
        assert _raw(a.tensors[name]) == _raw(b.tensors[name]), name
    assert json.loads((builds["one"] / "config.json").read_text()) == \
        json.loads((builds["s3"] / "config.json").read_text())


def test_decoded_values_match_the_source(builds):
    src, out = open_checkpoint(builds["src"]), open_checkpoint(builds["one"])
    n_checked = 0
    for name, info in src.tensors.items():
        if not name.startswith("model.language_model.") or len(info.shape) != 2:
            continue
        mod = "model." + name[len("model.language_model."):].removesuffix(".weight")
        packed = _arr(out.tensors[mod + ".weight_packed"], "<i4")
        assert out.tensors[mod + ".weight_scale"].dtype == "F16"
        scales = _arr(out.tensors[mod + ".weight_scale"], "<f2")
        assert list(_arr(out.tensors[mod + ".weight_shape"], "<i8")) == list(info.shape)
        assert packed.shape == (info.shape[0], info.shape[1] // 8)
        assert scales.shape == (info.shape[0], info.shape[1] // 32)
        words = _arr(info, "<u2")
        decoded = grid.decode(packed, scales)
        source = (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        # tiny_model's steps are fp32 values, as QAT learns them: what a T4 computes, fp16(level * scale), is
        # within 2 bf16 ulps of every source value, and many values come back exactly (-0.0 as +0.0: a level
        # has no sign of zero; the default objective, min-error, trades exact values for a lower squared error)
        assert ((words & 0x7F80) != 0x7F80).all()
        runtime = grid.runtime_values(decoded, "float16")
        ulp = np.ldexp(1.0, np.maximum((words.astype(np.int64) >> 7) & 0xFF, 1) - 134)
        assert (np.abs(runtime - source) <= 2 * ulp).all(), name
        assert (runtime == source).mean() > 0.3, name
        n_checked += 1
    assert n_checked == 53  # every linear and both embedding tables


def test_config_is_text_only_untied_and_declares_w4a16(builds):
    cfg = json.loads((builds["one"] / "config.json").read_text())
    src = json.loads((builds["src"] / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForCausalLM"] and cfg["model_type"] == "gemma4_text"
    assert "text_config" not in cfg and "vision_config" not in cfg and "audio_config" not in cfg
    assert cfg["tie_word_embeddings"] is False
    for k in ("hidden_size", "num_hidden_layers", "vocab_size", "layer_types", "num_kv_shared_layers"):
        assert cfg[k] == src["text_config"][k]
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["strategy"], w["group_size"]) == (4, "int", True, "group", 32)
    targets = qc["config_groups"]["group_0"]["targets"]
    assert set(targets) == {"Linear", "re:.*embed_tokens_per_layer$", "re:.*embed_tokens$", "re:.*lm_head$"}
    assert "lm_head" not in qc["ignore"]


def test_vllm_target_matching_selects_exactly_the_packed_modules(builds):
    """vLLM's own matcher, applied to vLLM's module names for Gemma 4, picks the intended modules only."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import (find_matched_target,
                                                                                   should_ignore_layer)

    class QKVParallelLinear: ...
    class RowParallelLinear: ...
    class VocabParallelEmbedding: ...
    class ParallelLMHead: ...
    class RMSNorm: ...

    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    for build, prefix, towers in (("one", "model.", False), ("s1", "language_model.model.", True)):
        qc = json.loads((builds[build] / "config.json").read_text())["quantization_config"]
        targets, ignore = qc["config_groups"]["group_0"]["targets"], qc["ignore"]

        def match(name, cls):
            if should_ignore_layer(name, ignore=ignore, fused_mapping=fused):
                return None
            return find_matched_target(name, cls(), targets, fused)

        assert match(prefix + "layers.0.self_attn.qkv_proj", QKVParallelLinear) == "Linear"
        assert match(prefix + "layers.3.mlp.down_proj", RowParallelLinear) == "Linear"
        assert match(prefix + "layers.0.input_layernorm", RMSNorm) is None
        if build == "one":
            assert match("model.embed_tokens_per_layer", VocabParallelEmbedding) == "re:.*embed_tokens_per_layer$"
            assert match("model.embed_tokens", VocabParallelEmbedding) == "re:.*embed_tokens$"
            assert match("lm_head", ParallelLMHead) == "re:.*lm_head$"
        else:  # step 1: embeddings and the tied head stay bf16, towers are not touched
            assert match(prefix + "embed_tokens", VocabParallelEmbedding) is None
            assert match(prefix + "embed_tokens_per_layer", VocabParallelEmbedding) is None
            assert match("language_model.lm_head", ParallelLMHead) is None
            assert match("vision_tower.encoder.layers.0.mlp.up_proj.linear", RowParallelLinear) is None
            assert match("embed_audio.embedding_projection", RowParallelLinear) is None


def test_towers_dropped_and_names_promoted(builds):
    names = open_checkpoint(builds["one"]).tensors
    assert not [n for n in names if n.startswith(TOWERS) or "language_model" in n]
    assert all(n.startswith("model.") or n.startswith("lm_head.") for n in names)


def test_head_is_untied_copy_of_the_embedding(builds):
    t = open_checkpoint(builds["one"]).tensors
    for suffix in ("weight_packed", "weight_scale", "weight_shape"):
        assert _raw(t["lm_head." + suffix]) == _raw(t["model.embed_tokens." + suffix])
    assert "lm_head.weight" not in t and "model.embed_tokens.weight" not in t


def test_untouched_tensors_are_byte_identical(builds):
    src, out, s1 = open_checkpoint(builds["src"]), open_checkpoint(builds["one"]), open_checkpoint(builds["s1"])
    n = 0
    for name, info in src.tensors.items():
        if name.startswith(TOWERS):
            assert _raw(s1.tensors[name]) == _raw(info)  # step 1 keeps the towers as they are
            continue
        if len(info.shape) != 2:  # norms and layer_scalar
            assert _raw(out.tensors["model." + name[len("model.language_model."):]]) == _raw(info)
            assert _raw(s1.tensors[name]) == _raw(info)
            n += 1
    assert n > 30


def test_step1_hard_links_unchanged_shards_and_keeps_side_files(builds):
    idx = json.loads((builds["s1"] / "model.safetensors.index.json").read_text())
    src_files = {p.name: p for p in builds["src"].glob("*.safetensors")}
    linked = [f for f in set(idx["weight_map"].values())
              if any(os.path.samefile(builds["s1"] / f, p) for p in src_files.values())]
    assert linked  # the tower-only shard of the tiny checkpoint
    rep = json.loads((builds["s1"] / "repack-report.json").read_text())
    assert rep["hardlinked_shards"] == len(linked)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "special_tokens_map.json"):
        assert (builds["one"] / f).read_bytes() == (builds["src"] / f).read_bytes()


def test_output_loads_with_the_safetensors_library(builds):
    from safetensors import safe_open

    idx = json.loads((builds["one"] / "model.safetensors.index.json").read_text())
    seen = set()
    for f in set(idx["weight_map"].values()):
        with safe_open(str(builds["one"] / f), "np") as st:
            for k in st.keys():
                if st.get_slice(k).get_dtype() != "BF16":
                    st.get_tensor(k)
                seen.add(k)
    assert seen == set(idx["weight_map"])
    total = sum(open_checkpoint(builds["one"]).tensors[k].nbytes for k in seen)
    assert idx["metadata"]["total_size"] == total


def test_report_json(builds):
    rep = json.loads((builds["one"] / "repack-report.json").read_text())
    tables = {t["name"]: t for t in rep["tables"]}
    for name in ("PLE", "embed_tokens", "lm_head", "linears"):
        t = tables[name]
        assert t["groups"] > 0 and t["offgrid_groups"] == 0
        assert t["bytes_after"] < t["bytes_before"] or name == "lm_head"
        assert t["nonfinite_values"] == 0 and 0 < t["exact_runtime_fp16"] < t["values"]
        assert t["exact_runtime_fp16_pct"] == pytest.approx(100.0 * t["exact_runtime_fp16"] / t["values"], abs=1e-3)
        assert t["max_err_ulp_bf16_runtime_fp16"] <= 2 and t["max_err_ulp_bf16_runtime_bf16"] <= 2
        assert 0 < t["rel_l2_runtime_fp16"] < 0.01 and 0 < t["mean_err_ulp_bf16_runtime_fp16"] < 1
    assert tables["towers"]["bytes_after"] == 0 and tables["towers"]["bytes_before"] > 0
    assert rep["target_dtype"] == "float16" and rep["objective"] == choices.DEFAULT_OBJECTIVE
    assert rep["scale_dtype"] == "fp16" and rep["other_dtype"] == "bfloat16"
    assert rep["wall_s"] > 0 and rep["peak_rss_bytes"] > 0 and rep["bytes_read"] > 0


def test_bf16_scale_dtype(tiny_qat, tmp_path):
    rep = build_checkpoint(tiny_qat, tmp_path / "b", BuildOptions(scale_dtype="bf16"))
    t = open_checkpoint(tmp_path / "b").tensors
    assert t["model.embed_tokens.weight_scale"].dtype == "BF16"
    lin = rep.tables["linears"]
    assert rep.target_dtype == "bfloat16" and lin.runtime("bfloat16").exact == lin.processed.exact
    assert lin.runtime("float16").exact == lin.processed.exact_other
    assert "runtime bf16 (target)" in rep.format_table()


def test_the_other_dtype_figures_say_which_values_they_are_over(tiny_qat, tmp_path):
    """The other dtype's report figures come from its sample (--other-dtype-sample): the report says how many values
    they are over, its percentages are of those, and with 0 there are none."""
    for every in (0, 1, OTHER_DTYPE_SAMPLE):
        rep = build_checkpoint(tiny_qat, tmp_path / f"s{every}", BuildOptions(other_dtype_sample=every))
        d = {t["name"]: t for t in rep.to_dict()["tables"]}["linears"]
        assert rep.to_dict()["other_dtype_sample"] == every and d["values_runtime_fp16"] == d["values"] > 0
        if every == 0:
            assert d["values_runtime_bf16"] == 0 and d["exact_runtime_bf16_pct"] is None
            assert "(not computed: --other-dtype-sample 0)" in rep.format_table()
        else:
            assert 0 < d["values_runtime_bf16"] <= d["values"] and d["values_runtime_bf16"] % 32 == 0
            assert d["exact_runtime_bf16_pct"] == pytest.approx(
                100.0 * d["exact_runtime_bf16"] / d["values_runtime_bf16"], abs=1e-3)
    assert f"sample 1 in {OTHER_DTYPE_SAMPLE}" in rep.format_table()


def test_compressed_tensors_decompresses_our_weights(builds):
    """Oracle: compressed-tensors' own config parsing and pack-quantized decompression."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    cfg = json.loads((builds["one"] / "config.json").read_text())
    scheme = QuantizationConfig.model_validate(cfg["quantization_config"]).config_groups["group_0"]
    src, out = open_checkpoint(builds["src"]), open_checkpoint(builds["one"])
    for short in ("embed_tokens_per_layer", "embed_tokens", "layers.4.mlp.down_proj", "layers.2.self_attn.k_proj",
                  "per_layer_model_projection", "layers.5.per_layer_projection"):
        mod = "model." + short
        sd = {"weight_packed": torch.from_numpy(_arr(out.tensors[mod + ".weight_packed"], "<i4").copy()),
              "weight_scale": torch.from_numpy(_arr(out.tensors[mod + ".weight_scale"], "<f2").copy()),
              "weight_shape": torch.from_numpy(_arr(out.tensors[mod + ".weight_shape"], "<i8").copy())}
        w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
        info = src.tensors["model.language_model." + short + ".weight"]
        words = _arr(info, "<u2")
        assert tuple(w.shape) == info.shape and w.dtype == torch.float16
        # their dequantisation (fp16 arithmetic) equals our exact decode rounded to fp16 ...
        ours = grid.decode(sd["weight_packed"].numpy(), sd["weight_scale"].numpy()).astype(np.float16)
        assert np.array_equal(w.numpy(), ours), short
        # ... and lands within one bf16 ulp of every finite source value
        ref = (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        finite = np.isfinite(ref)
        ulp = np.ldexp(1.0, np.maximum(((words >> 7) & 0xFF).astype(int), 1) - 134)
        assert (np.abs(w.numpy().astype(np.float64) - ref)[finite] <= ulp[finite]).all(), short


def test_transformers_loads_text_only_step_with_identical_logits(builds):
    """Oracle: transformers' Gemma4ForCausalLM on the text-only bf16 step vs the multimodal original."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    mm = Gemma4ForConditionalGeneration.from_pretrained(builds["src"], dtype=torch.bfloat16).eval()
    text = Gemma4ForCausalLM.from_pretrained(builds["bf16text"], dtype=torch.bfloat16).eval()
    ids = torch.tensor([[2, 40, 41, 42, 100, 200, 300, 17, 18]])
    with torch.no_grad():
        a = mm(input_ids=ids).logits.float()
        b = text(input_ids=ids).logits.float()
    assert a.shape == b.shape
    assert torch.equal(a, b)
    assert not torch.equal(text.lm_head.weight, torch.zeros_like(text.lm_head.weight))


def test_the_reported_peak_memory_is_the_builds_not_the_processs(tiny_qat, tmp_path):
    """A build run in a process that held more before (an MCP server's earlier builds): the report's peak is the
    build's own (two builds in one MCP server reported the same 526,860,288 bytes, the server's peak)."""
    def rss() -> int:
        with open("/proc/self/status") as fh:
            return next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith("VmRSS:"))

    big = np.ones(3 << 27, dtype=np.float32)  # 1.5 GiB, every page touched
    big += 1
    del big
    before = rss()
    rep = build_checkpoint(tiny_qat, tmp_path / "b")
    assert 0 < rep.peak_rss_bytes < before + (512 << 20), (rep.peak_rss_bytes, before)
