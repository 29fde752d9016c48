"""The vLLM general plugin: its torch gather against a reference decoder, and its registration on the CPU."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import numpy as np
import pytest

from tests.helpers.fixtures import IN_PROCESS_TORCH

pytestmark = IN_PROCESS_TORCH  # torch and vLLM, imported by the tests (not at collection, on every worker)


def _pack_reference(levels: np.ndarray) -> np.ndarray:
    """Levels in [-8, 7], [rows, cols] -> int32 words [rows, cols/8]: value j in word j//8 at bits 4*(j%8)."""
    rows, cols = levels.shape
    nib = (levels + 8).astype(np.uint64).reshape(rows, cols // 8, 8)
    words = np.zeros((rows, cols // 8), dtype=np.uint64)
    for k in range(8):
        words |= nib[:, :, k] << np.uint64(4 * k)
    return words.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("groups, dtype_name", [(6, "float16"), (1, "bfloat16"), (6, "bfloat16")])
def test_gather_matches_reference(groups, dtype_name):
    import torch

    from gemma4_t4_vllm import dequant_gather_torch

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(0)
    vocab, hidden = 64, 192
    levels = rng.integers(-8, 8, size=(vocab, hidden))
    levels[3] = -8  # nibble 0 everywhere: words of zero
    levels[4] = 7   # nibble 15 everywhere: every word has its top bit set, a negative int32
    scales = rng.uniform(0.001, 0.05, size=(vocab, groups)).astype(np.float32)
    packed = torch.from_numpy(_pack_reference(levels))
    scale_t = torch.from_numpy(scales).to(dtype)
    ids = torch.tensor([[5, 3, 4], [63, 0, 5]])

    out = dequant_gather_torch(ids, packed, scale_t, hidden, 4)

    assert out.dtype == dtype and out.shape == (6, hidden)
    flat = ids.reshape(-1).numpy()
    ref_scale = scale_t.float().numpy().repeat(hidden // groups, axis=1)
    ref = (levels[flat].astype(np.float32) * ref_scale[flat])
    ref = torch.from_numpy(ref).to(dtype)
    assert torch.equal(out, ref)
    assert (packed[4] < 0).all() and (packed[3] == 0).all()


def test_gather_of_8_bit_words():
    import torch

    from gemma4_t4_vllm import dequant_gather_torch

    rng = np.random.default_rng(1)
    levels = rng.integers(-128, 128, size=(4, 64))
    words = ((levels + 128).astype(np.uint64).reshape(4, 16, 4) << (np.arange(4, dtype=np.uint64) * 8)).sum(-1)
    packed = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    scale = torch.full((4, 2), 0.5, dtype=torch.float16)
    out = dequant_gather_torch(torch.tensor([2, 1]), packed, scale, 64, 8)
    assert torch.equal(out, torch.from_numpy(levels[[2, 1]] * 0.5).half())


def test_entry_point_is_declared():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("gemma4_t4_cpu_int4_embedding") == "gemma4_t4_vllm:register", (
        "run `pip install -e .` (./setup.sh does) so vLLM loads the plugin")


def test_register_swaps_the_triton_gather_on_cpu(monkeypatch):
    import gemma4_t4_vllm
    from gemma4_t4_vllm import EMBEDDING_MODULE, dequant_gather_torch

    module = importlib.import_module(EMBEDDING_MODULE)
    original = module._dequant_gather_triton
    create = module.CompressedTensorsEmbeddingWNA16Int.create_weights
    monkeypatch.setattr(gemma4_t4_vllm, "_registered", False)
    monkeypatch.setattr(module, "_dequant_gather_triton", original)
    monkeypatch.setattr(module.CompressedTensorsEmbeddingWNA16Int, "create_weights", create)

    monkeypatch.setattr(gemma4_t4_vllm, "_on_cpu_platform", lambda: False)
    gemma4_t4_vllm.register()
    assert module._dequant_gather_triton is original  # on a GPU the plugin does nothing

    monkeypatch.setattr(gemma4_t4_vllm, "_registered", False)
    monkeypatch.setattr(gemma4_t4_vllm, "_on_cpu_platform", lambda: True)
    gemma4_t4_vllm.register()
    gemma4_t4_vllm.register()  # idempotent
    assert module._dequant_gather_triton is dequant_gather_torch
    assert getattr(module.CompressedTensorsEmbeddingWNA16Int.create_weights, "_gemma4_t4", False)


def _op_dtypes():
    import torch

    return (torch.float16, torch.bfloat16)


OP_DTYPES = _op_dtypes()


def _int4_layer(rng, n, k, groups, dtype):
    """A compressed-tensors pack-quantized linear layer as vLLM loads it (weight [out, in/8] int32 packed along
    the input, scales [out, groups]), and the float32 weight [out, in] compressed-tensors decodes it to."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    levels = torch.from_numpy(rng.integers(-8, 8, size=(n, k))).to(torch.int8)
    levels[0] = -8
    levels[1] = 7  # words with the top bit set: negative int32
    packed = pack_to_int32(levels, 4)
    assert torch.equal(unpack_from_int32(packed, 4, levels.shape), levels)
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, size=(n, groups)).astype(np.float32)).to(dtype)
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(packed, requires_grad=False)
    layer.weight_packed.input_dim = layer.weight_packed.packed_dim = 1
    layer.weight_scale = torch.nn.Parameter(scales, requires_grad=False)
    layer.weight_scale.output_dim = 0
    dense = levels.float() * scales.float().repeat_interleave(k // groups, dim=1)
    return layer, dense


def _kernel(zero_points=False):
    """The attributes of a CPUWNA16LinearKernel that its two replaced methods read."""
    from types import SimpleNamespace

    from vllm.scalar_type import scalar_types

    return SimpleNamespace(w_q_name="weight_packed", w_s_name="weight_scale", w_zp_name="weight_zero_point",
                           config=SimpleNamespace(weight_type=scalar_types.uint4b8, zero_points=zero_points))


@pytest.mark.parametrize("groups, dtype_name", [(4, "float16"), (1, "bfloat16"), (8, "float32")])
def test_the_int4_linear_computes_the_dequantized_matmul(groups, dtype_name):
    """A compressed-tensors int4 layer through the plugin's replacement of CPUWNA16LinearKernel's two steps:
    x @ W.T + bias with W the weight compressed-tensors decodes, one rounding to the input's dtype; where this
    CPU's vLLM library has the op (AVX-512 builds), the op's result on vLLM's own processing of the same layer, for
    the dtypes the op takes (VLLM_DISPATCH_16B_TYPES in csrc/cpu)."""
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel

    from gemma4_t4_vllm import wna16

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(groups)
    n, k = 96, 256
    layer, dense = _int4_layer(rng, n, k, groups, dtype)
    x = torch.from_numpy(rng.standard_normal((2, 3, k)).astype(np.float32)).to(dtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype)
    ref = (x.reshape(-1, k).float() @ dense.t() + bias.float()).to(dtype).reshape(2, 3, n)

    wna16.process_weights_after_loading(_kernel(), layer)
    out = wna16.apply_weights(_kernel(), layer, x, bias)
    assert out.shape == (2, 3, n) and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)  # float32 sums in another order; else one rounding
    if not wna16.op_missing() and dtype in OP_DTYPES:
        from vllm import _custom_ops as ops

        own, _ = _int4_layer(np.random.default_rng(groups), n, k, groups, dtype)
        own.weight_packed.data = own.weight_packed.data.t()  # GPTQ's orientation, as vLLM's own kernel reads it
        own.weight_scale.data = own.weight_scale.data.t().contiguous()
        CPUWNA16LinearKernel._process_gptq_weights_w4a16(_kernel(), own)
        real = ops.cpu_gemm_wna16(x, own.weight_packed, own.weight_scale, None, bias, 8, own.isa_hint)
        torch.testing.assert_close(real, out, rtol=2e-2, atol=2e-2)


def test_the_layer_holds_the_int4_weight_converted_once_not_a_float_copy():
    """After loading, the layer's tensors are the int4 tiles (uint8, half a byte a weight) and its 16-bit scales:
    the packed int32 words are replaced, not kept beside them, and no float weight exists; a forward leaves them
    as they are. Asymmetric layers are refused with what to do."""
    import torch

    from gemma4_t4_vllm import int4_matmul, wna16

    rng = np.random.default_rng(3)
    n, k, groups = 128, 512, 16
    layer, dense = _int4_layer(rng, n, k, groups, torch.float16)
    wna16.process_weights_after_loading(_kernel(), layer)
    tensors = {name: t for name, t in layer.state_dict(keep_vars=True).items()}
    assert sorted(tensors) == ["weight_packed", "weight_scale"]
    tiles, scales = tensors["weight_packed"], tensors["weight_scale"]
    assert tiles.dtype == torch.uint8 and tiles.shape == (n // 64, k // 2, 64)
    assert scales.dtype == torch.float16 and scales.shape == (groups, n) and scales.is_contiguous()
    assert sum(t.numel() * t.element_size() for t in tensors.values()) == n * k // 2 + groups * n * 2
    assert torch.equal(int4_matmul.dequantize(tiles.data, scales.data), dense.t())
    before = tiles.data.clone()
    wna16.apply_weights(_kernel(), layer, torch.ones(1, k, dtype=torch.float16))
    assert torch.equal(layer.weight_packed.data, before) and layer.weight_packed.dtype == torch.uint8
    with pytest.raises(NotImplementedError, match="zero points.*serve a symmetric build"):
        wna16.process_weights_after_loading(_kernel(zero_points=True), _int4_layer(rng, n, k, groups,
                                                                                   torch.float16)[0])


@pytest.mark.parametrize("missing", [True, False], ids=["op-missing", "op-present"])
def test_register_puts_the_int4_matmul_in_place_only_where_the_op_is_missing(monkeypatch, missing):
    """Both decisions on any machine: the op's absence (an AVX2 library) or presence (AVX-512) is set by the test; where
    present, CPUWNA16LinearKernel keeps vLLM's own methods (and so vLLM's op)."""
    import gemma4_t4_vllm
    from gemma4_t4_vllm import wna16
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel as kernel

    def vllms_own(*args):  # stands for vLLM's methods, whatever an earlier register() in this process did
        raise AssertionError("not called")

    own = ("process_weights_after_loading", "apply_weights")
    for name in own:  # the real methods come back after the test
        monkeypatch.setattr(kernel, name, vllms_own)
    vllms = dict.fromkeys(own, vllms_own)
    monkeypatch.setattr(wna16, "op_missing", lambda: missing)
    monkeypatch.setattr(gemma4_t4_vllm, "_on_cpu_platform", lambda: True)
    monkeypatch.setattr(gemma4_t4_vllm, "_registered", False)
    gemma4_t4_vllm.register()
    expected = ({"process_weights_after_loading": wna16.process_weights_after_loading,
                 "apply_weights": wna16.apply_weights} if missing else vllms)
    assert {name: getattr(kernel, name) for name in own} == expected
    assert wna16.install() is False  # a second install changes nothing either way
    assert {name: getattr(kernel, name) for name in own} == expected
