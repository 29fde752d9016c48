"""int4 linear layers on a vLLM CPU library without `cpu_gemm_wna16`.

vLLM's CPU wheel carries three kernel libraries and loads one by the CPU's ISA (`CpuPlatform.import_kernels`):
`_C` (AVX-512 with BF16), `_C_AVX512`, `_C_AVX2`. The AVX2 one (an AMD EPYC or Intel CPU without AVX-512) has no
`cpu_gemm_wna16`, the W4A16 GEMM that vLLM's `CPUWNA16LinearKernel` calls for every int4 linear layer, so a W4A16
build fails at its first forward ("'_C' object has no attribute 'cpu_gemm_wna16'"). Where that op is missing,
`install()` puts a torch implementation of the same arithmetic in its place: the weight, in the layout
`CPUWNA16LinearKernel._process_gptq_weights_w4a16` leaves it, is unpacked and dequantized in float32 and
multiplied in float32, and the output takes the input's dtype. Where the op exists nothing changes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gemma4_t4_vllm.packing import signed_levels

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("vllm.gemma4_t4_vllm")

MARK = ("gemma4-t4: this CPU's vLLM kernel library has no cpu_gemm_wna16 (the AVX2 build): int4 linear layers "
        "run as a torch dequantize-and-matmul")
_BLOCK = 16  # output channels per block in CPUWNA16's layout


def dequantize(q_weight: "torch.Tensor", scales: "torch.Tensor", pack_factor: int) -> "torch.Tensor":
    """The float32 weight [K, N] of CPUWNA16's symmetric layout: q_weight [N/16, K*16/pack_factor] int32 (16
    output channels a block, each block's rows contiguous; value j of a word at bits 4j, stored as level + 8),
    scales [groups, N] (one per group of K/groups input rows)."""
    import torch

    n_blocks, row = q_weight.shape
    k = row * pack_factor // _BLOCK
    words = q_weight.view(n_blocks, k, _BLOCK // pack_factor).permute(1, 0, 2).reshape(k, -1)  # [K, N/pack]
    levels = signed_levels(words, 32 // pack_factor)
    groups = scales.shape[0]
    s = scales.to(torch.float32)
    if groups > 1:
        s = s.repeat_interleave(k // groups, dim=0)
    return levels.to(torch.float32) * s


def gemm_wna16(input: "torch.Tensor", q_weight: "torch.Tensor", scales: "torch.Tensor",
               zeros: "torch.Tensor | None", bias: "torch.Tensor | None", pack_factor: int,
               isa_hint: str) -> "torch.Tensor":
    """`vllm._custom_ops.cpu_gemm_wna16`'s signature and result, in torch."""
    import torch

    if zeros is not None:
        raise NotImplementedError(
            "int4 weights with zero points (asymmetric) have no kernel in this CPU's vLLM library (AVX2 build) "
            "and gemma4-t4's torch replacement covers symmetric int4 only; serve a symmetric build")
    shape = input.shape
    x = input.reshape(-1, shape[-1]).to(torch.float32)
    out = x @ dequantize(q_weight, scales, pack_factor)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(input.dtype).reshape(*shape[:-1], out.shape[-1])


def op_missing() -> bool:
    """True where the loaded vLLM CPU kernel library has no cpu_gemm_wna16."""
    import importlib

    import torch

    importlib.import_module("vllm._custom_ops")  # loads the kernel library this CPU's ISA selects

    return not hasattr(torch.ops._C, "cpu_gemm_wna16")


def install() -> bool:
    """Replaces vllm._custom_ops.cpu_gemm_wna16 where its op is missing; True if it did. `CPUWNA16LinearKernel`
    looks the function up in that module at call time."""
    from vllm import _custom_ops as ops

    if getattr(ops.cpu_gemm_wna16, "_gemma4_t4", False) or not op_missing():
        return False
    gemm_wna16._gemma4_t4 = True  # type: ignore[attr-defined]
    ops.cpu_gemm_wna16 = gemm_wna16
    logger.info(MARK)
    return True
