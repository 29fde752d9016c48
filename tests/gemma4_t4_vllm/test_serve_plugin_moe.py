"""The vLLM plugin's WNA16 MoE fallback (gemma4_t4_vllm/moe_wna16.py) on the CPU: vLLM's own selection refuses
Gemma 4's gelu_tanh int4 experts, the fallback takes them, keeps them int4 (no dequantized copy), and its kernel,
built and called the way vLLM's compressed-tensors WNA16 MoE method builds and calls it, computes the routed
experts of the weights the int4 levels and scales decode to."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers.fixtures import IN_PROCESS_TORCH

pytestmark = IN_PROCESS_TORCH  # torch and vLLM, imported by the tests (not at collection, on every worker)

E, TOP_K, HIDDEN, INTER, GROUP = 4, 2, 128, 64, 32  # the MoE stand-in's experts (repack.tiny_model --shape moe)
NAMES = ("select_wna16_moe_backend", "convert_to_wna16_moe_kernel_format", "make_wna16_moe_kernel")


@pytest.fixture
def method_module(monkeypatch):
    """The compressed-tensors WNA16 MoE method's module with vLLM's own three oracle functions in it (restored
    after the test, whether or not a register() earlier in the process wrapped them)."""
    from gemma4_t4_vllm import moe_wna16

    module = importlib.import_module(moe_wna16.METHOD_MODULE)
    for name in NAMES:
        current = getattr(module, name)
        monkeypatch.setattr(module, name, getattr(current, "__wrapped__", current))
    return module


def _moe_config(activation, dtype):
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)

    return FusedMoEConfig(num_experts=E, experts_per_token=TOP_K, hidden_dim=HIDDEN, intermediate_size=INTER,
                          num_local_experts=E, num_logical_experts=E, activation=activation, device="cpu",
                          routing_method=RoutingMethodType.Renormalize,
                          moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=dtype)


def _select_args(activation, dtype):
    from compressed_tensors.quantization import QuantizationArgs
    from vllm.model_executor.layers.quantization.utils.quant_utils import kInt4Static32

    # What CompressedTensorsWNA16MoEMethod.__init__ passes for the build's experts (symmetric int4, group 32).
    quant = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
    return dict(config=_moe_config(activation, dtype), weight_key=kInt4Static32, quant_config=quant,
                may_have_zp=False, may_have_bias=False, allow_tile_padding=True)


def _packed_experts(rng, rows, cols, dtype):
    """E experts [rows, cols] on the int4 grid, packed as compressed-tensors packs each expert's linear:
    (int32 [E, rows, cols/8], scales [E, rows, cols/GROUP], the float32 weights they decode to)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    levels = torch.from_numpy(rng.integers(-8, 8, size=(E, rows, cols))).to(torch.int8)
    levels[:, 0] = -8  # words with the top bit set: negative int32
    packed = torch.stack([pack_to_int32(levels[e], 4) for e in range(E)])
    scales = torch.from_numpy(rng.uniform(0.01, 0.05, size=(E, rows, cols // GROUP)).astype(np.float32)).to(dtype)
    dense = levels.float() * scales.float().repeat_interleave(GROUP, dim=-1)
    return packed, scales, dense


def _reference(x, topk_weights, topk_ids, w13, w2, act):
    """The routed experts in float32: sum over the top k of weight * down(act(gate x) * up x)."""
    import torch

    out = []
    for t in range(x.shape[0]):
        acc = 0
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[t, slot])
            gate, up = (w13[e] @ x[t].float()).split(INTER)
            acc = acc + topk_weights[t, slot].float() * (w2[e] @ (act(gate) * up))
        out.append(acc)
    return torch.stack(out)


def test_vllm_cpu_has_no_kernel_for_gelu_tanh_int4_experts(method_module):
    """Why the fallback exists: vLLM's own selection refuses these experts on the CPU (the serve log's error)."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    with pytest.raises(NotImplementedError, match="No WNA16 MoE backend"):
        method_module.select_wna16_moe_backend(**_select_args(MoEActivation.GELU_TANH, torch.float16))


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_fallback_kernel_computes_the_routed_experts_of_the_dequantized_weights(method_module, dtype_name):
    import torch
    import torch.nn.functional as F
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (WNA16MoEBackend,
                                                                        make_wna16_moe_quant_config)

    from gemma4_t4_vllm import moe_wna16

    dtype = getattr(torch, dtype_name)
    assert moe_wna16.install() is True
    assert moe_wna16.install() is False  # idempotent
    args = _select_args(MoEActivation.GELU_TANH, dtype)
    backend, experts_cls = method_module.select_wna16_moe_backend(**args)
    assert backend is WNA16MoEBackend.EMULATION and experts_cls.__name__ == "TorchWNA16Experts"

    rng = np.random.default_rng(7)
    w13_packed, w13_scale, w13 = _packed_experts(rng, 2 * INTER, HIDDEN, dtype)  # gate rows, then up rows
    w2_packed, w2_scale, w2 = _packed_experts(rng, HIDDEN, INTER, dtype)
    layer = SimpleNamespace(quant_method=SimpleNamespace(experts_cls=experts_cls))
    converted = method_module.convert_to_wna16_moe_kernel_format(
        backend, layer, args["quant_config"], torch.bfloat16, w13_packed, w2_packed, w13_scale, w2_scale)
    w13_tiles, w2_tiles, s13, s2 = converted[:4]
    # int4 held as int4: half a byte a weight and the build's scales, nothing dequantized
    assert w13_tiles.dtype == torch.uint8 and w13_tiles.shape == (E, 2 * INTER // 64, HIDDEN // 2, 64)
    assert w2_tiles.dtype == torch.uint8 and w2_tiles.numel() == E * HIDDEN * INTER // 2
    assert s13.dtype == dtype and s13.shape == (E, HIDDEN // GROUP, 2 * INTER)
    assert converted[4:] == (None,) * 6  # no zero points, global scales or biases
    from gemma4_t4_vllm import int4_matmul

    for e in range(E):
        assert torch.equal(int4_matmul.dequantize(w13_tiles[e], s13[e]), w13[e].t())
        assert torch.equal(int4_matmul.dequantize(w2_tiles[e], s2[e]), w2[e].t())

    quant_config = make_wna16_moe_quant_config(w1_scale=s13, w2_scale=s2, group_size=GROUP, num_bits=4)
    kernel = method_module.make_wna16_moe_kernel(quant_config, args["config"], experts_cls, backend)

    tokens = 9
    x = torch.from_numpy(rng.standard_normal((tokens, HIDDEN)).astype(np.float32)).to(dtype)
    topk_ids = torch.stack([torch.from_numpy(rng.choice(E, TOP_K, replace=False)) for _ in range(tokens)])
    topk_ids = topk_ids.to(torch.int32)
    assert set(topk_ids.flatten().tolist()) == set(range(E))  # every expert runs
    topk_weights = torch.softmax(torch.from_numpy(rng.standard_normal((tokens, TOP_K)).astype(np.float32)), -1)

    def run(activation):
        # The call CompressedTensorsWNA16MoEMethod.apply makes.
        return kernel.apply(x, w13_tiles, w2_tiles, topk_weights=topk_weights, topk_ids=topk_ids,
                            activation=activation, global_num_experts=E, expert_map=None,
                            apply_router_weight_on_input=False, shared_experts=None, shared_experts_input=None)

    out = run(MoEActivation.GELU_TANH)
    ref = _reference(x, topk_weights, topk_ids, w13, w2, lambda g: F.gelu(g, approximate="tanh"))
    assert out.shape == (tokens, HIDDEN) and out.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(out.float(), ref, **tol)
    # The check tells activations apart: SiLU experts, or exact (erf) GELU ones, give another result.
    assert not torch.allclose(run(MoEActivation.SILU).float(), ref, **tol)
    assert not torch.allclose(_reference(x, topk_weights, topk_ids, w13, w2, F.gelu),
                              ref, rtol=1e-4, atol=1e-4)


def test_the_wrappers_defer_to_vllm_where_it_has_a_kernel(method_module, monkeypatch):
    """Where vLLM's own selection succeeds (a GPU, or CPU experts vLLM runs), its answer stands and the
    conversion and kernel are vLLM's."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from gemma4_t4_vllm import moe_wna16

    calls = []
    monkeypatch.setattr(method_module, "select_wna16_moe_backend", lambda *a: calls.append("select") or "vllm's")
    monkeypatch.setattr(method_module, "convert_to_wna16_moe_kernel_format", lambda *a: calls.append("convert"))
    monkeypatch.setattr(method_module, "make_wna16_moe_kernel", lambda *a: calls.append("make"))
    assert moe_wna16.install() is True
    args = _select_args(MoEActivation.GELU_TANH, torch.float16)
    assert method_module.select_wna16_moe_backend(*args.values()) == "vllm's"
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    layer = SimpleNamespace(quant_method=SimpleNamespace(experts_cls=object))
    method_module.convert_to_wna16_moe_kernel_format(WNA16MoEBackend.EMULATION, layer, None, None, 1, 2, 3, 4)
    method_module.make_wna16_moe_kernel(None, None, object, WNA16MoEBackend.EMULATION)
    assert calls == ["select", "convert", "make"]


def test_register_leaves_the_moe_method_alone_off_the_cpu(method_module, monkeypatch):
    import gemma4_t4_vllm

    before = [getattr(method_module, name) for name in NAMES]
    monkeypatch.setattr(gemma4_t4_vllm, "_registered", False)
    monkeypatch.setattr(gemma4_t4_vllm, "_on_cpu_platform", lambda: False)
    gemma4_t4_vllm.register()
    assert [getattr(method_module, name) for name in NAMES] == before
