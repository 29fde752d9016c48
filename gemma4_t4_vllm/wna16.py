"""int4 linear layers on a vLLM CPU library without `cpu_gemm_wna16`.

vLLM's CPU wheel carries three kernel libraries and loads one by the CPU's ISA (`CpuPlatform.import_kernels`):
`_C` (AVX-512 with BF16), `_C_AVX512`, `_C_AVX2`. The AVX2 one (an AMD EPYC or Intel CPU without AVX-512) has no
`cpu_gemm_wna16`, the W4A16 GEMM that vLLM's `CPUWNA16LinearKernel` calls for every int4 linear layer, so a W4A16
build fails at its first forward ("'_C' object has no attribute 'cpu_gemm_wna16'"). Where that op is missing,
`install()` replaces the kernel's two steps: after loading, each layer's packed weight is put once into
`int4_matmul`'s tiles (a reshape of its bytes: the layer holds the int4 weight and its 16-bit scales, nothing
else), and every forward multiplies through `int4_matmul.linear`. Where the op exists nothing changes.
"""

from __future__ import annotations

import logging


logger = logging.getLogger("vllm.gemma4_t4_vllm")

MARK = ("gemma4-t4: this CPU's vLLM kernel library has no cpu_gemm_wna16 (the AVX2 build): int4 linear layers "
        "run as the plugin's int4 matmul (gemma4_t4_vllm/int4_matmul.py)")
NO_ZERO_POINTS = ("int4 weights with zero points (asymmetric) have no kernel in this CPU's vLLM library (AVX2 "
                  "build) and gemma4-t4's replacement covers symmetric int4 only; serve a symmetric build")


def process_weights_after_loading(self, layer) -> None:
    """`CPUWNA16LinearKernel.process_weights_after_loading` for the plugin's matmul: the weight [N, K/8] int32
    (compressed-tensors' layout; GPTQ's [K/8, N] is its transpose) becomes tiles [N/T, K/2, T] uint8 in place of
    the packed one, and the scales [groups, N] contiguous."""
    from gemma4_t4_vllm import int4_matmul  # numba: imported where the kernel runs, not by every vLLM process

    if self.config.zero_points:
        raise NotImplementedError(NO_ZERO_POINTS)
    if self.w_zp_name is not None:
        setattr(layer, self.w_zp_name, None)
    weights = getattr(layer, self.w_q_name)
    assert weights.input_dim == weights.packed_dim  # packed along the input, as vLLM's own kernel requires
    weights.data = int4_matmul.to_tiles(weights.data if weights.input_dim == 1 else weights.data.t())
    scales = getattr(layer, self.w_s_name)
    scales.data = (scales.data.t() if scales.output_dim == 0 else scales.data).contiguous()


def apply_weights(self, layer, x, bias=None):
    """`CPUWNA16LinearKernel.apply_weights` through the plugin's matmul."""
    from gemma4_t4_vllm import int4_matmul

    return int4_matmul.linear(x, getattr(layer, self.w_q_name), getattr(layer, self.w_s_name), bias)


def op_missing() -> bool:
    """True where the loaded vLLM CPU kernel library has no cpu_gemm_wna16."""
    import importlib

    import torch

    importlib.import_module("vllm._custom_ops")  # loads the kernel library this CPU's ISA selects

    return not hasattr(torch.ops._C, "cpu_gemm_wna16")


def install() -> bool:
    """Replaces CPUWNA16LinearKernel's weight processing and forward where the op is missing; True if it did."""
    from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel as kernel

    if getattr(kernel.apply_weights, "_gemma4_t4", False) or not op_missing():
        return False
    for fn in (process_weights_after_loading, apply_weights):
        fn._gemma4_t4 = True  # type: ignore[attr-defined]
        setattr(kernel, fn.__name__, fn)
    logger.info(MARK)
    return True
