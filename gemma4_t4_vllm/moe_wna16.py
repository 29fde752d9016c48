"""int4 (W4A16) mixture-of-experts layers on vLLM's CPU backend where vLLM has no kernel for them.

vLLM 0.32 offers two WNA16 MoE backends on the CPU platform (`oracle/int_wna16.py`, `_get_priority_backends`):
`ZEN_CPU` (needs AMD's zentorch) and `CPU` (`CPUExpertsInt4`: AMX CPUs, SiLU experts only). Gemma 4's experts use
gelu_tanh, so a compressed-tensors int4 MoE build stops at load with "No WNA16 MoE backend supports the deployment
configuration." On the CPU platform, and only where vLLM's own selection finds nothing, `install()` makes the
compressed-tensors WNA16 MoE method take `TorchWNA16Experts`: the experts are put once at load into
`int4_matmul`'s tiles (a reshape of their packed bytes, so they stay int4: no dequantized copy) and each routed
expert runs through `int4_matmul.linear` with vLLM's own activation op. Everywhere else (GPUs, a CPU where vLLM's
own backend takes the layer) nothing changes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING


if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vllm.gemma4_t4_vllm")

METHOD_MODULE = ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
                 "compressed_tensors_moe_wna16")
MARK = ("gemma4-t4: vLLM's CPU backend has no WNA16 MoE kernel for these experts (%s): int4 experts kept int4 "
        "and run through the plugin's int4 matmul (TorchWNA16Experts)")


def experts_to_tiles(packed: "torch.Tensor", scale: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """compressed-tensors' symmetric int4 experts [E, N, K/8] int32 (packed along K) with group scales [E, N, G]
    -> (tiles [E, N/T, K/2, T] uint8, scales [E, G, N]): each expert as `int4_matmul` takes a linear layer's."""
    from gemma4_t4_vllm import int4_matmul  # numba: imported where the kernel runs, not by every vLLM process

    return int4_matmul.to_tiles(packed), scale.transpose(-1, -2).contiguous()


def _experts_class():
    """Defined on first use: it subclasses vLLM's modular-kernel experts base, imported only where vLLM is."""
    global TorchWNA16Experts
    if TorchWNA16Experts is not None:
        return TorchWNA16Experts
    import torch

    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from gemma4_t4_vllm import int4_matmul
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
    from vllm.model_executor.layers.quantization.utils.quant_utils import kInt4Static, kInt4Static32
    from vllm.platforms import current_platform

    class _TorchWNA16Experts(mk.FusedMoEExpertsModular):
        """Standard-format modular experts over the tiles `experts_to_tiles` made: w1 of [E, 2N, K] (gate rows,
        then up rows), w2 of [E, K, N], their scales in the quant config. Applies the router weights and sums the
        top-k itself (like vLLM's CPU experts), so the finalize step reduces nothing."""

        @property
        def expects_unquantized_inputs(self) -> bool:
            return True

        @staticmethod
        def activation_format() -> mk.FusedMoEActivationFormat:
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_current_device() -> bool:
            return current_platform.is_cpu()

        @staticmethod
        def _supports_no_act_and_mul() -> bool:
            return False

        @staticmethod
        def _supports_activation(activation: MoEActivation) -> bool:
            # Those whose `torch.ops._C` op vLLM's CPU library has (csrc/cpu/activation.cpp).
            return activation in (MoEActivation.SILU, MoEActivation.GELU, MoEActivation.GELU_TANH)

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key) -> bool:
            return weight_key in (kInt4Static, kInt4Static32) and activation_key is None  # symmetric only

        @staticmethod
        def _supports_parallel_config(moe_parallel_config) -> bool:
            return True

        def moe_problem_size(self, a1, w1, w2, topk_ids):  # w1's tiles [E, 2N/T, K/2, T]: rows in two dims
            return w1.shape[0], a1.size(0), w1.shape[1] * w1.shape[3], a1.size(-1), topk_ids.size(1)

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (M, K)

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceNoOP()

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            # With apply_router_weight_on_input (top-1) the prepare step already scaled the input.
            weights = (torch.ones_like(topk_weights) if apply_router_weight_on_input else topk_weights)
            ids = topk_ids.long() if expert_map is None else expert_map[topk_ids.long()].long()
            s1, s2 = self.quant_config.w1_scale, self.quant_config.w2_scale
            acc = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
            for e in ids.unique().tolist():
                if e < 0:  # an expert of another rank
                    continue
                token, slot = (ids == e).nonzero(as_tuple=True)
                gate_up = int4_matmul.linear(hidden_states[token], w1[e], s1[e])
                act = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
                self.activation(activation, act, gate_up)
                y = int4_matmul.linear(act, w2[e], s2[e])
                acc.index_add_(0, token, y.float() * weights[token, slot].float().unsqueeze(1))
            output.copy_(acc.to(output.dtype))

    _TorchWNA16Experts.__name__ = _TorchWNA16Experts.__qualname__ = "TorchWNA16Experts"
    TorchWNA16Experts = _TorchWNA16Experts
    return TorchWNA16Experts


