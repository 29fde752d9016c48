"""Recovering the symmetric 4-bit grid of bf16 values, in groups of 32 along the last axis.

A QAT q4_0 export stores bf16(step * level) with level in [-8, 7] per group of 32. For each group:

1. The level the peak occupies (m = 1..8; 8 only when the peak is negative) is read off the ratios
   value / peak: on the grid every ratio is a fraction level / m, and fractions with denominators up to 8 are at
   least 1/56 apart while bf16 rounding moves a ratio by at most 2^-8. A lookup table maps each ratio to the
   set of peak levels its nearest fraction allows; the smallest m every value allows is the group's grid
   (never amax/8 or amax/7 by assumption).
2. The step is refined by least squares over the group: s = sum(level * x) / sum(level^2).
3. The stored scale is the fp16 (or bf16) value near s, among the rounded value and its two neighbours,
   that reproduces the most source values bit-identically (bf16(scale * level) == source bits).
4. A group whose worst value is more than 2 bf16 ulps from scale * level is off the grid.

Two implementations compute exactly the same thing: a numba kernel (used when numba is importable; it is the
fast path) and plain numpy (the reference, and the fallback). Values are handled as raw 16-bit words; torch
is never imported.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

import numpy as np

GROUP = 32
TOL_ULPS = 2.0
ScaleDtype = Literal["fp16", "bf16"]
EXCL = 2.0 ** -30
_RATIO_BINS = 1024  # ratio lookup resolution: bins of 1/1024, well inside half the 1/56 fraction gap
_FRACTION_TOL = 0.0085

# Stats vector layout shared by both implementations.
S_GROUPS, S_IDENT, S_IDENT_OTHER, S_WORST, S_WORST_OTHER, S_OFFGRID, S_OFF_ROW, S_OFF_GROUP, S_OFF_ERR, \
    S_OFF_ERR_OTHER, S_NONFINITE = range(11)
N_STATS = 11


def _build_ratio_table() -> np.ndarray:
    """ratio bin -> bitmask of the peak levels m (bit m-1) compatible with the nearest fraction p/q, q <= 8."""
    table = np.zeros(2 * _RATIO_BINS + 1, dtype=np.uint8)
    fracs = sorted({(p / q, q) for q in range(1, 9) for p in range(-q, q + 1)
                    if math.gcd(abs(p), q) == 1 or p == 0})
    values = np.array([f for f, _ in fracs])
    for b in range(2 * _RATIO_BINS + 1):
        t = (b - _RATIO_BINS) / _RATIO_BINS
        i = int(np.argmin(np.abs(values - t)))
        if abs(values[i] - t) <= _FRACTION_TOL:
            q = fracs[i][1] if fracs[i][0] != 0 else 1
            table[b] = sum(1 << (m - 1) for m in range(1, 9) if m % q == 0)
    return table


RATIO_TABLE = _build_ratio_table()
# lowest set bit + 1 (0 for an empty mask)
LOWBIT = np.array([0] + [((m & -m).bit_length()) for m in range(1, 256)], dtype=np.int8)


def _bf16_value_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per 16-bit word: the signed bounds of the reals that round (RNE) to it, whether the ends are included
    (even mantissa), and 1/ulp. Indexed by the raw word, so the kernels need no float bit tricks.
    (Entries for inf/NaN words are meaningless; such values never sit on a grid.)"""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        return _bf16_value_tables_raw()


def _bf16_value_tables_raw() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    mags = np.arange(0x8000, dtype=np.uint32)
    val = (mags << 16).view(np.float32).astype(np.float64)
    up = ((np.minimum(mags + 1, 0x7F80)) << 16).view(np.float32).astype(np.float64)
    dn = np.where(mags > 0, ((np.maximum(mags, 1) - 1) << 16).view(np.float32).astype(np.float64), -val[1])
    hi = (val + up) / 2
    lo = (val + dn) / 2
    inv_ulp = 1.0 / (up - val)
    lo_all = np.concatenate([lo, -hi])
    hi_all = np.concatenate([hi, -lo])
    even = np.concatenate([(mags & 1) == 0, (mags & 1) == 0])
    # odd mantissa: a tie rounds away from the value, so the ends are excluded; a product scale * level has
    # at most 15 significant bits and a midpoint at most 9, so a relative nudge of 2^-30 is exact exclusion
    lo_all = np.where(even, lo_all, lo_all + np.abs(lo_all) * EXCL)
    hi_all = np.where(even, hi_all, hi_all - np.abs(hi_all) * EXCL)
    inv = np.concatenate([inv_ulp, inv_ulp])
    return lo_all, hi_all, even, inv


