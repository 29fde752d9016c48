"""The packing both plugin kernels read: int32 words holding 32/num_bits values each, value j of a word at bits
num_bits*j (LSB first), stored as level + 2**(num_bits-1)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def signed_levels(words: "torch.Tensor", num_bits: int) -> "torch.Tensor":
    """[rows, w] int32 words -> [rows, w * 32/num_bits] int32 levels in [-2**(num_bits-1), 2**(num_bits-1))."""
    import torch

    pack = 32 // num_bits
    shifts = torch.arange(pack, dtype=torch.int32, device=words.device) * num_bits
    # Arithmetic right shift of a negative int32 fills with ones; the mask keeps only the value's bits.
    values = (words.unsqueeze(-1) >> shifts).bitwise_and_((1 << num_bits) - 1)  # [rows, w, pack], in place
    return values.reshape(words.shape[0], -1).sub_(1 << (num_bits - 1))
