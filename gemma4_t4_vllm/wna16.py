"""int4 linear layers on a vLLM CPU library without `cpu_gemm_wna16`.

vLLM's CPU wheel carries three kernel libraries and loads one by the CPU's ISA (`CpuPlatform.import_kernels`):
`_C` (AVX-512 with BF16), `_C_AVX512`, `_C_AVX2`. The AVX2 one (an AMD EPYC or Intel CPU without AVX-512) has no
`cpu_gemm_wna16`, the W4A16 GEMM that vLLM's `CPUWNA16LinearKernel` calls for every int4 linear layer, so a W4A16
build fails at its first forward ("'_C' object has no attribute 'cpu_gemm_wna16'"). Where that op is missing,
`install()` puts a torch implementation of the same arithmetic in its place: the weight, in the layout
`CPUWNA16LinearKernel._process_gptq_weights_w4a16` leaves it, is unpacked and dequantized in float32 and
multiplied in float32, and the output takes the input's dtype. Where the op exists nothing changes.

The weight is dequantized a slice of output channels at a time (CHUNK_BYTES of float32 each), never whole: a whole
262,144-row head at E4B's width is 2.7 GB per float32 copy, made and freed on every forward, and at that size the
allocations alone (page faults, munmap) kept the engine from finishing a step.
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
CHUNK_BYTES = 32 << 20  # float32 bytes of one dequantized slice of the weight


def dequantize(q_weight: "torch.Tensor", scales: "torch.Tensor", pack_factor: int) -> "torch.Tensor":
    """The float32 weight [K, N] of CPUWNA16's symmetric layout: q_weight [N/16, K*16/pack_factor] int32 (16
    output channels a block, each block's rows contiguous; value j of a word at bits 4j, stored as level + 8),
    scales [groups, N] (one per group of K/groups input rows)."""
    import torch

    n_blocks, row = q_weight.shape
    k = row * pack_factor // _BLOCK
    words = q_weight.view(n_blocks, k, _BLOCK // pack_factor).permute(1, 0, 2).reshape(k, -1)  # [K, N/pack]
    w = signed_levels(words, 32 // pack_factor).to(torch.float32)
    groups = scales.shape[0]
    # each group's rows times its scales, in place and broadcast (a repeated [K, N] copy of the scales would be
    # one more pass over the whole weight)
    w.view(groups, k // groups, -1).mul_(scales.to(torch.float32).unsqueeze(1))
    return w


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
    n_blocks, k = q_weight.shape[0], shape[-1]
    step = max(1, CHUNK_BYTES // (k * _BLOCK * 4))  # blocks of 16 output channels per slice
    out = torch.empty(x.shape[0], n_blocks * _BLOCK, dtype=torch.float32)
    for b0 in range(0, n_blocks, step):
        b1 = min(n_blocks, b0 + step)
        cols = slice(b0 * _BLOCK, b1 * _BLOCK)
        torch.matmul(x, dequantize(q_weight[b0:b1], scales[:, cols], pack_factor), out=out[:, cols])
    if bias is not None:
        out += bias.to(torch.float32)
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