LO_TABLE, HI_TABLE, EVEN_TABLE, INV_ULP_TABLE = _bf16_value_tables()
with np.errstate(invalid="ignore"):
    VALUE_TABLE = (np.arange(0x10000, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
# NaN/inf words: value 0 (level 0), an empty interval (never identical), no error contribution
_NONFINITE = (np.arange(0x10000) & 0x7F80) == 0x7F80
VALUE_TABLE[_NONFINITE] = 0.0
LO_TABLE[_NONFINITE], HI_TABLE[_NONFINITE], EVEN_TABLE[_NONFINITE], INV_ULP_TABLE[_NONFINITE] = np.inf, -np.inf, False, 0.0

RECIP = np.array([1.0 / v if v else 0.0 for v in range(-8, 8)])  # 1/level, by level + 8

# per bf16 exponent field: half an ulp and 1/ulp (exponent 0: zero and subnormals, spaced like exponent 1)
HALF_ULP_E = np.ldexp(1.0, np.maximum(np.arange(256), 1) - 135)
INV_ULP_E = 1.0 / (2 * HALF_ULP_E)

# significand bits and smallest quantum of each scale dtype
_FMT = {"fp16": (11, -24, 65504.0), "bf16": (8, -133, 3.3895313892515355e38)}


def bits_of(dtype: ScaleDtype) -> tuple[int, int, float]:
    return _FMT[dtype]


@dataclass
class GridStats:
    """Counts over the groups processed; merged across row blocks and tensors."""

    groups: int = 0
    values: int = 0
    identical: int = 0        # values bf16(scale * level) == source with the chosen scale dtype
    identical_other: int = 0  # the same with the other scale dtype
    worst_ulps: float = 0.0
    worst_ulps_other: float = 0.0
    offgrid: int = 0
    first_offgrid: tuple[int, int, float, float] | None = None  # (row, group, ulps chosen, ulps other)
    nonfinite: int = 0  # NaN/inf source values: stored as level 0 and reported, never counted as identical

    @classmethod
    def from_vector(cls, v: np.ndarray, row0: int = 0) -> "GridStats":
        s = cls(groups=int(v[S_GROUPS]), values=int(v[S_GROUPS]) * GROUP, identical=int(v[S_IDENT]),
                identical_other=int(v[S_IDENT_OTHER]), worst_ulps=float(v[S_WORST]),
                worst_ulps_other=float(v[S_WORST_OTHER]), offgrid=int(v[S_OFFGRID]),
                nonfinite=int(v[S_NONFINITE]))
        if s.offgrid:
            s.first_offgrid = (row0 + int(v[S_OFF_ROW]), int(v[S_OFF_GROUP]), float(v[S_OFF_ERR]),
                               float(v[S_OFF_ERR_OTHER]))
        return s

    def merge(self, o: "GridStats") -> None:
        self.groups += o.groups
        self.values += o.values
        self.identical += o.identical
        self.identical_other += o.identical_other
        self.worst_ulps = max(self.worst_ulps, o.worst_ulps)
        self.worst_ulps_other = max(self.worst_ulps_other, o.worst_ulps_other)
        self.offgrid += o.offgrid
        self.nonfinite += o.nonfinite
        if self.first_offgrid is None and o.first_offgrid is not None:
            self.first_offgrid = o.first_offgrid


# ---------------------------------------------------------------------------------------------------------
# numpy reference


def _round_to_format(s: np.ndarray, fmt: ScaleDtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(nearest representable value, its lower neighbour, its upper neighbour) for positive s (0 stays 0)."""
    sig, minexp, vmax = _FMT[fmt]
    s = np.minimum(s, vmax)
    _, e = np.frexp(s)
    qu = np.ldexp(1.0, np.maximum(e - sig, minexp))
    c0 = np.rint(s / qu) * qu
    f0, e0 = np.frexp(c0)
    qu0 = np.ldexp(1.0, np.maximum(e0 - sig, minexp))
    qd = np.where((f0 == 0.5) & (e0 - 1 - sig >= minexp), qu0 / 2, qu0)
    return c0, np.maximum(c0 - qd, 0.0), np.minimum(c0 + qu0, vmax)


def _best_scale(s: np.ndarray, lb: np.ndarray, ub: np.ndarray, fmt: ScaleDtype, q: np.ndarray,
                words: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Among candidate scales (the rounded least-squares step, its neighbours, then the representable values
    nearest the interval [lb, ub] of scales reproducing every value), the first one reproducing the most values;
    its counts and worst error in ulps."""
    lo, hi, inv = LO_TABLE[words], HI_TABLE[words], INV_ULP_TABLE[words]
    feasible = lb <= ub
    c = list(_round_to_format(s, fmt))
    c += [np.where(feasible, k, c[0]) for k in _round_to_format(np.clip(s, lb, np.where(feasible, ub, lb)), fmt)]
    best = c[0]
    best_n = None
    for cand in c:
        r = cand[:, None] * q
        ok = (r >= lo) & (r <= hi)
        n = ok.sum(axis=1)
        if best_n is None:
            best_n = n
        else:
            better = n > best_n
            best = np.where(better, cand, best)
            best_n = np.where(better, n, best_n)
    err = np.abs(best[:, None] * q - x) * inv
    err = np.where(np.isnan(err), 0.0, err)  # 0 * inf for exact zeros
    return best, best_n, err.max(axis=1)


def _fit(f: np.ndarray, x: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Levels for steps 1/f, their least-squares steps, and the interval of steps reproducing every value."""
    q = np.clip(np.rint(x * f[:, None]), -8, 7)
    qq = (q * q).sum(axis=1)
    s = np.where(qq > 0, (q * x).sum(axis=1) / np.where(qq > 0, qq, 1.0), 0.0)
    rl = RECIP[(q + 8).astype(np.int64)]
    with np.errstate(invalid="ignore"):
        lo_w, hi_w = LO_TABLE[g] * rl, HI_TABLE[g] * rl
    lb = np.where(q > 0, lo_w, np.where(q < 0, hi_w, 0.0)).max(axis=1)
    ub = np.where(q > 0, hi_w, np.where(q < 0, lo_w, np.inf)).min(axis=1)
    return q, s, lb, ub


def _max_err(c: np.ndarray, q: np.ndarray, x: np.ndarray, words: np.ndarray) -> np.ndarray:
    err = np.abs(c[:, None] * q - x) * INV_ULP_TABLE[words]
    return np.where(np.isnan(err), 0.0, err).max(axis=1)


def quantize_numpy(words: np.ndarray, scale_dtype: ScaleDtype = "fp16"
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """words: uint16 [rows, cols] bf16 bit patterns, cols % 32 == 0.

    Returns (packed int32 [rows, cols/8], scales float64 [rows, cols/32] (exact values of the chosen dtype),
    stats vector)."""
    rows, cols = words.shape
    g = words.reshape(-1, GROUP)
    x = VALUE_TABLE[g]
    pmax, pmin = x.max(axis=1), x.min(axis=1)
    amax = np.maximum(pmax, -pmin)
    neg_only = -pmin > pmax
    safe = np.where(amax > 0, amax, 1.0)
    t = x / safe[:, None]
    idx = np.clip(np.rint(t * _RATIO_BINS).astype(np.int64) + _RATIO_BINS, 0, 2 * _RATIO_BINS)
    mask = np.bitwise_and.reduce(RATIO_TABLE[idx], axis=1)
    mask = np.where(neg_only, mask, mask & 0x7F)
    m = LOWBIT[mask].astype(np.float64)
    m = np.where(m == 0, np.where(neg_only, 8.0, 7.0), m)  # no consistent fraction: the fallback decides
    other: ScaleDtype = "bf16" if scale_dtype == "fp16" else "fp16"
    q, s, lb, ub = _fit(m / safe, x, g)
    c, n, err = _best_scale(s, lb, ub, scale_dtype, q, g, x)
    miss = np.flatnonzero(err > TOL_ULPS)
    if len(miss):
        # every peak level for the groups the ratio lookup got wrong; the closest least-squares fit wins
        xs, gs = x[miss], g[miss]
        best_e = np.full(len(miss), np.inf)
        best_m = m[miss].copy()
        for mm in range(1, 9):
            qm, sm, _, _ = _fit(np.full(len(miss), float(mm)) / safe[miss], xs, gs)
            em = _max_err(sm, qm, xs, gs)
            better = (em < best_e) & ((mm < 8) | neg_only[miss])
            best_e = np.where(better, em, best_e)
            best_m = np.where(better, mm, best_m)
        m[miss] = best_m
        q, s, lb, ub = _fit(m / safe, x, g)
        c, n, err = _best_scale(s, lb, ub, scale_dtype, q, g, x)
    _, n_o, err_o = _best_scale(s, lb, ub, other, q, g, x)
    nib = (q + 8).astype(np.uint8).reshape(rows, cols // 2, 2)
    packed = (nib[..., 0] | (nib[..., 1] << 4)).view("<i4").reshape(rows, cols // 8)
    stats = np.zeros(N_STATS)
    stats[S_GROUPS] = len(g)
    stats[S_IDENT] = n.sum()
    stats[S_IDENT_OTHER] = n_o.sum()
    stats[S_WORST] = err.max(initial=0.0)
    stats[S_WORST_OTHER] = err_o.max(initial=0.0)
    bad = np.flatnonzero(err > TOL_ULPS)
    stats[S_OFFGRID] = len(bad)
    stats[S_NONFINITE] = np.count_nonzero((g & 0x7F80) == 0x7F80)
    if len(bad):
        first = int(bad[0])
        stats[S_OFF_ROW], stats[S_OFF_GROUP] = divmod(first, cols // GROUP)
        stats[S_OFF_ERR], stats[S_OFF_ERR_OTHER] = err[first], err_o[first]
    return np.ascontiguousarray(packed), c.reshape(rows, cols // GROUP), stats


# ---------------------------------------------------------------------------------------------------------
# numba kernel (same algorithm, one pass per group, releases the GIL so row blocks run on all cores)

_kernel = None


def _get_kernel():
    global _kernel
    if _kernel is not None:
        return _kernel
    if os.environ.get("REPACK_NO_NUMBA"):
        return None
    try:
        import numba  # noqa: F401
    except ImportError:
        return None
    from . import _kernel_numba

    _kernel = _kernel_numba.quantize_rows
    return _kernel


def implementation() -> str:
    return "numba" if _get_kernel() is not None else "numpy"


def quantize(words: np.ndarray, scale_dtype: ScaleDtype = "fp16") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Grid recovery and packing of one row block; dispatches to the numba kernel when available."""
    k = _get_kernel()
    if k is None:
        return quantize_numpy(words, scale_dtype)
    rows, cols = words.shape
    packed = np.empty((rows, cols // 8), dtype=np.int32)
    scales = np.empty((rows, cols // GROUP), dtype=np.float64)
    stats = np.zeros(N_STATS)
    sig, minexp, vmax = _FMT[scale_dtype]
    osig, ominexp, ovmax = _FMT["bf16" if scale_dtype == "fp16" else "fp16"]
    k(np.ascontiguousarray(words), packed.view(np.uint32), scales, stats, RATIO_TABLE, LOWBIT, HALF_ULP_E,
      INV_ULP_E, RECIP, sig, minexp, vmax, osig, ominexp, ovmax)
    return packed, scales, stats


def scales_to_bytes(scales: np.ndarray, scale_dtype: ScaleDtype) -> np.ndarray:
    """Exact conversion of representable scale values to the stored dtype's little-endian bits."""
    if scale_dtype == "fp16":
        return scales.astype("<f2")
    return (scales.astype(np.float32).view(np.uint32) >> 16).astype("<u2")


def decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """packed int32 [rows, cols/8] + scales [rows, cols/32] -> float64 values (for tests and the probe)."""
    rows = packed.shape[0]
    u = packed.view(np.uint32)
    nib = np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=-1).reshape(rows, -1).astype(np.int64) - 8
    return nib * np.repeat(scales.astype(np.float64), GROUP, axis=1)
