"""The build schemes: the registry, each scheme's quantize/dequantize pair against a plain reference and
compressed-tensors' own code, the W8A8 build of the tiny model (layout, config, report), and that build served by
vLLM's CPU int8 kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from repack.grid import grid
from repack import schemes
from repack.build.build import BuildOptions, build_checkpoint
from repack.source.checkpoint import open_checkpoint
from repack.errors import RepackError

from tests.helpers.fixtures import IN_PROCESS_TORCH

ROOT = Path(__file__).resolve().parents[2]


def _words(x: np.ndarray) -> np.ndarray:
    """float -> bf16 words (round to nearest even)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _values(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _arr(info, dtype) -> np.ndarray:
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        return np.frombuffer(f.read(info.nbytes), dtype=dtype).reshape(info.shape)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


# --------------------------------------------------------------------------------------------------------------
# The registry


def test_registry_names_and_lookups():
    assert {"w4a16", "w8a8"} <= set(schemes.names()) and schemes.DEFAULT == "w4a16"
    assert BuildOptions().scheme == "w4a16"
    assert schemes.for_table("w8a8", "linears").name == "w8a8"
    for table in ("PLE", "embed_tokens", "lm_head"):  # the int4 embeddings of the W8A8 build
        assert schemes.for_table("w8a8", table).name == "w4a16"
        assert schemes.for_table("w4a16", table).name == "w4a16"
    with pytest.raises(RepackError, match="scheme 'w3a5': unknown build scheme; choose one of w4a16, w8a8") as e:
        BuildOptions(scheme="w3a5")
    assert e.value.detail["option"] == "--scheme" and e.value.detail["choices"] == schemes.names()


def test_command_line_refuses_an_unknown_scheme(tmp_path):
    r = _run("-m", "repack", "build", str(tmp_path / "src"), str(tmp_path / "out"), "--scheme", "w3a5")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --scheme 'w3a5': unknown build scheme; choose one of w4a16, w8a8"]
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------------------------------
# quantize / dequantize


def _w8a8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row by row, value by value: scale = max|x| / 127, q = round half to even of x / scale."""
    q = np.zeros(x.shape, dtype=np.int8)
    s = np.zeros((x.shape[0], 1), dtype=np.float32)
    for r, row in enumerate(x):
        amax = max((abs(float(v)) for v in row if np.isfinite(v)), default=0.0)
        s[r, 0] = np.float32(amax / 127) if amax > 0 else np.float32(1.0)
        for c, v in enumerate(row):
            q[r, c] = 0 if not np.isfinite(v) else int(np.round(float(v) / float(s[r, 0])))
    return q, s


def test_w8a8_round_trip_matches_a_plain_reference():
    W8A8 = schemes.get("w8a8")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 64)) * np.exp(rng.uniform(-8, 4, (12, 1)))
    x[3] = 0.0                           # an all-zero row
    x[4, :5] = [np.nan, np.inf, -np.inf, 1e-3, -2e-3]
    x[5] = -x[5]
    x[5, 7] = -50 * np.abs(x[5]).max()   # a negative peak
    words = _words(x)
    q, s = W8A8.quantize_blocks(words)
    ref_q, ref_s = _w8a8_reference(_values(words))
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (12, 1)
    assert np.array_equal(q, ref_q) and np.array_equal(s, ref_s)
    assert np.abs(q).max(axis=1).tolist() == [0 if r == 3 else 127 for r in range(12)]  # peaks at +-127
    assert q[5, 7] == -127
    dec = W8A8.dequantize_blocks(q, s)
    v = _values(words)
    finite = np.isfinite(v)
    # round to nearest: every finite value within half a step of its decode
    assert (np.abs(dec - np.where(finite, v, 0))[finite] <= (s.astype(np.float64) / 2 * np.ones_like(v))[finite]
            * (1 + 1e-12)).all()
    assert (dec[~finite] == 0).all() and (dec[3] == 0).all()


def test_w4a16_round_trip_delegates_to_the_grid():
    W4A16 = schemes.get("w4a16")
    rng = np.random.default_rng(1)
    levels = rng.integers(-8, 8, (40, 32))
    levels[:, 0] = 7
    step = np.exp(rng.uniform(-10, -2, (40, 1))).astype(np.float16).astype(np.float64)  # fp16-representable
    words = _words(step * levels)  # bf16(step * level): on the grid, as QAT leaves it
    packed, scales = W4A16.quantize_blocks(words)
    assert packed.shape == (40, 4) and packed.dtype == np.int32 and scales.shape == (40, 1)
    ref_packed, ref_scales, _ = grid.quantize_numpy(words)
    assert np.array_equal(packed, ref_packed) and np.array_equal(scales, ref_scales)
    dec = W4A16.dequantize_blocks(packed, scales)
    assert np.array_equal(dec, grid.decode(ref_packed, ref_scales))
    # in the target's runtime arithmetic (fp16 of level x scale) every value is within one bf16 ulp of the source
    src = _values(words)
    runtime = dec.astype(np.float16).astype(np.float64)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(src), 1e-30))) - 7)
    assert np.all(np.abs(runtime - src) <= ulp)


@IN_PROCESS_TORCH
def test_w8a8_compressed_tensors_quantize_and_decompress_agree():
    """Oracle: compressed-tensors' int-quantized compressor, given our scales, quantizes to our int8 values, and its
    decompression equals our dequantized weights."""
    import torch
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    W8A8 = schemes.get("w8a8")
    group = W8A8.config_group(["linears"])
    scheme = QuantizationScheme.model_validate({k: v for k, v in group.items() if k != "format"})
    rng = np.random.default_rng(2)
    words = _words(rng.standard_normal((64, 96)) * 0.05)
    q, s = W8A8.quantize_blocks(words)
    w = torch.from_numpy(_values(words).astype(np.float32))
    theirs = IntQuantizationCompressor.compress({"weight": w, "weight_scale": torch.from_numpy(s)}, scheme)["weight"]
    assert theirs.dtype == torch.int8
    # They divide in float32, which can round x / scale onto a .5 tie and then to the farther level; the division
    # in float64 picks the nearer one. Everywhere else the levels are the same.
    differ = theirs.numpy() != q
    assert differ.mean() < 0.01
    x = _values(words)
    ratio32 = (x.astype(np.float32) / s)[differ]
    assert (np.abs(ratio32 - np.trunc(ratio32)) == 0.5).all()
    err = lambda levels: np.abs(levels.astype(np.float64) * s.astype(np.float64) - x)[differ]  # noqa: E731
    assert (err(q) < err(theirs.numpy())).all()
    out = IntQuantizationCompressor.decompress({"weight": torch.from_numpy(q), "weight_scale": torch.from_numpy(s)},
                                               scheme)["weight"]
    assert out.dtype == torch.float32
    assert np.array_equal(out.numpy(), W8A8.dequantize_blocks(q, s).astype(np.float32))


# --------------------------------------------------------------------------------------------------------------
# The W8A8 build of the tiny model


@pytest.fixture(scope="module")
def w8a8_build(tiny_qat, tmp_path_factory) -> Path:
    """The article's W8A8 build, through the command line's main() in this process: int8 linears, int4 embeddings
    and untied int4 head, text only."""
    import contextlib
    import io

    from tools.cli import repack_cli as cli

    out = tmp_path_factory.mktemp("w8a8") / "gemma-4-tiny-text-w8a8"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = cli.main(["build", str(tiny_qat), str(out), "--scheme", "w8a8", "--text-only", "--embed-int4",
                       "--embed-tokens"])
    assert rc == 0, stderr.getvalue()
    assert "w8a8:" in stdout.getvalue() and "snr_db" in stdout.getvalue()  # the scheme's own report section
    return out


@IN_PROCESS_TORCH
def test_w8a8_build_layout(w8a8_build, tiny_qat):
    src, out = open_checkpoint(tiny_qat), open_checkpoint(w8a8_build)
    t = out.tensors
    linears = [n[len("model.language_model."):-len(".weight")] for n, i in src.tensors.items()
               if n.startswith("model.language_model.") and n.endswith(".weight") and len(i.shape) == 2
               and "embed_tokens" not in n]
    assert len(linears) > 20
    for mod in linears:
        info = src.tensors[f"model.language_model.{mod}.weight"]
        assert t[f"model.{mod}.weight"].dtype == "I8" and t[f"model.{mod}.weight"].shape == info.shape, mod
        assert t[f"model.{mod}.weight_scale"].dtype == "F32" and t[f"model.{mod}.weight_scale"].shape == (
            info.shape[0], 1)
        assert f"model.{mod}.weight_packed" not in t and f"model.{mod}.weight_zero_point" not in t
    for mod in ("model.embed_tokens", "model.embed_tokens_per_layer", "lm_head"):  # int4 via the grid
        assert t[f"{mod}.weight_packed"].dtype == "I32" and t[f"{mod}.weight_scale"].dtype == "F16"
    assert not any(n.startswith(("model.vision_tower", "model.audio_tower", "model.language_model")) for n in t)


@IN_PROCESS_TORCH
def test_w8a8_config_is_matched_by_vllm_as_int8_and_int4(w8a8_build):
    """vLLM's own config parsing and scheme matching: the linears get CompressedTensorsW8A8Int8 with per-channel
    weights and dynamic per-token symmetric inputs; the embedding tables and head keep their int4 schemes."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import \
        CompressedTensorsConfig
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (CompressedTensorsW8A8Int8,
                                                                                     CompressedTensorsWNA16)

    cfg = json.loads((w8a8_build / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["architectures"] == ["Gemma4ForCausalLM"]
    qc = cfg["quantization_config"]
    assert qc["format"] == "mixed-precision" and qc["ignore"] == []
    groups = {tuple(g["targets"]): g for g in qc["config_groups"].values()}
    assert set(groups) == {("Linear",), ("re:.*embed_tokens_per_layer$", "re:.*embed_tokens$", "re:.*lm_head$")}
    assert groups[("Linear",)]["format"] == "int-quantized"
    ct = CompressedTensorsConfig.from_config(qc)

    class RowParallelLinear: ...

    s = ct.get_scheme(RowParallelLinear(), layer_name="model.layers.0.mlp.down_proj")
    assert isinstance(s, CompressedTensorsW8A8Int8)
    assert s.strategy == "channel" and not s.is_static_input_scheme and s.input_symmetric

    class ParallelLMHead: ...

    assert isinstance(ct.get_scheme(ParallelLMHead(), layer_name="lm_head"), CompressedTensorsWNA16)


@IN_PROCESS_TORCH
def test_w8a8_weights_decompress_with_compressed_tensors(w8a8_build, tiny_qat):
    """Oracle: compressed-tensors parses the written config and decompresses the stored int8 weights to exactly our
    decode, which is within half a step of every source value."""
    import torch
    from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    W8A8 = schemes.get("w8a8")
    qc = QuantizationConfig.model_validate(json.loads((w8a8_build / "config.json").read_text())["quantization_config"])
    scheme = next(g for g in qc.config_groups.values() if g.targets == ["Linear"])
    src, out = open_checkpoint(tiny_qat), open_checkpoint(w8a8_build)
    for short in ("layers.4.mlp.down_proj", "layers.2.self_attn.q_proj", "per_layer_model_projection",
                  "layers.5.per_layer_input_gate"):
        q = _arr(out.tensors[f"model.{short}.weight"], "i1")
        s = _arr(out.tensors[f"model.{short}.weight_scale"], "<f4")
        w = IntQuantizationCompressor.decompress({"weight": torch.from_numpy(q.copy()),
                                                  "weight_scale": torch.from_numpy(s.copy())}, scheme)["weight"]
        ours = W8A8.decode({"weight": q, "weight_scale": s})
        assert np.array_equal(w.numpy(), ours.astype(np.float32)), short
        ref = _values(_arr(src.tensors[f"model.language_model.{short}.weight"], "<u2"))
        assert (np.abs(ours - ref) <= s.astype(np.float64) / 2 * (1 + 1e-12)).all(), short


@IN_PROCESS_TORCH
def test_w8a8_report_has_its_own_columns(w8a8_build):
    rep = json.loads((w8a8_build / "repack-report.json").read_text())
    assert rep["scheme"] == "w8a8" and rep["options"]["scheme"] == "w8a8"
    (lin,) = rep["scheme_tables"]["w8a8"]
    assert lin["name"] == "linears" and lin["values"] > 0 and lin["nonfinite_values"] == 0
    # int8 of 4-bit-grid weights: small but nonzero error, far above the 4-bit grid's exact recovery
    assert 0 < lin["max_abs_error"] and 0 < lin["rel_l2_error"] < 0.01 and 40 < lin["snr_db"] < 80
    tables = {t["name"]: t for t in rep["tables"]}
    assert tables["linears"]["groups"] == 0  # the grid's exactness figures do not apply to int8
    assert tables["PLE"]["groups"] > 0 and tables["PLE"]["exact_runtime_fp16_pct"] is not None  # the int4 tables keep them
    assert tables["linears"]["bytes_after"] < tables["linears"]["bytes_before"] * 0.52


def test_w8a8_needs_no_grid_for_the_linears(tmp_path):
    """The int8 linears are computed from any bf16 values: a linear off the 4-bit grid builds with w8a8 (and stops
    the w4a16 build), while an int4 table off the grid still stops a w8a8 build at its first off-grid group."""
    from repack.errors import OffGridError
    from repack.stand_ins.synthetic import write_small_checkpoint

    lin = write_small_checkpoint(tmp_path / "lin", off_grid=("model.language_model.layers.0.mlp.up_proj.weight", 1, 0))
    with pytest.raises(OffGridError, match="up_proj"):
        build_checkpoint(lin, tmp_path / "a", BuildOptions(embed_int4=False, embed_tokens=False))
    rep = build_checkpoint(lin, tmp_path / "b", BuildOptions(scheme="w8a8", embed_int4=False, embed_tokens=False))
    assert rep.scheme_tables["w8a8"]["linears"].values == 2 * (64 * 64 + 128 * 64 + 64 * 128) + 64 * 64
    qc = json.loads((tmp_path / "b" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized" and qc["ignore"] == ["lm_head"]
    emb = write_small_checkpoint(tmp_path / "emb", off_grid=("model.language_model.embed_tokens.weight", 2, 1))
    with pytest.raises(OffGridError, match="embed_tokens"):
        build_checkpoint(emb, tmp_path / "c", BuildOptions(scheme="w8a8", embed_int4=True, embed_tokens=True))
    assert not (tmp_path / "c").exists()


def test_w8a8_steps_keep_the_int8_group(tmp_path):
    """A multimodal W8A8 step ignores the towers; a later text-only step carries the int8 linears and their config
    group unchanged, and a later int4-embedding step adds the int4 group beside it."""
    from repack.stand_ins.synthetic import write_small_checkpoint

    src = write_small_checkpoint(tmp_path / "src")
    s1, s2, s3 = tmp_path / "s1", tmp_path / "s2", tmp_path / "s3"
    build_checkpoint(src, s1, BuildOptions(scheme="w8a8", text_only=False, embed_int4=False, embed_tokens=False))
    build_checkpoint(s1, s2, BuildOptions(quantize_linears=False, text_only=True, embed_int4=False,
                                          embed_tokens=False))
    build_checkpoint(s2, s3, BuildOptions(quantize_linears=False, text_only=False, embed_int4=True,
                                          embed_tokens=True))
    one = tmp_path / "one"
    build_checkpoint(src, one, BuildOptions(scheme="w8a8", text_only=True, embed_int4=True, embed_tokens=True))
    qc1 = json.loads((s1 / "config.json").read_text())["quantization_config"]
    assert qc1["format"] == "int-quantized" and "re:.*vision_tower.*" in qc1["ignore"]
    qc2 = json.loads((s2 / "config.json").read_text())["quantization_config"]
    assert qc2["config_groups"] == qc1["config_groups"] and qc2["ignore"] == ["lm_head"]
    assert open_checkpoint(s2).tensors["model.layers.0.mlp.up_proj.weight"].dtype == "I8"
    qc3 = json.loads((s3 / "config.json").read_text())["quantization_config"]
    qc_one = json.loads((one / "config.json").read_text())["quantization_config"]
    assert qc3["format"] == "mixed-precision" and len(qc3["config_groups"]) == 2
    assert qc3["config_groups"] == qc_one["config_groups"]  # the same groups, in the same order, as in one pass


# --------------------------------------------------------------------------------------------------------------
# Served by vLLM's CPU backend


@pytest.mark.vllm
@pytest.mark.vllm_lane(1)  # starts its own server, beside the walk and the drafter table
def test_w8a8_build_serves_on_the_cpu_int8_kernel(w8a8_build, serve_config_factory, monkeypatch):
    import httpx

    from tests.helpers.fixtures import in_process_engine, require_plugin
    from repack.stand_ins.tiny_model import pattern_permutation
    from tools.serving.server.server import start_server
    from tools.serving.server.server import stop_server

    require_plugin()
    in_process_engine(monkeypatch)
    cfg = serve_config_factory(w8a8_build, "gemma-4-tiny-text-w8a8")
    started = start_server(cfg)
    try:
        log = Path(started.log_path).read_text(errors="replace")
        assert "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8" in log
        perm = pattern_permutation(0).tolist()
        wrong = 0
        for start in (40, 101, 333):
            prompt = [start]
            for _ in range(7):
                prompt.append(perm[prompt[-1]])
            r = httpx.post(f"{cfg.base_url}/v1/completions", timeout=120, json={
                "model": cfg.served_name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            ids = r.json()["choices"][0]["token_ids"]
            expect = [perm[prompt[-1]]]
            for _ in range(7):
                expect.append(perm[expect[-1]])
            assert len(ids) == 8
            wrong += sum(a != b for a, b in zip(ids, expect))
        assert wrong == 0  # the trained pattern continues under int8 weights and activations
    finally:
        stop_server(cfg)


@pytest.mark.parametrize("bad", [0x7FC0, 0xFF80])  # NaN, -inf
def test_w8a8_build_refuses_a_nonfinite_weight(tmp_path, capsys, bad):
    """No int8 level represents NaN or an infinity: the build stops naming tensor, row and column, writes
    nothing, and the command line says so in one line with exit 2."""
    from repack.errors import RepackError
    from repack.stand_ins.synthetic import grid_words, write_small_checkpoint

    name = "model.language_model.layers.1.mlp.up_proj.weight"
    w = grid_words(128, 64, np.random.default_rng(3))
    w[77, 40] = bad
    src = write_small_checkpoint(tmp_path / "src", extra={name: ("BF16", (128, 64), w)})
    with pytest.raises(RepackError, match=r"up_proj.weight: row 77, column 40 holds a NaN or an infinity"):
        build_checkpoint(src, tmp_path / "out", BuildOptions(scheme="w8a8", embed_int4=False, embed_tokens=False))
    assert not (tmp_path / "out").exists()
    from tools.cli import repack_cli as cli

    rc = cli.main(["build", str(src), str(tmp_path / "out2"), "--scheme", "w8a8"])  # the command, in-process
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "row 77, column 40" in err
    assert not (tmp_path / "out2").exists()


def test_a_scheme_is_refused_for_linears_already_packed_otherwise(tmp_path, capsys):
    """An int4 build as the source of a w8a8 one: its linears would be carried int4 under a w8a8 report."""
    from repack.stand_ins.synthetic import write_small_checkpoint

    from tests.helpers.fixtures import one_line_error, repack_cli

    src = write_small_checkpoint(tmp_path / "src")
    int4 = tmp_path / "int4"
    build_checkpoint(src, int4, BuildOptions(text_only=False, embed_int4=False, embed_tokens=False))
    rc, err = repack_cli(capsys, "build", int4, tmp_path / "w8", "--scheme", "w8a8")
    assert rc == 2
    one_line_error(err, "already packed", "weight_packed", "--scheme w8a8", "bf16")
    assert not (tmp_path / "w8").exists()
    # what the source holds is what the default scheme writes: the later steps carry it
    rc, err = repack_cli(capsys, "build", int4, tmp_path / "again")
    assert rc == 0, err
