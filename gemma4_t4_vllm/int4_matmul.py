"""x @ W for int4 weights held packed, on a CPU: the one matmul behind the plugin's linear layers and MoE experts.

The layout ("tiles"), made once at load from compressed-tensors' packing by a reshape of its bytes: a weight of N
output channels and K inputs is uint8 [N/T, K/2, T], T output channels a tile (T = gcd(N, 64)), each tile's rows
contiguous; byte (k2, n) holds the levels of inputs 2*k2 (low nibble) and 2*k2+1 (high nibble) of channel n,
stored as level + 8 (exactly the bytes of compressed-tensors' int32 words, which pack 8 inputs LSB first). Scales
stay in the model's dtype, [K/group, N], one per group of `group` inputs and output channel.

Two ways to multiply, the same arithmetic (level * scale exact in float32, products summed in float32, the result
rounded once to the input's dtype), the sums in another order:
- `_gemv` (numba, one pass over the packed bytes, nothing dequantized): a few rows of x (decode), float16 or
  bfloat16 scales, an even group size;
- `dequantize` and a float32 matmul, a slice of output channels at a time (CHUNK_BYTES): many rows (a prompt's
  prefill, where one dequantization serves every row), and every shape or dtype `_gemv` does not take.

ATen's int4 CPU GEMM (`_weight_int4pack_mm_for_cpu`) was measured and is not used: on x86 only its bfloat16 path is
vectorised (float16 and float32 inputs take a scalar loop, 15x slower here), and in bfloat16 it rounds every
scale, activation and output to 8 significant bits, where the project serves float16 for the T4's numbers
(evidence/cpu-int4-gemm.md).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import numba as nb
import numpy as np

if TYPE_CHECKING:
    import torch

TILE = 64  # output channels a tile, at most
MAX_GEMV_ROWS = 8  # rows of x up to which _gemv is faster than dequantizing (bench/bench_int4_gemm.py)
CHUNK_BYTES = 32 << 20  # float32 bytes of one dequantized slice of a weight
# "dequantize": every call dequantizes (the reference path, for comparing served tokens); read at each call.
PATH_ENV = "GEMMA4_T4_INT4_PATH"
# float16 / bfloat16 scale bits -> float32 bits: sign to bit 31, the rest shifted up; float16's exponent bias
# is then 112 short, made up by an exact multiplication (subnormal scales included)
_SCALE_BITS = {"float16": (13, np.float32(2.0 ** 112)), "bfloat16": (16, np.float32(1.0))}


def tile_width(n: int) -> int:
    return math.gcd(n, TILE)


def to_tiles(words: "torch.Tensor") -> "torch.Tensor":
    """compressed-tensors' int32 words [..., N, K/8] (8 inputs a word, LSB first, level + 8) -> tiles
    [..., N/T, K/2, T] uint8 (the leading dimensions: a MoE layer's experts)."""
    import torch

    # The op that multiplies the tiles is registered here, at load: torch.compile (CPU_COMPILE=1) traces the first
    # forward and cannot trace a registration ("Attempted to inline function marked as skipped").
    _matmul_op()
    *lead, n, _ = words.shape
    t = tile_width(n)
    packed = words.contiguous().view(torch.uint8)  # [..., N, K/2]: the words' bytes, in order (little-endian)
    return packed.reshape(*lead, n // t, t, -1).transpose(-1, -2).contiguous()


def dequantize(tiles: "torch.Tensor", scales: "torch.Tensor") -> "torch.Tensor":
    """The float32 weight [K, N'] of `tiles` [N'/T, K/2, T] with `scales` [groups, N']: level * scale, exact."""
    import torch

    nt, half, t = tiles.shape
    k = 2 * half
    levels = torch.stack((tiles & 15, tiles >> 4), dim=2).reshape(nt, k, t)  # [N'/T, K, T]
    w = levels.permute(1, 0, 2).reshape(k, nt * t).to(torch.float32).sub_(8)
    groups = scales.shape[0]
    w.view(groups, k // groups, -1).mul_(scales.to(torch.float32).unsqueeze(1))
    return w


def _dequantized_matmul(x: "torch.Tensor", tiles: "torch.Tensor", scales: "torch.Tensor") -> "torch.Tensor":
    import torch

    nt, half, t = tiles.shape
    step = max(1, CHUNK_BYTES // (2 * half * t * 4))  # tiles per slice
    out = torch.empty(x.shape[0], nt * t, dtype=torch.float32)
    for t0 in range(0, nt, step):
        t1 = min(nt, t0 + step)
        cols = slice(t0 * t, t1 * t)
        torch.matmul(x, dequantize(tiles[t0:t1], scales[:, cols]), out=out[:, cols])
    return out


@nb.njit(cache=True, nogil=True, fastmath={"contract"})
def _gemv(x, tiles, scale_bits, shift, mult, out, first, stop):  # pragma: no cover - compiled
    """out[:, tiles first..stop] = x @ those tiles' weight. Per tile and row of x: each group's levels summed
    against x into `acc` (the tile's T channels side by side, vectorised), then times the group's scales."""
    rows = x.shape[0]
    t = tiles.shape[2]
    groups = scale_bits.shape[0]
    pairs = tiles.shape[1] // groups  # byte rows per group
    acc = np.empty(t, np.float32)
    tot = np.empty(t, np.float32)
    for tile in range(first, stop):
        for m in range(rows):
            tot[:] = 0.0
            for g in range(groups):
                acc[:] = 0.0
                for k2 in range(g * pairs, (g + 1) * pairs):
                    a0 = x[m, 2 * k2]
                    a1 = x[m, 2 * k2 + 1]
                    for j in range(t):
                        b = np.int32(tiles[tile, k2, j])
                        acc[j] += a0 * np.float32((b & 15) - 8) + a1 * np.float32((b >> 4) - 8)
                for j in range(t):
                    h = np.uint32(scale_bits[g, tile * t + j])
                    bits = ((h & np.uint32(0x8000)) << np.uint32(16)) | ((h & np.uint32(0x7FFF)) << shift)
                    tot[j] += acc[j] * (np.uint32(bits).view(np.float32) * mult)
            out[m, tile * t:(tile + 1) * t] = tot


def gemv_takes(rows: int, tiles: "torch.Tensor", scales: "torch.Tensor") -> bool:
    """Whether `_gemv` computes this product: few rows, 16-bit scales, whole byte rows per group."""
    groups = scales.shape[0]
    return (rows <= MAX_GEMV_ROWS and str(scales.dtype).removeprefix("torch.") in _SCALE_BITS
            and tiles.shape[1] % groups == 0 and os.environ.get(PATH_ENV) != "dequantize")


def matmul(x: "torch.Tensor", tiles: "torch.Tensor", scales: "torch.Tensor") -> "torch.Tensor":
    """x [M, K] @ the weight of (tiles, scales) -> float32 [M, N]."""
    import torch

    x = x.to(torch.float32).contiguous()
    if not gemv_takes(x.shape[0], tiles, scales):
        return _dequantized_matmul(x, tiles, scales)
    shift, mult = _SCALE_BITS[str(scales.dtype).removeprefix("torch.")]
    nt = tiles.shape[0]
    out = torch.empty(x.shape[0], nt * tiles.shape[2], dtype=torch.float32)
    args = (x.numpy(), tiles.numpy(), scales.contiguous().view(torch.int16).numpy().view(np.uint16),
            np.uint32(shift), mult, out.numpy())
    # torch's threads split the tiles (the kernel releases the GIL), where each gets a few
    threads = min(torch.get_num_threads(), nt // 8)
    if threads <= 1:
        _gemv(*args, 0, nt)
        return out
    bounds = [nt * i // threads for i in range(threads + 1)]
    list(_pool(threads).map(lambda i: _gemv(*args, bounds[i], bounds[i + 1]), range(threads)))
    return out


_pools: dict = {}


def _pool(threads: int):
    from concurrent.futures import ThreadPoolExecutor

    if threads not in _pools:
        _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="gemma4-t4-int4")
    return _pools[threads]


_op = None


def _matmul_op():
    """`matmul` as the torch op gemma4_t4::int4_matmul, so that torch.compile (CPU_COMPILE=1) keeps it whole in its
    graph instead of tracing into numba."""
    global _op
    if _op is None:
        import torch

        op = torch.library.custom_op("gemma4_t4::int4_matmul", matmul, mutates_args=(),
                                     schema="(Tensor x, Tensor tiles, Tensor scales) -> Tensor")
        op.register_fake(lambda x, tiles, scales: x.new_empty(x.shape[0], tiles.shape[0] * tiles.shape[2],
                                                              dtype=torch.float32))
        _op = op
    return _op


def linear(x: "torch.Tensor", tiles: "torch.Tensor", scales: "torch.Tensor",
           bias: "torch.Tensor | None" = None) -> "torch.Tensor":
    """x [..., K] @ W.T (+ bias) in x's dtype and shape [..., N]: what a linear layer returns."""
    import torch

    out = _matmul_op()(x.reshape(-1, x.shape[-1]), tiles, scales)
    if bias is not None:
        out += bias.to(torch.float32)
    return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])
