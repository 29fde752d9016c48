"""W4A16: the QAT checkpoint's symmetric 4-bit grid recovered exactly, as compressed-tensors `pack-quantized`.

Blocks are groups of 32 consecutive values along the input axis. The grid recovery itself (and its numba kernel,
checked against the numpy reference) lives in `repack/grid/grid.py`; this class only connects it to the build: the
three tensors per module (`weight_packed` int32 [out, in/8], `weight_scale` [out, in/32] in the scale dtype,
`weight_shape` int64 [2]; a mixture of experts' fused weights as one such module per expert projection, split
by repack.build.plan), the config group, and the grid's exactness figures, which are the report's own
columns (values exact in each runtime's arithmetic, errors in bf16 ulps, off-grid groups).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from tools.core.errors import param

from ..family import config as cfgmod
from ..grid import grid
from ..errors import OffGridError
from . import register
from ..choices import DEFAULT_OBJECTIVE, DEFAULT_TARGET
from .base import Output, Scheme, SchemeOptions

if TYPE_CHECKING:
    from .base import SchemeReport


@register
class W4A16(Scheme):
    name = "w4a16"
    summary = "int4 weights, groups of 32 recovered exactly from the QAT grid, 16-bit activations (pack-quantized)"
    tables = frozenset({"linears", "experts", "PLE", "embed_tokens", "lm_head"})
    Stats = grid.GridStats

    @classmethod
    def quantize_blocks(cls, words: np.ndarray, options: "SchemeOptions | None" = None
                        ) -> tuple[np.ndarray, np.ndarray]:
        """bf16 words [n_blocks, 32] -> (packed int32 [n_blocks, 4], scales float64 [n_blocks, 1])."""
        target, objective = ((options.target_dtype, options.objective) if options is not None
                             else (DEFAULT_TARGET, DEFAULT_OBJECTIVE))  # the build's defaults
        packed, scales, _ = grid.quantize(np.ascontiguousarray(words), target, objective)
        return packed, scales

    @classmethod
    def dequantize_blocks(cls, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """(packed int32 [n_blocks, 4], scales [n_blocks, 1]) -> float64 values [n_blocks, 32]."""
        return grid.decode(q, scale)

    @classmethod
    def outputs(cls, rows: int, cols: int, options: "SchemeOptions") -> list[Output]:
        scale_st = "F16" if options.scale_dtype == "fp16" else "BF16"
        return [Output("packed", "weight_packed", "I32", (rows, cols // 8), rows * cols // 2),
                Output("scale", "weight_scale", scale_st, (rows, cols // grid.GROUP), rows * cols // 16),
                Output("shape", "weight_shape", "I64", (2,), 16)]

    @classmethod
    def constants(cls, rows: int, cols: int) -> dict[str, np.ndarray]:
        return {"shape": np.array([rows, cols], dtype="<i8")}

    @classmethod
    def quantize_rows(cls, words: np.ndarray, options: "SchemeOptions", row0: int
                      ) -> tuple[dict[str, np.ndarray], grid.GridStats]:
        packed, scales, stats = grid.quantize(words, options.target_dtype, options.objective,
                                              options.other_dtype_sample)
        return ({"packed": packed, "scale": grid.scales_to_bytes(scales, grid.SCALE_DTYPE[options.target_dtype])},
                grid.GridStats.from_vector(stats, row0))

    @classmethod
    def decode(cls, tensors: dict[str, np.ndarray]) -> np.ndarray:
        scale = tensors["weight_scale"]
        if scale.dtype == np.uint16:  # bf16 stored as raw words
            scale = (scale.astype(np.uint32) << 16).view(np.float32)
        return grid.decode(tensors["weight_packed"], scale)

    @classmethod
    def config_group(cls, tables: list[str]) -> dict[str, Any]:
        return cfgmod.w4a16_group(tables)

    @classmethod
    def record(cls, report: "SchemeReport", table: str, stats: grid.GridStats) -> None:
        report.tables[table].processed.merge(stats)

    @classmethod
    def check_block(cls, stats: grid.GridStats, tensor: str, options: "SchemeOptions") -> None:
        if not stats.offgrid:
            return
        row, group, err, err_o = stats.first_offgrid  # type: ignore[misc]
        hint = ""
        if stats.first_offgrid_nonfinite:
            hint = "the group holds a NaN or an infinity, which no 4-bit level represents"
        elif err_o <= grid.TOL_ULPS:
            other = grid.other_target(options.target_dtype)  # type: ignore[arg-type]
            hint = f"it is on the grid for {other}: try {param('target_dtype', other)}"
        raise OffGridError(tensor, row, group, err, hint)
