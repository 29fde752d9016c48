"""The vLLM general plugin: its torch gather against a reference decoder, and its registration on the CPU."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import numpy as np
import pytest

from tests.fixtures import IN_PROCESS_TORCH

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


@pytest.mark.parametrize("groups, dtype_name", [(4, "float16"), (1, "bfloat16"), (8, "float32")])
def test_the_torch_wna16_gemm_computes_the_dequantized_matmul(groups, dtype_name):
    """A compressed-tensors pack-quantized weight, put in CPUWNA16's layout by vLLM's own repacking, multiplied by
    gemma4_t4_vllm.wna16: x @ W.T with W the weight compressed-tensors unpacks, within the input dtype's rounding;
    where this CPU's vLLM library has the op (AVX-512 builds), the op's result too, for the dtypes the op takes:
    its kernel dispatches on float16 and bfloat16 only (VLLM_DISPATCH_16B_TYPES in csrc/cpu), so float32 is checked
    through the torch path alone."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from types import SimpleNamespace
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
    from vllm.scalar_type import scalar_types

    from gemma4_t4_vllm import wna16

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(groups)
    n, k = 96, 256
    levels = torch.from_numpy(rng.integers(-8, 8, size=(n, k))).to(torch.int8)
    levels[0] = -8
    levels[1] = 7  # words with the top bit set: negative int32
    packed = pack_to_int32(levels, 4)  # compressed-tensors' layout: [out, in/8], packed along the input
    assert torch.equal(unpack_from_int32(packed, 4, levels.shape), levels)
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, size=(n, groups)).astype(np.float32)).to(dtype)
    dense = levels.float() * scales.float().repeat_interleave(k // groups, dim=1)  # [out, in]

    # What CPUWNA16LinearKernel.process_weights_after_loading does to a symmetric layer (no zero points)
    layer = torch.nn.Module()
    layer.weight_packed = torch.nn.Parameter(packed.t(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scales.t().contiguous(), requires_grad=False)
    kernel = SimpleNamespace(w_q_name="weight_packed", w_s_name="weight_scale",
                             config=SimpleNamespace(weight_type=scalar_types.uint4b8))
    CPUWNA16LinearKernel._process_gptq_weights_w4a16(kernel, layer)

    x = torch.from_numpy(rng.standard_normal((2, 3, k)).astype(np.float32)).to(dtype)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype)
    assert torch.equal(wna16.dequantize(layer.weight_packed, layer.weight_scale, 8), dense.t())
    out = wna16.gemm_wna16(x, layer.weight_packed, layer.weight_scale, None, bias, 8, layer.isa_hint)
    ref = (x.reshape(-1, k).float() @ dense.t() + bias.float()).to(dtype).reshape(2, 3, n)
    assert out.shape == (2, 3, n) and out.dtype == dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)  # float32 sums in another order; else one rounding
    if not wna16.op_missing() and dtype in OP_DTYPES:
        from vllm import _custom_ops as ops

        real = ops.cpu_gemm_wna16(x, layer.weight_packed, layer.weight_scale, None, bias, 8, layer.isa_hint)
        torch.testing.assert_close(real, out, rtol=2e-2, atol=2e-2)
    with pytest.raises(NotImplementedError, match="zero points"):
        wna16.gemm_wna16(x, layer.weight_packed, layer.weight_scale, layer.weight_scale, None, 8, "vec")
    # a slice of output channels at a time (the whole weight is never dequantized at once): 6 blocks of 16
    # channels in slices of 4 (the last one short), the same result
    import unittest.mock

    whole, slices = wna16.dequantize, []
    with unittest.mock.patch.object(wna16, "CHUNK_BYTES", k * 16 * 4 * 4), \
            unittest.mock.patch.object(wna16, "dequantize", lambda q, *a: slices.append(q.shape[0]) or whole(q, *a)):
        sliced = wna16.gemm_wna16(x, layer.weight_packed, layer.weight_scale, None, bias, 8, layer.isa_hint)
    assert slices == [4, 2]
    torch.testing.assert_close(sliced, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("missing", [True, False], ids=["op-missing", "op-present"])
def test_register_puts_the_torch_gemm_in_place_only_where_the_op_is_missing(monkeypatch, missing):
    """Both decisions on any machine: the op's absence (an AVX2 library) or presence (AVX-512) is faked."""
    import gemma4_t4_vllm
    from gemma4_t4_vllm import wna16
    from vllm import _custom_ops as ops

    def vllms_own(*args):  # stands for the library's op: whatever this machine's library has
        raise AssertionError("not called")

    monkeypatch.setattr(ops, "cpu_gemm_wna16", vllms_own)  # the real attribute comes back after the test
    monkeypatch.setattr(wna16, "op_missing", lambda: missing)
    monkeypatch.setattr(gemma4_t4_vllm, "_on_cpu_platform", lambda: True)
    monkeypatch.setattr(gemma4_t4_vllm, "_registered", False)
    gemma4_t4_vllm.register()
    assert ops.cpu_gemm_wna16 is (wna16.gemm_wna16 if missing else vllms_own)
    assert wna16.install() is False  # a second install changes nothing either way
    assert ops.cpu_gemm_wna16 is (wna16.gemm_wna16 if missing else vllms_own)