TorchWNA16Experts = None


def _ours(experts_cls) -> bool:
    return TorchWNA16Experts is not None and experts_cls is TorchWNA16Experts


def install() -> bool:
    """Wraps the three oracle functions the compressed-tensors WNA16 MoE method looks up in its module; True if
    it did. Call on the CPU platform only. Each wrapper defers to vLLM's own function unless this fallback is in
    play: selection only after vLLM's raised NotImplementedError, conversion and kernel only for the class it chose."""
    import functools
    import importlib

    try:
        module = importlib.import_module(METHOD_MODULE)
    except ImportError:
        return False
    if getattr(module.select_wna16_moe_backend, "_gemma4_t4", False):
        return False
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend

    logged: list[bool] = []
    select, convert, make = (module.select_wna16_moe_backend, module.convert_to_wna16_moe_kernel_format,
                             module.make_wna16_moe_kernel)

    @functools.wraps(select)
    def select_wna16_moe_backend(config, weight_key, quant_config, may_have_zp, may_have_bias,
                                 allow_tile_padding=False):
        try:
            return select(config, weight_key, quant_config, may_have_zp, may_have_bias, allow_tile_padding)
        except NotImplementedError:
            cls = _experts_class()
            supported, reason = cls.is_supported_config(cls, config, weight_key, None,
                                                        cls.activation_format())
            if not supported or may_have_zp:
                raise
            if not logged:  # once per process, not once per layer
                logged.append(True)
                logger.info(MARK, config.activation.value)
            # EMULATION: the method then skips the zero points, as for vLLM's own dequantize-at-load backend.
            return WNA16MoEBackend.EMULATION, cls

    @functools.wraps(convert)
    def convert_to_wna16_moe_kernel_format(backend, layer, quant_config, input_dtype, w13, w2, w13_scale,
                                           w2_scale, *args, **kwargs):
        if backend is not WNA16MoEBackend.EMULATION or not _ours(
                getattr(getattr(layer, "quant_method", None), "experts_cls", None)):
            return convert(backend, layer, quant_config, input_dtype, w13, w2, w13_scale, w2_scale, *args,
                           **kwargs)
        # N-first in, as the method loads them: w13 [E, 2N, K/8], w2 [E, K, N/8]; the packed int32 words are
        # replaced by the tiles (the method swaps the layer's parameters), not kept beside them.
        (w13_tiles, s13), (w2_tiles, s2) = experts_to_tiles(w13, w13_scale), experts_to_tiles(w2, w2_scale)
        return w13_tiles, w2_tiles, s13, s2, None, None, None, None, None, None

    @functools.wraps(make)
    def make_wna16_moe_kernel(moe_quant_config, moe_config, experts_cls, backend=WNA16MoEBackend.MARLIN,
                              routing_tables=None):
        if not _ours(experts_cls):
            return make(moe_quant_config, moe_config, experts_cls, backend, routing_tables)
        import vllm.model_executor.layers.fused_moe.modular_kernel as mk
        from vllm.model_executor.layers.fused_moe.all2all_utils import maybe_make_prepare_finalize

        # What vLLM's make_wna16_moe_kernel does for a Standard-format class (it admits only its own classes).
        prepare_finalize = maybe_make_prepare_finalize(moe=moe_config, quant_config=moe_quant_config,
                                                       routing_tables=routing_tables, allow_new_interface=True,
                                                       use_monolithic=False)
        return mk.FusedMoEKernel(prepare_finalize, experts_cls(moe_config=moe_config, quant_config=moe_quant_config))

    for name, fn in (("select_wna16_moe_backend", select_wna16_moe_backend),
                     ("convert_to_wna16_moe_kernel_format", convert_to_wna16_moe_kernel_format),
                     ("make_wna16_moe_kernel", make_wna16_moe_kernel)):
        fn._gemma4_t4 = True  # type: ignore[attr-defined]  (vLLM's own function stays in fn.__wrapped__)
        setattr(module, name, fn)
    return True
