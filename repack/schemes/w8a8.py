"""W8A8: int8 weights, symmetric per output channel, with dynamic per-token int8 activations, as
compressed-tensors `int-quantized` (the article's comparison build).

Per module the build writes `weight` int8 [out, in] and `weight_scale` float32 [out, 1]; no zero point
(symmetric) and no input scale (activations are quantized per token at run time by the serving kernel). vLLM 0.32
loads this as CompressedTensorsW8A8Int8 (weights strategy channel, activations strategy token, dynamic) and
runs it with CPUInt8ScaledMMLinearKernel on a CPU, the CUTLASS/Triton int8 kernels on a GPU.

Block = one output row. scale = amax / 127 and q = round-half-even(x / scale), so the peak maps to +-127 and
nothing clips (llama.cpp's q8_0 and vLLM's own dynamic int8 activations use the same 127; compressed-tensors'
min-max observer divides by 127.5 and clamps to [-128, 127], which clips the positive peak by half a step).
Scales are stored in float32, the dtype vLLM's W8A8 layer holds them in, so the stored scale is the one used.
The values are not on an int8 grid, so the report gives error figures (max abs error, relative L2, SNR) instead
of the grid's exactness columns. Only the linears are int8: the embedding tables (and an untied head written
from embed_tokens) stay with the exact int4 grid recovery when --embed-int4 asks for them, as the article's
W8A8 build kept "the same int4 embeddings".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..family import config as cfgmod
from ..errors import RepackError, clip
from . import register
from .base import ErrorStats, Output, Scheme, SchemeOptions, bf16_to_float

QMAX = 127


@register
class W8A8(Scheme):
    name = "w8a8"
    summary = ("int8 weights per output channel, dynamic per-token int8 activations (int-quantized); "
               "the --embed-int4 tables stay int4")
    tables = frozenset({"linears"})
    tables_via = "w4a16"
    Stats = ErrorStats

    @classmethod
    def quantize_blocks(cls, words: np.ndarray, options: "SchemeOptions | None" = None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """bf16 words [n_blocks, block] (a block is an output row) -> (int8 [n_blocks, block], float32 scales
        [n_blocks, 1]). NaN/inf values are stored as 0 and left out of the peak (a build refuses them first:
        check_block)."""
        x = bf16_to_float(words)
        if (words & 0x7F80).max(initial=0) == 0x7F80:  # an all-ones exponent: NaN or inf somewhere
            x = np.where(np.isfinite(x), x, np.float32(0))
        amax = np.maximum(x.max(axis=1, keepdims=True, initial=0), -x.min(axis=1, keepdims=True, initial=0))
        # an all-zero row decodes exactly with any scale; 1 keeps readers that divide by it finite
        scale = np.where(amax > 0, amax.astype(np.float64) / QMAX, 1.0).astype(np.float32)
        # divided in float64: float32 can round a quotient onto a .5 tie and then to the farther level
        q = np.rint(x / scale.astype(np.float64))
        return np.clip(q, -QMAX, QMAX, out=q).astype(np.int8), scale

    @classmethod
    def dequantize_blocks(cls, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """(int8 [n_blocks, block], scales [n_blocks, 1]) -> float64 values."""
        return q.astype(np.float64) * scale.astype(np.float64)

    @classmethod
    def outputs(cls, rows: int, cols: int, options: "SchemeOptions") -> list[Output]:
        return [Output("weight", "weight", "I8", (rows, cols), rows * cols),
                Output("scale", "weight_scale", "F32", (rows, 1), rows * 4)]

    @classmethod
    def quantize_rows(cls, words: np.ndarray, options: "SchemeOptions", row0: int
                      ) -> tuple[dict[str, np.ndarray], ErrorStats]:
        q, scale = cls.quantize_blocks(words, options)
        stats = ErrorStats.of(bf16_to_float(words), cls.dequantize_blocks(q, scale), row0)
        return {"weight": q, "scale": scale.astype("<f4")}, stats

    @classmethod
    def check_block(cls, stats: ErrorStats, tensor: str, options: "SchemeOptions") -> None:
        # no int8 level represents NaN or an infinity: a weight holding one is corrupt, not something to zero
        if stats.first_nonfinite is not None:
            row, col = stats.first_nonfinite
            raise RepackError(f"{clip(tensor)}: row {row}, column {col} holds a NaN or an infinity, which no int8 "
                              "level represents; the source checkpoint is corrupt (re-download it)",
                              detail={"tensor": clip(tensor), "row": row, "column": col, "problem": "nonfinite"})

    @classmethod
    def decode(cls, tensors: dict[str, np.ndarray]) -> np.ndarray:
        return cls.dequantize_blocks(tensors["weight"], tensors["weight_scale"])

    @classmethod
    def config_group(cls, tables: list[str]) -> dict[str, Any]:
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "channel",
                   "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "token",
                       "block_structure": None, "dynamic": True, "actorder": None, "observer": None,
                       "observer_kwargs": {}}
        return {"format": "int-quantized", "targets": cfgmod.targets(tables), "weights": weights,
                "input_activations": activations, "output_activations": None}
