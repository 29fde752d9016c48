"""Recovering the symmetric 4-bit grid of bf16 values, in groups of 32 along the last axis.

A QAT q4_0 export stores bf16(step * level) with level in [-8, 7] per group of 32. For each group:

1. The level the peak occupies (m = 1..8; 8 only when the peak is negative) is read off the ratios
   value / peak: on the grid every ratio is a fraction level / m, and fractions with denominators up to 8 are at
   least 1/56 apart while bf16 rounding moves a ratio by at most 2^-8. A lookup table maps each ratio to the
   set of peak levels its nearest fraction allows; the smallest m every value allows is the group's grid
   (never amax/8 or amax/7 by assumption).
2. The step is refined by least squares over the group: s = sum(level * x) / sum(level^2).
3. The stored scale is chosen for the runtime that will use it (the *target*): the GPU computes T(q * scale) in
   the model's dtype T (`float16` on a T4: Marlin and vLLM's int4 embedding gather round q * scale to fp16;
   `bfloat16` otherwise), with the scale stored in T. Candidates, all values of T: the rounded least-squares
   step and its two neighbours; the values of T nearest the interval of scales that would reproduce every value;
   and the article author's three (amax/m, the least-squares step, bf16 of the least-squares step, with the
   levels of the author's own choice of m), so that no group ever reproduces fewer values than the author's
   selection does. The objective picks among them:
   - `runtime-exact`: the most values with T(q * scale) == source (equal in value: -0 equals +0), ties broken
     by the squared runtime error;
   - `min-error`: the smallest squared runtime error, ties broken by the number of exact values.
4. A group is off the grid when it holds a NaN or an infinity, or when no candidate scale puts every runtime
   value within 2 bf16 ulps of its source value. The objective's choice itself may leave a value further off:
   `min-error` can trade a small value's ulps for the large values' absolute error (peaked levels with a few
   values rounded the other way), and such a group is on the grid all the same.

The same search is run for the other dtype, for the report only (what `--target-dtype` of the other dtype would
give), on a sample of the groups: every `other_every`-th run of SAMPLE_CHUNK consecutive groups of a row block (1:
every group, the exact figures; 0: none). It costs about as much as the target's own search, so a build samples
(repack.params.OTHER_DTYPE_SAMPLE). Two implementations compute exactly the same thing: a numba kernel (used when
numba is importable; it is the fast path) and plain numpy (the reference, and the fallback). Values are handled as
raw 16-bit words; torch is never imported.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from ..choices import DEFAULT_OBJECTIVE, DEFAULT_TARGET, OBJECTIVES, ScaleDtype, Target

GROUP = 32
TOL_ULPS = 2.0
SCALE_DTYPE: dict[str, ScaleDtype] = {"float16": "fp16", "bfloat16": "bf16"}
_TARGET_OF = {"float16": "float16", "fp16": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}
EXCL = 2.0 ** -30
AUTHOR_TOL = 2.0 ** -7  # the author's test: every value within amax * 2^-7 of its level times amax / m
_RATIO_BINS = 1024  # ratio lookup resolution: bins of 1/1024, well inside half the 1/56 fraction gap
_FRACTION_TOL = 0.0085

# Stats vector layout shared by both implementations ("_O": the same figure for the other dtype).
# The _O sums are over the other dtype's sample, whose groups and sum of squared source values are S_GROUPS_O and
# S_X2_O; S_OFF_ERR_O is the first off-grid group's, sampled or not. TARGET_STATS: the same whatever the sample.
(S_GROUPS, S_EXACT, S_EXACT_O, S_WORST, S_WORST_O, S_OFFGRID, S_OFF_ROW, S_OFF_GROUP, S_OFF_ERR, S_OFF_ERR_O,
 S_NONFINITE, S_ERRSUM, S_ERRSUM_O, S_SQ, S_SQ_O, S_X2, S_NEGZERO, S_OFF_NONFINITE, S_GROUPS_O, S_X2_O) = range(20)
N_STATS = 20
TARGET_STATS = [S_GROUPS, S_EXACT, S_WORST, S_OFFGRID, S_NONFINITE, S_ERRSUM, S_SQ, S_X2, S_NEGZERO]
SAMPLE_CHUNK = 64  # the kernel's chunk of groups side by side (_kernel_numba.CHUNK): the other dtype's sample unit


def in_other_sample(n_groups: int, other_every: int) -> np.ndarray:
    """Which of a row block's groups (row-major) the other dtype's figures come from: every `other_every`-th run of
    SAMPLE_CHUNK groups, starting with the first (1: all, 0: none)."""
    if other_every <= 0:
        return np.zeros(n_groups, dtype=bool)
    return (np.arange(n_groups) // SAMPLE_CHUNK) % other_every == 0


def target_of(name: str) -> Target:
    """'float16'/'fp16' -> 'float16', 'bfloat16'/'bf16' -> 'bfloat16'; anything else is a ValueError."""
    try:
        return _TARGET_OF[name]  # type: ignore[return-value]
    except KeyError:
        raise ValueError(f"target dtype {name!r}: choose float16 or bfloat16") from None


def other_target(t: str) -> Target:
    return "bfloat16" if target_of(t) == "float16" else "float16"


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
_RATIO_TABLE32 = RATIO_TABLE.astype(np.int32)  # the kernel gathers 32-bit words (vectorizable)
# lowest set bit + 1 (0 for an empty mask)
LOWBIT = np.array([0] + [((m & -m).bit_length()) for m in range(1, 256)], dtype=np.int8)

# significand bits, smallest quantum exponent and largest finite value of each format
_FMT = {"fp16": (11, -24, 65504.0), "bf16": (8, -133, 3.3895313892515355e38)}


def bits_of(dtype: ScaleDtype) -> tuple[int, int, float]:
    return _FMT[dtype]


with np.errstate(invalid="ignore"):
    VALUE_TABLE = (np.arange(0x10000, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)
_NONFINITE = (np.arange(0x10000) & 0x7F80) == 0x7F80
VALUE_TABLE[_NONFINITE] = 0.0  # NaN/inf: computed as 0, never exact, and the group is off the grid


def _interval_tables(fmt: ScaleDtype) -> tuple[np.ndarray, np.ndarray]:
    """Per bf16 word: the signed bounds [lo, hi] of the reals p that round (RNE) to the word's value in the
    runtime format `fmt`, i.e. fmt(p) == value. Empty (inf, -inf) where the value is not representable in
    `fmt` (too small for fp16's quantum, past its range) or not finite. A tie rounds to the even significand,
    so an odd one excludes its ends: a product scale * level has at most 15 significant bits and a midpoint at
    most 12, so a relative nudge of 2^-30 is exact exclusion."""
    sig, minexp, vmax = _FMT[fmt]
    x = VALUE_TABLE.copy()
    a = np.abs(x)
    _, e = np.frexp(a)
    # exponent of the binade (zero and subnormals: the lowest normal one)
    big = np.where(a > 0, np.maximum(e - 1, minexp + sig - 1), minexp + sig - 1)
    u = np.ldexp(1.0, np.maximum(big - sig + 1, minexp))  # spacing above a
    pow2 = (a > 0) & (np.frexp(a)[0] == 0.5)
    ub = np.where(pow2 & (big - sig >= minexp), u / 2, u)  # spacing below a power of two is finer
    n = a / u
    rep = (n == np.floor(n)) & (a <= vmax) & ~_NONFINITE
    odd = np.where(rep, np.fmod(n, 2.0) == 1.0, False)
    lo = np.where(a > 0, a - ub / 2, -u / 2)
    hi = a + u / 2
    lo = np.where(odd, lo + np.abs(lo) * EXCL, lo)
    hi = np.where(odd, hi - np.abs(hi) * EXCL, hi)
    neg = np.signbit(x) & (a > 0)
    lo_s = np.where(neg, -hi, lo)
    hi_s = np.where(neg, -lo, hi)
    return np.where(rep, lo_s, np.inf), np.where(rep, hi_s, -np.inf)


LO16_TABLE, HI16_TABLE = _interval_tables("fp16")
LOBF_TABLE, HIBF_TABLE = _interval_tables("bf16")
INTERVALS = {"float16": (LO16_TABLE, HI16_TABLE), "bfloat16": (LOBF_TABLE, HIBF_TABLE)}
# 1/ulp of each bf16 value, the unit of every error figure (zero and subnormals: spaced like exponent 1)
INV_ULP_TABLE = np.ldexp(1.0, 134 - np.maximum((np.arange(0x10000) >> 7) & 0xFF, 1)).astype(np.float64)
INV_ULP_TABLE[_NONFINITE] = 0.0

RECIP = np.array([1.0 / v if v else 0.0 for v in range(-8, 8)])  # 1/level, by level + 8


@dataclass
class GridStats:
    """Counts and error sums over the groups processed; merged across row blocks and tensors.

    Every figure is about the runtime: the value the GPU computes, T(level * scale) in the target dtype T, against
    the source value. "exact" is equality in value (-0 equals +0); a -0 source value comes back as +0 (a 4-bit
    level carries no sign of zero): those are counted in negzero. Errors are in bf16 ulps of the source value.
    The "_other" figures are what a build for the other dtype would give (its own scales), over the groups of its
    sample (values_other values, sq_src_other their sum of squares)."""

    groups: int = 0
    values: int = 0
    exact: int = 0
    exact_other: int = 0
    worst_ulps: float = 0.0
    worst_ulps_other: float = 0.0
    err_ulps_sum: float = 0.0
    err_ulps_sum_other: float = 0.0
    sq_err: float = 0.0
    sq_err_other: float = 0.0
    sq_src: float = 0.0
    values_other: int = 0
    sq_src_other: float = 0.0
    negzero: int = 0
    offgrid: int = 0
    first_offgrid: tuple[int, int, float, float] | None = None  # (row, group, ulps chosen, ulps other)
    first_offgrid_nonfinite: bool = False  # the first off-grid group holds a NaN or an infinity
    nonfinite: int = 0  # NaN/inf source values (their groups are off the grid)

    @classmethod
    def from_vector(cls, v: np.ndarray, row0: int = 0) -> "GridStats":
        s = cls(groups=int(v[S_GROUPS]), values=int(v[S_GROUPS]) * GROUP, exact=int(v[S_EXACT]),
                exact_other=int(v[S_EXACT_O]), worst_ulps=float(v[S_WORST]), worst_ulps_other=float(v[S_WORST_O]),
                err_ulps_sum=float(v[S_ERRSUM]), err_ulps_sum_other=float(v[S_ERRSUM_O]), sq_err=float(v[S_SQ]),
                sq_err_other=float(v[S_SQ_O]), sq_src=float(v[S_X2]), values_other=int(v[S_GROUPS_O]) * GROUP,
                sq_src_other=float(v[S_X2_O]), negzero=int(v[S_NEGZERO]),
                offgrid=int(v[S_OFFGRID]), nonfinite=int(v[S_NONFINITE]))
        if s.offgrid:
            s.first_offgrid = (row0 + int(v[S_OFF_ROW]), int(v[S_OFF_GROUP]), float(v[S_OFF_ERR]),
                               float(v[S_OFF_ERR_O]))
            s.first_offgrid_nonfinite = bool(v[S_OFF_NONFINITE])
        return s

    def merge(self, o: "GridStats") -> None:
        for f in ("groups", "values", "exact", "exact_other", "err_ulps_sum", "err_ulps_sum_other", "sq_err",
                  "sq_err_other", "sq_src", "values_other", "sq_src_other", "negzero", "offgrid", "nonfinite"):
            setattr(self, f, getattr(self, f) + getattr(o, f))
        self.worst_ulps = max(self.worst_ulps, o.worst_ulps)
        self.worst_ulps_other = max(self.worst_ulps_other, o.worst_ulps_other)
        if self.first_offgrid is None and o.first_offgrid is not None:
            self.first_offgrid = o.first_offgrid
            self.first_offgrid_nonfinite = o.first_offgrid_nonfinite


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


def runtime_values(p: np.ndarray, target: str) -> np.ndarray:
    """T(p): the exact products level * scale rounded (RNE) to the target dtype, as the GPU computes them.
    The products have at most 15 significant bits, so going through float32 is exact."""
    with np.errstate(over="ignore"):
        if target_of(target) == "float16":
            return p.astype(np.float32).astype(np.float16).astype(np.float64)
        b = p.astype(np.float32).view(np.uint32)
        b = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
        return b.view(np.float32).astype(np.float64)


def _seqsum(a: np.ndarray) -> np.ndarray:
    """Row sums in the kernel's order (left to right), so the two implementations decide alike."""
    acc = np.zeros(a.shape[0])
    for i in range(a.shape[1]):
        acc = acc + a[:, i]
    return acc


def _levels(f: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Levels for steps 1/f and their least-squares step."""
    q = np.clip(np.rint(x * f[:, None]), -8, 7)
    qq = _seqsum(q * q)
    s = np.where(qq > 0, _seqsum(q * x) / np.where(qq > 0, qq, 1.0), 0.0)
    return q, s


def _bounds(q: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The interval of scales reproducing every value exactly in the runtime (level 0 constrains nothing)."""
    rl = RECIP[(q + 8).astype(np.int64)]
    with np.errstate(invalid="ignore"):
        lo_w, hi_w = lo * rl, hi * rl
    lb = np.where(q > 0, lo_w, np.where(q < 0, hi_w, 0.0)).max(axis=1)
    ub = np.where(q > 0, hi_w, np.where(q < 0, lo_w, np.inf)).min(axis=1)
    return lb, ub


def _author_levels(x: np.ndarray, safe: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The article author's grid: the first m in 1..8 whose step amax/m reproduces every value within
    amax * 2^-7 (levels clipped to [-8, 7], as they must be stored). Returns (m, found)."""
    m_a = np.zeros(len(x))
    found = np.zeros(len(x), dtype=bool)
    tol = safe * AUTHOR_TOL
    for mm in range(1, 9):
        d = safe / mm
        q = np.clip(np.rint(x * (mm / safe)[:, None]), -8, 7)
        ok = (np.abs(q * d[:, None] - x) <= tol[:, None]).all(axis=1) & ~found
        m_a = np.where(ok, mm, m_a)
        found |= ok
    return m_a, found


def _round1(s: np.ndarray, fmt: ScaleDtype) -> np.ndarray:
    return _round_to_format(s, fmt)[0]


@dataclass
class _Choice:
    scale: np.ndarray    # chosen scale per group
    author: np.ndarray   # True where the chosen scale goes with the author's levels
    exact: np.ndarray    # values exact in the runtime, per group
    worst: np.ndarray    # worst runtime error in ulps (inf for a group holding NaN/inf)
    err_sum: np.ndarray  # sum of runtime errors in ulps
    sq: np.ndarray       # sum of squared runtime errors


def _candidates(g: np.ndarray, q: np.ndarray, s: np.ndarray, sa: np.ndarray, da: np.ndarray, has_a: np.ndarray,
                target: Target) -> list[tuple[np.ndarray, bool, np.ndarray]]:
    """(scale per group, goes with the author's levels, valid per group) for each candidate, in search order."""
    fmt = SCALE_DTYPE[target]
    lo_t, hi_t = INTERVALS[target]
    lb, ub = _bounds(q, lo_t[g], hi_t[g])
    feasible = lb <= ub
    yes = np.ones(len(g), dtype=bool)
    cands = [(c, False, yes) for c in _round_to_format(s, fmt)]
    cands += [(c, False, feasible) for c in _round_to_format(np.clip(s, lb, np.where(feasible, ub, lb)), fmt)]
    cands += [(_round1(da, fmt), True, has_a), (_round1(sa, fmt), True, has_a),
              (_round1(_round1(sa, "bf16"), fmt), True, has_a)]
    return cands


def _search(x: np.ndarray, g: np.ndarray, fin: np.ndarray, q: np.ndarray, s: np.ndarray, qa: np.ndarray,
            sa: np.ndarray, da: np.ndarray, has_a: np.ndarray, target: Target, objective: str) -> _Choice:
    """The chosen scale among the candidates (see the module docstring), for one target."""
    best = None
    for c, author, valid in _candidates(g, q, s, sa, da, has_a, target):
        lv = qa if author else q
        r = runtime_values(c[:, None] * lv, target)
        n = ((r == x) & fin).sum(axis=1)
        d = np.where(fin, r - x, 0.0)
        sq = _seqsum(d * d)
        if best is None:
            best = [c, np.zeros(len(x), dtype=bool), n, sq, r]
            continue
        bc, ba, bn, bsq, br = best
        if objective == "runtime-exact":
            better = valid & ((n > bn) | ((n == bn) & (sq < bsq)))
        else:
            better = valid & ((sq < bsq) | ((sq == bsq) & (n > bn)))
        best = [np.where(better, c, bc), np.where(better, author, ba), np.where(better, n, bn),
                np.where(better, sq, bsq), np.where(better[:, None], r, br)]
    bc, ba, bn, bsq, br = best  # type: ignore[misc]
    with np.errstate(invalid="ignore"):
        err = np.where(fin, np.abs(br - x) * INV_ULP_TABLE[g], 0.0)
    worst = np.where(fin.all(axis=1), err.max(axis=1), np.inf)
    return _Choice(bc, ba, bn, worst, err.sum(axis=1), bsq)


def _min_worst(x: np.ndarray, g: np.ndarray, fin: np.ndarray, q: np.ndarray, s: np.ndarray, qa: np.ndarray,
               sa: np.ndarray, da: np.ndarray, has_a: np.ndarray, target: Target) -> np.ndarray:
    """Per group, the smallest worst runtime error (bf16 ulps) over the candidates `_search` chooses from."""
    best = np.full(len(x), np.inf)
    for c, author, valid in _candidates(g, q, s, sa, da, has_a, target):
        r = runtime_values(c[:, None] * (qa if author else q), target)
        with np.errstate(invalid="ignore"):
            err = np.where(fin, np.abs(r - x) * INV_ULP_TABLE[g], 0.0).max(axis=1)
        best = np.where(valid & fin.all(axis=1), np.minimum(best, err), best)
    return best


def _max_err(c: np.ndarray, q: np.ndarray, x: np.ndarray, words: np.ndarray) -> np.ndarray:
    err = np.abs(c[:, None] * q - x) * INV_ULP_TABLE[words]
    return np.where(np.isnan(err), 0.0, err).max(axis=1)


def _check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: choose runtime-exact or min-error")


def quantize_numpy(words: np.ndarray, target: str = DEFAULT_TARGET, objective: str = DEFAULT_OBJECTIVE,
                   other_every: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """words: uint16 [rows, cols] bf16 bit patterns, cols % 32 == 0; target float16|bfloat16 (fp16|bf16);
    other_every: the other dtype's sample (in_other_sample).

    Returns (packed int32 [rows, cols/8], scales float64 [rows, cols/32] (exact values of the target dtype),
    stats vector)."""
    tgt = target_of(target)
    _check_objective(objective)
    rows, cols = words.shape
    g = words.reshape(-1, GROUP)
    x = VALUE_TABLE[g]
    fin = ~_NONFINITE[g]
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
    m_a, has_a = _author_levels(x, safe)
    qa, sa = _levels(m_a / safe, x)
    da = safe / np.where(has_a, m_a, 1.0)
    q, s = _levels(m / safe, x)
    ch = _search(x, g, fin, q, s, qa, sa, da, has_a, tgt, objective)
    miss = np.flatnonzero(ch.worst > TOL_ULPS)
    if len(miss):
        # every peak level for the groups the ratio lookup got wrong; the closest least-squares fit wins
        xs, gs = x[miss], g[miss]
        best_e = np.full(len(miss), np.inf)
        best_m = m[miss].copy()
        for mm in range(1, 9):
            qm, sm = _levels(np.full(len(miss), float(mm)) / safe[miss], xs)
            em = _max_err(sm, qm, xs, gs)
            better = (em < best_e) & ((mm < 8) | neg_only[miss])
            best_e = np.where(better, em, best_e)
            best_m = np.where(better, mm, best_m)
        m[miss] = best_m
        q, s = _levels(m / safe, x)
        ch = _search(x, g, fin, q, s, qa, sa, da, has_a, tgt, objective)
    cho = _search(x, g, fin, q, s, qa, sa, da, has_a, other_target(tgt), objective)
    lv = np.where(ch.author[:, None], qa, q)
    nib = (lv + 8).astype(np.uint8).reshape(rows, cols // 2, 2)
    packed = (nib[..., 0] | (nib[..., 1] << 4)).view("<i4").reshape(rows, cols // 8)
    stats = np.zeros(N_STATS)
    stats[S_GROUPS] = len(g)
    o = in_other_sample(len(g), other_every)
    stats[S_EXACT], stats[S_EXACT_O] = ch.exact.sum(), cho.exact[o].sum()
    stats[S_WORST], stats[S_WORST_O] = ch.worst.max(initial=0.0), cho.worst[o].max(initial=0.0)
    stats[S_ERRSUM], stats[S_ERRSUM_O] = ch.err_sum.sum(), cho.err_sum[o].sum()
    stats[S_SQ], stats[S_SQ_O] = ch.sq.sum(), cho.sq[o].sum()
    stats[S_X2], stats[S_X2_O] = (x * x).sum(), (x[o] * x[o]).sum()
    stats[S_GROUPS_O] = np.count_nonzero(o)
    stats[S_NEGZERO] = np.count_nonzero(g == 0x8000)
    stats[S_NONFINITE] = np.count_nonzero(~fin)
    bad = np.flatnonzero(ch.worst > TOL_ULPS)
    if len(bad):  # the objective's scale is past the tolerance: on the grid if another candidate is within it
        sel = np.ix_(bad)
        mw = _min_worst(x[sel], g[sel], fin[sel], q[sel], s[sel], qa[sel], sa[sel], da[sel], has_a[sel], tgt)
        bad = bad[mw > TOL_ULPS]
    stats[S_OFFGRID] = len(bad)
    if len(bad):
        first = int(bad[0])
        stats[S_OFF_ROW], stats[S_OFF_GROUP] = divmod(first, cols // GROUP)
        stats[S_OFF_ERR], stats[S_OFF_ERR_O] = ch.worst[first], cho.worst[first]
        stats[S_OFF_NONFINITE] = not fin[first].all()
    return np.ascontiguousarray(packed), ch.scale.reshape(rows, cols // GROUP), stats


# ---------------------------------------------------------------------------------------------------------
# numba kernel (same algorithm, one pass per group, releases the GIL so row blocks run on all cores)

_kernel = None


def _get_kernel():
    """numba's JIT kernel `quantize_rows` (compiled on first use, then loaded from numba's cache); None without
    numba (REPACK_NO_NUMBA: as if absent)."""
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


def quantize(words: np.ndarray, target: str = DEFAULT_TARGET, objective: str = DEFAULT_OBJECTIVE,
             other_every: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Grid recovery and packing of one row block; dispatches to the numba kernel when available.
    target: float16|bfloat16 (or the scale dtype names fp16|bf16); objective: runtime-exact|min-error;
    other_every: the other dtype's sample for the stats (in_other_sample; 1: every group)."""
    k = _get_kernel()
    if k is None:
        return quantize_numpy(words, target, objective, other_every)
    return run_kernel(k, words, target, objective, other_every)


def run_kernel(k, words: np.ndarray, target: str = DEFAULT_TARGET, objective: str = DEFAULT_OBJECTIVE,
               other_every: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`quantize` with a given kernel function (a `quantize_rows`). The arrays are made here with the types and
    layouts the kernel takes."""
    if words.dtype != np.uint16 or words.ndim != 2 or words.shape[1] % GROUP:
        raise ValueError(f"words: uint16 [rows, cols] with cols % {GROUP} == 0, not {words.dtype} {words.shape}")
    tgt = target_of(target)
    _check_objective(objective)
    oth = other_target(tgt)
    rows, cols = words.shape
    packed = np.empty((rows, cols // 8), dtype=np.int32)
    scales = np.empty((rows, cols // GROUP), dtype=np.float64)
    stats = np.zeros(N_STATS)
    sig, minexp, vmax = _FMT[SCALE_DTYPE[tgt]]
    osig, ominexp, ovmax = _FMT[SCALE_DTYPE[oth]]
    k(np.ascontiguousarray(words), packed.view(np.uint32), scales, stats, _RATIO_TABLE32, LOWBIT, sig, minexp, vmax,
      osig, ominexp, ovmax, objective == "min-error", int(other_every))
    return packed, scales, stats


def scales_to_bytes(scales: np.ndarray, scale_dtype: ScaleDtype) -> np.ndarray:
    """Exact conversion of representable scale values to the stored dtype's little-endian bits (the scale dtype
    or the target dtype's name)."""
    if SCALE_DTYPE.get(scale_dtype, scale_dtype) == "fp16":
        return scales.astype("<f2")
    return (scales.astype(np.float32).view(np.uint32) >> 16).astype("<u2")


def decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """packed int32 [rows, cols/8] + scales [rows, cols/32] -> float64 values (for tests and the probe)."""
    rows = packed.shape[0]
    u = packed.view(np.uint32)
    nib = np.stack([(u >> (4 * j)) & 0xF for j in range(8)], axis=-1).reshape(rows, -1).astype(np.int64) - 8
    return nib * np.repeat(scales.astype(np.float64), GROUP, axis=1)
