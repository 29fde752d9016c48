"""The numba kernel behind `repack.grid.grid.quantize`: the algorithm of `quantize_numpy`, groups side by side.

Plain numba: loops over a group's 32 values that take every decision the reference takes, on the same numbers.
`quantize_rows` takes CHUNK groups at once with value i of group k at [i, k], so that each loop over the values
runs across groups (vector registers, no call per group) and each group's sums are still left to right. A group
with anything uncommon goes through `_one_group`, the same algorithm one group at a time (`quantize_rows_per_group`
runs every group that way: the tests hold the two to the same bytes). The other format's search, for the report
only, runs on the chunks of its sample (grid.in_other_sample). min-error's squared errors come from per-level
counts and sums (_sq_levels_cols: exact, hence equal, under a bound that is checked per group).
It is kept in its own module so that importing the library never compiles it; numba caches the machine code
next to this file (or in NUMBA_CACHE_DIR). `quantize_rows` releases the GIL: a build runs row blocks in threads.

Where it computes differently from the reference, the numbers are the same:
- Values, 1/ulp and binades come from the words' bits; T(p) is rounded on a float32's bits (_round_t).
- A level has its value's sign or is 0, so T(c*q) - x = +-(T(c*|q|) - |x|): magnitudes throughout.
- Sums are the reference's left-to-right sums; a sum is taken in any order (vector registers) only where every
  term and partial sum is exact, so that the order cannot change it (_sq_err, _levels).
- The interval of scales reproducing every value is computed per value instead of read from grid's tables, and
  only where a float32 test on the ratios value / level cannot already prove it empty (_surely_unbounded).
- The article author's m is the first m in 1..8 passing its test, and a passing m is always in the group's
  ratio mask (its tolerance, 2^-7 plus half a ratio bin, is inside the table's 0.0085, and fractions with
  denominators up to 8 are 1/56 apart): only the mask's m are tried.
- A candidate equal to one already evaluated (same value, same levels) cannot be strictly better, and once
  every value is exact no later candidate can be: those are skipped.
"""

# Longer than 500 lines because numba's on-disk cache keys a function by its own file only: split across files, an
# edit of a helper in one would leave its callers' cached machine code in the other stale.

from __future__ import annotations

import numba as nb
import numpy as np

# Adding and subtracting 1.5 * 2^52 rounds a float64 of magnitude below 2^51 to the nearest integer, ties to
# even (the default rounding mode), as np.rint does.
RND = 6755399441055744.0
AUTHOR_TOL = 2.0 ** -7
BF16_MAX = 3.3895313892515355e38
EXCL = 2.0 ** -30  # grid.EXCL: the relative nudge that excludes an interval's end
FP16_SIG = 11  # float16's significand bits: the runtime is float16, else bfloat16
NO_QUANTUM = 10000  # exponent standing for "no nonzero source value"

# One njit decorator for all: compiled into numba's on-disk cache, callable without the GIL. error_model="numpy":
# no test of each divisor for zero (Python's ZeroDivisionError), a branch that keeps a loop with a division off
# vector registers; no divisor here is ever zero (each is a peak, a level or a count checked first).
KW = {"cache": True, "nogil": True, "error_model": "numpy"}
jit = nb.njit(**KW)
# For the loops taking maxima and minima: no NaN reaches them (a NaN source is decoded as 0) and the sign of a
# zero never decides, so they may be computed in any order, on vector registers.
jit_minmax = nb.njit(**KW, fastmath={"nnan", "nsz"})
# For the one-line helpers: numba compiles each function apart and calls it, which keeps a loop calling it off
# vector registers; these are inlined into their callers instead.
jit_inline = nb.njit(**KW, inline="always")


@jit_inline
def _rint(v):
    return (v + RND) - RND


@jit_inline
def _exp2(k):
    # 2^k for a normal float64 (-1022 <= k <= 1023), from its exponent bits
    return np.int64((k + 1023) << 52).view(np.float64)


@jit_inline
def _ilogb(v):
    # floor(log2(v)) of a normal float64 v > 0, from its exponent bits
    return ((np.float64(v).view(np.int64) >> 52) & 0x7FF) - 1023


@jit_inline
def _nearest(v, sig, minexp):
    # the value nearest v > 0 (at most the format's largest) of a format with `sig` significand bits; v * 2^-kq is
    # v / quantum exactly (a power-of-two scaling)
    kq = max(_ilogb(v) - sig + 1, minexp)
    return _rint(v * _exp2(-kq)) * _exp2(kq)


@jit
def _round_fmt(s, sig, minexp, vmax):
    # nearest representable value of a format with `sig` significand bits, and its two neighbours
    if s <= 0.0:
        return 0.0, 0.0, 0.0
    if s > vmax:
        s = vmax
    c0 = _nearest(s, sig, minexp)
    e0 = _ilogb(c0)
    qu0 = _exp2(max(e0 - sig + 1, minexp))
    qd = qu0
    if c0 == _exp2(e0) and e0 - sig >= minexp:  # a power of two: finer spacing below
        qd = qu0 * 0.5
    return c0, max(c0 - qd, 0.0), min(c0 + qu0, vmax)


@jit
def _round1(s, sig, minexp, vmax):
    return _round_fmt(s, sig, minexp, vmax)[0]


@nb.njit(**KW, fastmath={"reassoc"})  # only sum x^2, a report total, is reordered
def _decode(words, r, base, x, ax, af, bn, inv):
    # The group's 32 bf16 words words[r, base:base + 32]: x its values (NaN/inf computed as 0, never exact), ax
    # and af their magnitudes (float64, float32: exact), bn the binade 2^floor(log2 |x|) (0 for zero and
    # subnormals), inv 1/ulp (zero and subnormals spaced like exponent 1; NaN/inf: 0), all from the words'
    # bits. Returns (NaN/inf count, -0 count, sum x^2, the smallest quantum exponent of a nonzero value
    # (NO_QUANTUM: none)).
    kx = NO_QUANTUM
    nf = 0
    nz = 0
    sxx = 0.0
    for i in range(len(x)):
        w = np.int64(words[r, base + i])
        e = (w >> 7) & 0xFF
        fin = e != 0xFF
        e1 = max(e, 1)
        v = np.int32((w << 16) if fin else 0).view(np.float32)
        x[i] = v
        ax[i] = abs(v)
        af[i] = abs(v)
        bn[i] = np.int32(e << 23 if fin else 0).view(np.float32)
        inv[i] = np.int64((1157 - e1) << 52).view(np.float64) if fin else 0.0
        nf += not fin
        nz += w == 0x8000
        sxx += np.float64(v) * v
        kx = min(kx, e1 - 134 if fin and w & 0x7FFF else NO_QUANTUM)
    return nf, nz, sxx, kx


@jit
def _ratio_mask(x, safe, table):
    # the peak levels m every value's ratio x / amax allows (bit m - 1)
    mask = 0xFF
    for i in range(len(x)):
        b = int(_rint(x[i] / safe * 1024.0)) + 1024
        mask &= table[min(max(b, 0), 2048)]
    return mask


@jit
def _author_misses(x, fa, d, tol):
    # values farther than tol from their level (rounded, clipped to 4 bits) times d
    bad = 0
    for i in range(len(x)):
        l = min(max(_rint(x[i] * fa), -8.0), 7.0)
        bad += not abs(l * d - x[i]) <= tol
    return bad


@jit
def _dot_in_order(q, j, x):
    acc = 0.0
    for i in range(len(x)):
        acc += q[j, i] * x[i]
    return acc


# Summing in any order ("reassoc": LLVM may then use vector registers) gives the left-to-right sum where every
# term and partial sum is exact; the callers check that it is. A loop over a group runs to the array's length,
# not the constant 32: LLVM unrolls a short constant loop into a scalar chain before it would vectorize it.


@nb.njit(**KW, fastmath={"reassoc"})
def _dot_any_order(q, j, x):
    acc = 0.0
    for i in range(len(x)):
        acc += q[j, i] * x[i]
    return acc


@jit
def _levels(f, x, q, aq, nib, j, regular):
    # levels for the step 1/f into row j (as floats, their magnitudes as float32, as nibbles level + 8 for
    # packing); returns their least-squares step. `regular`: every partial sum of level * x is
    # exact (a multiple of the smallest quantum 2^kx below 2^(53+kx): amax < 2^(45+kx)).
    sqq = 0
    for i in range(len(x)):
        l = min(max(_rint(x[i] * f), -8.0), 7.0)
        q[j, i] = l
        li = int(l)
        aq[j, i] = abs(li)
        nib[j, i] = li + 8
        sqq += li * li
    if sqq == 0:
        return 0.0
    return (_dot_any_order(q, j, x) if regular else _dot_in_order(q, j, x)) / sqq


@jit
def _value_bounds(v, sig, minexp, vmax):
    # grid._interval_tables for one magnitude v > 0: the reals p with T(p) == v as [lo, hi], ends excluded by a
    # relative nudge where v's significand in T is odd (ties go to even); (inf, -inf) where v is not a value of
    # T. Every step is the table's own expression on the same numbers.
    e = _ilogb(v)
    big = max(e, minexp + sig - 1)  # the binade (below the normal range: the lowest normal one)
    k = max(big - sig + 1, minexp)
    u = _exp2(k)  # the spacing above v
    pow2 = v == _exp2(e)
    ub = u * 0.5 if pow2 and big - sig >= minexp else u  # below a power of two the spacing is finer
    n = v * _exp2(-k)  # v / u exactly, below 2^12
    if not (n == _rint(n) and v <= vmax):
        return np.inf, -np.inf
    lo = v - ub * 0.5
    hi = v + u * 0.5
    if int(n) % 2 == 1:
        lo = lo + abs(lo) * EXCL
        hi = hi - abs(hi) * EXCL
    return lo, hi


@jit_minmax
def _bounds(aq, ax, sig, minexp, vmax):
    # The interval of scales reproducing every value exactly with the levels of row 0, as the reference takes
    # it: the largest lo/l and the smallest hi/l over the values (level 0 constrains nothing; a negative
    # value's bounds are the negated bounds of its magnitude and 1/-l = -(1/l) exactly, so each value's
    # magnitude and |l| give its terms). Two different values at one level have disjoint intervals: lb > ub.
    lb = 0.0
    ub = np.inf
    for i in range(len(ax)):
        a = aq[0, i]
        if a > 0.0:
            lo, hi = _value_bounds(ax[i], sig, minexp, vmax)
            rl = 1.0 / np.float64(a)  # the reference's RECIP: lo * (1/l), not lo / l
            lb = max(lb, lo * rl)
            ub = min(ub, hi * rl)
    return lb, ub


@jit_minmax
def _ratio_spread(aq, af):
    # the largest and the smallest v / l over the values with a level (l > 0) of row 0, and the smallest such
    # v, computed in float32
    hi = np.float32(0.0)
    lo = np.float32(np.inf)
    vmin = np.float32(np.inf)
    for i in range(len(af)):
        a = aq[0, i]
        on = a > 0  # level 0 constrains nothing
        r = af[i] / (a if on else np.float32(1.0))
        hi = max(hi, r if on else np.float32(0.0))
        lo = min(lo, r if on else np.float32(np.inf))
        vmin = min(vmin, af[i] if on else np.float32(np.inf))
    return np.float64(hi), np.float64(lo), np.float64(vmin)


@jit
def _normal_in_t(vmin, sig, minexp):
    # every value with a level is in T's normal range and far from float32's subnormals (the float32 checks'
    # bounds hold only there)
    return vmin >= max(_exp2(minexp + sig - 1), 2.0 ** -96)


@jit
def _surely_unbounded(rmax, rmin, vmin, sig, minexp):
    # True only where _bounds is certain to give lb > ub (no scale reproduces every value), decided from the
    # spread of v / l alone. In T's normal range a value's interval is inside v (1 -+ 2^-sig) / l, and each
    # computed ratio is within 2^-23 of the real one: if the largest lower end exceeds the smallest upper end by
    # more than 2^-18, the reference's lb > ub (its own rounding is within 2^-51). Otherwise _bounds decides.
    if not _normal_in_t(vmin, sig, minexp):
        return False
    q = _exp2(-sig)
    return rmax * (1.0 - q) > rmin * (1.0 + q) * (1.0 + 2.0 ** -18)


@jit_minmax
def _surely_unbounded_per_value(aq, af, bn, vmin, sig, minexp):
    # _surely_unbounded's decision from each value's own spacing rather than the widest one (it decides most of
    # what the spread leaves open for bfloat16, whose spacing is 8 times float16's). In T's normal range an
    # interval's ends are within h = bn * 2^-sig of v (half a spacing); v -+ h has at most 12 significant bits
    # (exact in float32), times 1/l: within 2^-23 of the real quotient. The reference's rounding is within
    # 2^-51, so an excess of more than 2^-20 cannot be crossed.
    if not _normal_in_t(vmin, sig, minexp):
        return False
    h_scale = np.float32(_exp2(-sig))
    lo = np.float32(0.0)
    hi = np.float32(np.inf)
    for i in range(len(af)):
        a = aq[0, i]
        on = a > 0  # level 0 constrains nothing
        rl = np.float32(1.0) / (a if on else np.float32(1.0))
        h = bn[i] * h_scale
        lo = max(lo, (af[i] - h) * rl if on else np.float32(0.0))
        hi = min(hi, (af[i] + h) * rl if on else np.float32(np.inf))
    return np.float64(lo) > np.float64(hi) * (1.0 + 2.0 ** -20)


@jit_inline
def _round_t(p, sig):
    # T(p) for a float32 p >= 0, as a float32 (past T's range: inf), T float16 (sig == FP16_SIG) or bfloat16:
    # round to nearest even on the bits, at bit 13 for float16's 10 fraction bits, at bit 16 for bfloat16's 7.
    # Below float16's normal range (2^-14) its quantum is 2^-24: adding 0.75 rounds to a multiple of it.
    # (Written without early returns, so that a loop calling it runs on vector registers.)
    b = np.int64(np.float32(p).view(np.int32))
    if sig != FP16_SIG:
        return np.int32((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).view(np.float32)
    sub = (p + np.float32(0.75)) - np.float32(0.75)
    r = np.int32((b + 0xFFF + ((b >> 13) & 1)) & ~0x1FFF).view(np.float32)
    r = sub if p < np.float32(2.0 ** -14) else r
    return r if r <= np.float32(65504.0) else np.float32(np.inf)


@jit
def _runtime(c, aq, j, af, rt, sig):
    # rt[i] = T(c * |level i|) of row j, the runtime value's magnitude (T(-p) = -T(p), and a level has the sign
    # of its value or is 0); returns how many equal the source magnitude af (NaN/inf sources are 0 at level 0:
    # counted). c is a value of T and the level at most 8 in magnitude: the product has at most 14
    # significant bits, exact in float32.
    c32 = np.float32(c)
    n = 0
    for i in range(len(af)):
        r = _round_t(c32 * aq[j, i], sig)
        rt[i] = r
        n += r == af[i]
    return n


@jit
def _sq_in_order(rt, ax):
    acc = 0.0
    for i in range(len(ax)):
        d = np.float64(rt[i]) - ax[i]
        acc += d * d
    return acc


@nb.njit(**KW, fastmath={"reassoc"})
def _sq_any_order(rt, ax):
    acc = 0.0
    for i in range(len(ax)):
        d = np.float64(rt[i]) - ax[i]
        acc += d * d
    return acc


@jit
def _sq_err(c, rt, ax, amax, kx, sig, minexp):
    # The squared runtime error of scale c (runtime values rt), equal to the reference's left-to-right sum.
    # Every difference T(c*a) - |x| is a multiple of 2^k (k: the smallest quantum among the values and c's in
    # T) and at most max(T(8c), amax): below 2^(24+k), each square is exact and every partial sum of 32 below
    # 2^(53+2k), so any order gives the same sum.
    if c > 0.0:
        k = min(kx, max(_ilogb(c) - sig + 1, minexp))
        if max(np.float64(_round_t(np.float32(8.0 * c), sig)), amax) < _exp2(24 + k):
            return _sq_any_order(rt, ax)
    return _sq_in_order(rt, ax)


@nb.njit(**KW, fastmath={"reassoc"})
def _sum_any_order(v):
    acc = 0.0
    for i in range(len(v)):
        acc += v[i]
    return acc


@jit_minmax
def _errors(rt, ax, inv, err):
    # (values exact, worst and summed runtime error in bf16 ulps of the source) of the runtime values rt; the
    # sum is a report total, in any order
    n = 0
    worst = 0.0
    for i in range(len(ax)):
        r = np.float64(rt[i])
        n += r == ax[i]
        e = abs(r - ax[i]) * inv[i]
        err[i] = e
        worst = max(worst, e)
    return n, worst, _sum_any_order(err)


@jit
def _search(s, sa, da, has_a, same_a, nf, amax, kx, no_interval, vmin, min_error, sig, minexp, vmax,
            aq, ax, af, bn, rt, cand, auth):
    # The candidates of grid._search, in the same order, skipping those that cannot be valid or cannot be
    # strictly better (a duplicate of one evaluated); stops once nothing can be strictly better (every finite
    # value exact). The next candidates are computed only when the search gets to them. Returns (scale, uses
    # the author's levels (row 1), exact count, sq).
    cand[0], cand[1], cand[2] = _round_fmt(s, sig, minexp, vmax)
    auth[0] = auth[1] = auth[2] = False
    nc = 3
    best, ba, bn_, bsq = cand[0], False, -1, np.inf
    j = 0
    stage = 0
    while True:
        while j < nc:
            c = cand[j]
            a = auth[j]
            dup = False
            for t in range(j):
                dup = dup or (cand[t] == c and auth[t] == a)
            if dup:
                j += 1
                continue
            n = _runtime(c, aq, int(a), af, rt, sig) - nf
            if min_error:
                sq = _sq_err(c, rt, ax, amax, kx, sig, minexp)
                if j == 0 or sq < bsq or (sq == bsq and n > bn_):  # a tie: the more exact values win
                    best, ba, bn_, bsq = c, a, n, sq
                if bsq == 0.0:  # every value exact: sq == 0 for no other count
                    return best, ba, 32 - nf, bsq
            else:
                if n == 32:
                    return c, a, n, 0.0
                if n >= bn_:
                    sq = _sq_err(c, rt, ax, amax, kx, sig, minexp)
                    if j == 0 or n > bn_ or sq < bsq:
                        best, ba, bn_, bsq = c, a, n, sq
            j += 1
        if stage == 0:  # the values of T nearest the interval of scales reproducing every value
            stage = 1
            lb, ub = 1.0, 0.0
            if not (no_interval or _surely_unbounded_per_value(aq, af, bn, vmin, sig, minexp)):
                lb, ub = _bounds(aq, ax, sig, minexp, vmax)
            if lb <= ub:
                cand[3], cand[4], cand[5] = _round_fmt(min(max(s, lb), ub), sig, minexp, vmax)
                auth[3] = auth[4] = auth[5] = False
                nc = 6
        elif stage == 1:  # the article author's three
            stage = 2
            if has_a:
                cand[nc] = _round1(da, sig, minexp, vmax)
                auth[nc] = not same_a
                nc += 1
                if not same_a:  # with the same levels this is the first candidate again
                    cand[nc] = _round1(sa, sig, minexp, vmax)
                    auth[nc] = True
                    nc += 1
                cand[nc] = _round1(_round1(sa, 8, -133, BF16_MAX), sig, minexp, vmax)
                auth[nc] = not same_a
                nc += 1
        else:
            return best, ba, bn_, bsq


@jit
def _choose(s, sa, da, has_a, same_a, nf, amax, kx, spread, min_error, sig, minexp, vmax,
            aq, ax, af, bn, inv, rt, err, cand, auth):
    # the search for one runtime format, and the chosen scale's figures: (scale, uses row 1, exact, sq, worst
    # error (inf for a group holding NaN/inf), summed error)
    rmax, rmin, vmin = spread
    no_interval = _surely_unbounded(rmax, rmin, vmin, sig, minexp)
    c, a, n, sq = _search(s, sa, da, has_a, same_a, nf, amax, kx, no_interval, vmin, min_error, sig, minexp,
                          vmax, aq, ax, af, bn, rt, cand, auth)
    _runtime(c, aq, int(a), af, rt, sig)
    ne, worst, tot = _errors(rt, ax, inv, err)
    if nf:
        worst = np.inf
    return c, a, n, sq, worst, tot


@jit
def _min_worst(s, sa, da, has_a, same_a, sig, minexp, vmax, aq, ax, af, inv, rt, err, cand):
    # grid._min_worst: the smallest worst runtime error over every candidate of _search (the rare path of a
    # group whose chosen scale is past the tolerance)
    cand[0], cand[1], cand[2] = _round_fmt(s, sig, minexp, vmax)
    nc = 3
    lb, ub = _bounds(aq, ax, sig, minexp, vmax)
    if lb <= ub:
        cand[3], cand[4], cand[5] = _round_fmt(min(max(s, lb), ub), sig, minexp, vmax)
        nc = 6
    best = np.inf
    for j in range(nc):
        _runtime(cand[j], aq, 0, af, rt, sig)
        best = min(best, _errors(rt, ax, inv, err)[1])
    if has_a:
        row = 0 if same_a else 1  # the same m gives the same levels (row 0)
        for c in (_round1(da, sig, minexp, vmax), _round1(sa, sig, minexp, vmax),
                  _round1(_round1(sa, 8, -133, BF16_MAX), sig, minexp, vmax)):
            _runtime(c, aq, row, af, rt, sig)
            best = min(best, _errors(rt, ax, inv, err)[1])
    return best


@jit_minmax
def _fit_error(c, q, x, inv):
    # grid._max_err: the worst error in ulps of the least-squares step c with the levels of row 0
    w = 0.0
    for i in range(len(x)):
        w = max(w, abs(c * q[0, i] - x[i]) * inv[i])
    return w


@jit_minmax
def _peak_level(x, table, lowbit):
    # (amax, amax or 1 where it is 0, the peak is negative only, the ratio mask, the peak level m it gives)
    pmax = -np.inf
    pmin = np.inf
    for i in range(len(x)):
        pmax = max(pmax, x[i])
        pmin = min(pmin, x[i])
    amax = max(pmax, -pmin)
    neg_only = -pmin > pmax
    safe = amax if amax > 0 else 1.0
    mask = _ratio_mask(x, safe, table)
    if not neg_only:
        mask &= 0x7F
    m = int(lowbit[mask])
    if m == 0:  # no consistent fraction: the fallback decides
        m = 8 if neg_only else 7
    return amax, safe, neg_only, mask, m


@jit
def _author_m(x, mask, safe):
    # the article author's grid: the first m whose step amax/m puts every value within amax * 2^-7 (0: none);
    # only the m of the ratio mask can pass (see the module docstring)
    tol = safe * AUTHOR_TOL
    for mm in range(1, 9):
        if (mask >> (mm - 1)) & 1 and _author_misses(x, mm / safe, safe / mm, tol) == 0:
            return mm
    return 0


@jit
def _group(x, ax, af, bn, inv, nf, kx, table, lowbit, fmt, ofmt, min_error, other, q, aq, nib, rt, err, cand,
           auth):
    # One decoded group: its levels (rows 0 and 1 of q, aq, nib: the ratio lookup's m, the author's m), the
    # scale chosen for the target format `fmt` (sig, minexp, vmax) and, for a group of the other format's sample
    # (`other`) or off the grid (its error names the other format), the other format's search for the report.
    # Returns (scale, uses row 1, (exact, sq, worst, summed error) for fmt and for ofmt (zeros where not
    # searched), off the grid).
    sig, minexp, vmax = fmt
    amax, safe, neg_only, mask, m = _peak_level(x, table, lowbit)
    regular = kx == NO_QUANTUM or amax < _exp2(45 + kx)
    m_a = _author_m(x, mask, safe)
    has_a = m_a > 0
    da = safe / m_a if has_a else 0.0
    m0 = m
    for attempt in range(2):
        s = _levels(m / safe, x, q, aq, nib, 0, regular)
        if attempt == 1 and m == m0:  # the same levels again (row 0 restored): the first attempt's choice stands
            break
        sa = 0.0
        if has_a:  # the same m gives the same levels and step (then only row 0 is used)
            sa = _levels(m_a / safe, x, q, aq, nib, 1, regular) if m_a != m else s
        spread = _ratio_spread(aq, af)
        c, a, n, sq, e, et = _choose(s, sa, da, has_a, m_a == m, nf, amax, kx, spread, min_error, sig, minexp, vmax,
                                     aq, ax, af, bn, inv, rt, err, cand, auth)
        if e <= 2.0 or attempt == 1:
            break
        # The ratio lookup is a fast first guess; on a miss every peak level is tried and the one whose
        # least-squares fit is closest wins (ties: the smaller level, i.e. the coarser grid).
        best_e = np.inf
        for mm in range(1, 9 if neg_only else 8):
            em = _fit_error(_levels(mm / safe, x, q, aq, nib, 0, regular), q, x, inv)
            if em < best_e:
                best_e, m = em, mm
    off = e > 2.0
    if off and nf == 0:  # past the tolerance: on the grid all the same if another candidate is within it
        off = _min_worst(s, sa, da, has_a, m_a == m, sig, minexp, vmax, aq, ax, af, inv, rt, err, cand) > 2.0
    no, sqo, eo, eto = 0, 0.0, 0.0, 0.0
    if other or off:
        osig, ominexp, ovmax = ofmt
        co, ao, no, sqo, eo, eto = _choose(s, sa, da, has_a, m_a == m, nf, amax, kx, spread, min_error, osig,
                                           ominexp, ovmax, aq, ax, af, bn, inv, rt, err, cand, auth)
    return c, a, (n, sq, e, et), (no, sqo, eo, eto), off


@jit
def _one_group(words, r, g, table, lowbit, fmt, ofmt, min_error, other, packed, x, ax, af, bn, inv, q, aq, nib, rt,
               err, cand, auth):
    # The whole algorithm for group g of row r, one group at a time; writes its packed words, returns
    # (scale, (exact, sq, worst, summed error) for fmt and for ofmt, off the grid, NaN/inf count, -0 count, sum x^2)
    nf, nz, sxx, kx = _decode(words, r, g * 32, x, ax, af, bn, inv)
    c, a, fig, fig_o, off = _group(x, ax, af, bn, inv, nf, kx, table, lowbit, fmt, ofmt, min_error, other, q, aq,
                                   nib, rt, err, cand, auth)
    ua = int(a)
    for j in range(4):
        word = np.uint32(0)
        for t in range(8):
            word |= nib[ua, j * 8 + t] << np.uint32(4 * t)
        packed[r, g * 4 + j] = word
    return c, fig, fig_o, off, nf, nz, sxx


# ---------------------------------------------------------------------------------------------------------
# Groups side by side: the same decisions for CHUNK groups at once, value i of group k at [i, k], so that every
# loop over a group's 32 values runs across groups (vector registers, no per-group calls, each group's sums still
# left to right: the reference's order, exact or not). A group with anything uncommon (a NaN/inf, an author's m
# other than the ratio lookup's, a target error past the tolerance) goes through _one_group instead.

CHUNK = 64


@jit
def _columns(wf, start, n, wt, x, af, nf, nz, sxx, kx, pmax, pmin):
    # groups start.. start + n - 1 of the block (wf: its words, flat) decoded as _decode does, value i of group k
    # at [i, k]: the values, their magnitudes in float32 only (exact; widened where a pass computes in float64) and
    # no 1/ulp (_errors_cols takes it from the exponent bits), which leaves less to store per value; each group's
    # largest and smallest value (pmax, pmin) for _peaks
    for k in range(n):
        pmax[k] = -np.inf
        pmin[k] = np.inf
        base = (start + k) * 32
        for i in range(32):
            wt[i, k] = wf[base + i]
        nf[k] = 0
        nz[k] = 0
        sxx[k] = 0.0
        kx[k] = NO_QUANTUM
    for i in range(32):
        for k in range(n):
            w = np.int32(wt[i, k])
            e = (w >> 7) & 0xFF
            fin = e != 0xFF
            v = np.int32((w << 16) if fin else 0).view(np.float32)
            x[i, k] = v
            af[i, k] = abs(v)
            pmax[k] = v if v > pmax[k] else pmax[k]
            pmin[k] = v if v < pmin[k] else pmin[k]
            nf[k] += not fin
            nz[k] += w == 0x8000
            sxx[k] += np.float64(v) * v
            kx[k] = min(kx[k], max(e, 1) - 134 if fin and w & 0x7FFF else NO_QUANTUM)


@jit
def _peaks(x, n, table, lowbit, amax, safe, mask, m, neg, bins):
    # _peak_level for every group: amax, safe, the ratio mask and its m, the peak negative only (bins: scratch).
    # amax and safe hold each group's largest and smallest value (_columns) on entry
    for k in range(n):
        mask[k] = 0xFF
        pmax, pmin = amax[k], safe[k]
        amax[k] = max(pmax, -pmin)
        neg[k] = -pmin > pmax
        safe[k] = amax[k] if amax[k] > 0 else 1.0
    # The ratio bins first, then the table lookups in a loop of their own: less time than one loop doing both
    # (on an AVX2 EPYC, 186 -> 87 ns per group on uniform levels)
    for i in range(32):
        for k in range(n):
            b = np.int32(_rint(x[i, k] / safe[k] * 1024.0)) + np.int32(1024)  # int32: AVX2 converts it in vectors
            bins[i, k] = min(max(b, np.int32(0)), np.int32(2048))
    for k in range(n):  # each group's mask in a register (bins in [0, 2048]: an unsigned index, no wraparound test)
        mk = mask[k]
        for i in range(32):
            mk &= table[np.uint32(bins[i, k])]
        mask[k] = mk
    for k in range(n):
        if not neg[k]:
            mask[k] &= 0x7F
        mm = int(lowbit[mask[k]])
        m[k] = mm if mm else (8 if neg[k] else 7)


@jit
def _levels_cols(x, n, m, safe, q, aq, s, f, sqq, d, tol, bad, hist):
    # _levels of row 0 for every group (levels q, their magnitudes aq, the least-squares step s) and, from the same
    # levels, the article author's test of the lookup's m: bad[k] values farther than safe * 2^-7 from their level
    # times safe / m (_author_misses); hist[k]: how many values have each level magnitude a, 6 bits from bit 6a
    # (at most 32 each). f, sqq, d, tol: scratch
    for k in range(n):
        hist[k] = 0
        f[k] = m[k] / safe[k]
        d[k] = safe[k] / m[k]
        tol[k] = safe[k] * AUTHOR_TOL
        sqq[k] = 0.0
        s[k] = 0.0
        bad[k] = 0
    for i in range(32):
        for k in range(n):
            l = min(max(_rint(x[i, k] * f[k]), -8.0), 7.0)
            q[i, k] = l
            aq[i, k] = abs(l)
            hist[k] += np.int64(1) << np.int64(6 * np.int32(abs(l)))
            sqq[k] += l * l
            s[k] += l * x[i, k]
            bad[k] += not abs(l * d[k] - x[i, k]) <= tol[k]
    for k in range(n):
        s[k] = s[k] / sqq[k] if sqq[k] else 0.0


@jit
def _author_cols(x, n, mask, m, safe, bad, ma, xg):
    # _author_m for every group: ma[k] the first m of the ratio mask passing the author's test (0: none). The
    # mask's first m is the ratio lookup's, whose misses _levels_cols counted; the rest group by group (xg scratch)
    for k in range(n):
        ma[k] = m[k] if mask[k] and bad[k] == 0 else 0
        rest = mask[k] & ~((1 << m[k]) - 1) if mask[k] and bad[k] else 0  # the mask's m above the first
        if rest:
            for i in range(32):
                xg[i] = x[i, k]
            tk = safe[k] * AUTHOR_TOL
            for mm in range(m[k] + 1, 9):
                if (rest >> (mm - 1)) & 1 and _author_misses(xg, mm / safe[k], safe[k] / mm, tk) == 0:
                    ma[k] = mm
                    break


@jit
def _spread_cols(aq, af, n, hi, lo, vmin):
    # _ratio_spread of row 0 for every group
    for k in range(n):
        hi[k] = np.float32(0.0)
        lo[k] = np.float32(np.inf)
        vmin[k] = np.float32(np.inf)
    for i in range(32):
        for k in range(n):
            a = aq[i, k]
            on = a > 0
            r = af[i, k] / (a if on else np.float32(1.0))
            hi[k] = r if on & (r > hi[k]) else hi[k]
            lo[k] = r if on & (r < lo[k]) else lo[k]
            vmin[k] = af[i, k] if on & (af[i, k] < vmin[k]) else vmin[k]


@jit
def _eval_cols(cand, j, aq, af, n, sig, cnt, sq):
    # candidate j's runtime values for every group: exact count and squared error, left to right
    for k in range(n):
        cnt[k] = 0
        sq[k] = 0.0
    for i in range(32):
        for k in range(n):
            r = _round_t(np.float32(cand[j, k]) * aq[i, k], sig)
            cnt[k] += r == af[i, k]
            d = np.float64(r) - np.float64(af[i, k])
            sq[k] += d * d


@jit
def _per_level_cols(aq, af, n, hist, cnt, tot):
    # per group and level magnitude a = 0..8 (row a; row 0 unused): how many values have it (from _levels_cols'
    # hist), and their magnitudes' sum. Values outer, groups inner: consecutive updates go to different groups (no
    # chain through memory), and each group's sum is still in value order.
    for a in range(9):
        for k in range(n):
            cnt[a, k] = np.float64((hist[k] >> np.int64(6 * a)) & 63)
            tot[a, k] = 0.0
    # flat, with an unsigned index: a signed one computed from a level costs a wraparound test per update
    tf = tot.reshape(9 * tot.shape[1])
    w = np.uint64(tot.shape[1])
    for i in range(32):
        for k in range(n):
            tf[np.uint64(np.uint32(aq[i, k])) * w + np.uint64(k)] += np.float64(af[i, k])


@jit
def _sq_levels_cols(cand, j, cnt, tot, grp, n, sig, minexp, sq, exact):
    # The squared runtime error of candidate j for every group from the per-level sums (no pass over the values):
    # sum x^2 + sum over a of T(c*a) (count_a T(c*a) - 2 sum_a |x|). Equal to the reference's left-to-right sum
    # where exact[k]: T(8c) and amax below 2^(23+k), k the smallest quantum of the values and of c in T. In units of
    # 2^k every runtime value and |x| is then an integer below 2^23, so each term, factor and partial sum of either
    # form is an integer below 2^53 (a partial sum of the terms is a sum of r (r - 2|x|) over values, each below
    # 2^47 in magnitude; the whole is the sum of (r - |x|)^2, below 2^51).
    kx, amax, sxx = grp[3], grp[4], grp[5]
    for k in range(n):
        c = cand[j, k]
        kc = max(_ilogb(c if c > 0.0 else 1.0) - sig + 1, minexp)
        kk = min(kx[k], kc) if c > 0.0 else kx[k]
        top = max(np.float64(_round_t(np.float32(8.0 * c), sig)), amax[k])
        exact[k] = kx[k] == NO_QUANTUM or top < _exp2(min(23 + kk, 1023))  # NO_QUANTUM: every value zero
        sq[k] = 0.0
    top_t = np.float32(65504.0) if sig == FP16_SIG else np.float32(np.inf)  # T's largest value past float32's
    for a in range(1, 9):
        fa = np.float32(a)
        if a & (a - 1):  # 3, 5, 6, 7: c*a rounded in T
            for k in range(n):
                r = np.float64(_round_t(np.float32(cand[j, k]) * fa, sig))
                sq[k] += r * (cnt[a, k] * r - 2.0 * tot[a, k])
        else:  # 1, 2, 4, 8: c (a value of T) times a power of two is one too, unless past T's largest
            for k in range(n):
                p = np.float32(cand[j, k]) * fa
                r = np.float64(p if p <= top_t else np.float32(np.inf))
                sq[k] += r * (cnt[a, k] * r - 2.0 * tot[a, k])
    for k in range(n):
        sq[k] += sxx[k]


@jit
def _errors_cols(c, aq, af, n, sig, worst, tot, cnt):
    # _errors of each group's chosen scale: worst and summed error in ulps, values exact (1/ulp from the value's
    # exponent bits as _decode takes it; a NaN/inf, decoded as 0, is in no group these figures are used for)
    for k in range(n):
        worst[k] = 0.0
        tot[k] = 0.0
        cnt[k] = 0.0
    for i in range(32):
        for k in range(n):
            r = _round_t(np.float32(c[k]) * aq[i, k], sig)
            ex = max((np.float32(af[i, k]).view(np.int32) >> 23) & 0xFF, 1)
            e = abs(np.float64(r) - np.float64(af[i, k])) * np.int64((1157 - ex) << 52).view(np.float64)
            worst[k] = e if e > worst[k] else worst[k]
            tot[k] += e
            cnt[k] += r == af[i, k]


@jit
def _round_cols(s, n, sig, minexp, vmax, c0, cd, cu):
    # _round_fmt of every s[k] >= 0, its expressions without branches
    for k in range(n):
        pos = s[k] > 0.0
        c = _nearest(min(s[k], vmax) if pos else 1.0, sig, minexp)
        e0 = _ilogb(c)
        qu0 = _exp2(max(e0 - sig + 1, minexp))
        qd = qu0 * 0.5 if c == _exp2(e0) and e0 - sig >= minexp else qu0
        c0[k] = c if pos else 0.0
        cd[k] = max(c - qd, 0.0) if pos else 0.0
        cu[k] = min(c + qu0, vmax) if pos else 0.0


@jit
def _round1_cols(s, n, sig, minexp, vmax, c0):
    # _round1 of every s[k] >= 0: _round_cols' nearest value alone
    for k in range(n):
        pos = s[k] > 0.0
        c = _nearest(min(s[k], vmax) if pos else 1.0, sig, minexp)
        c0[k] = c if pos else 0.0


@jit
def _unbounded_cols(aq, af, n, sig, minexp, spread, lo, hi, out):
    # _surely_unbounded, else _surely_unbounded_per_value, for every group: out[k] where no scale can reproduce
    # every value of group k
    rmax, rmin, vmin = spread
    hs = np.float32(_exp2(-sig))
    for k in range(n):
        lo[k] = np.float32(0.0)
        hi[k] = np.float32(np.inf)
    for i in range(32):
        for k in range(n):
            a = aq[i, k]
            on = a > 0
            rl = np.float32(1.0) / (a if on else np.float32(1.0))
            h = np.int32(np.float32(af[i, k]).view(np.int32) & 0x7F800000).view(np.float32) * hs  # binade * 2^-sig
            vlo = (af[i, k] - h) * rl if on else np.float32(0.0)
            vhi = (af[i, k] + h) * rl if on else np.float32(np.inf)
            lo[k] = vlo if vlo > lo[k] else lo[k]
            hi[k] = vhi if vhi < hi[k] else hi[k]
    for k in range(n):
        vm = np.float64(vmin[k])
        out[k] = (_surely_unbounded(np.float64(rmax[k]), np.float64(rmin[k]), vm, sig, minexp)
                  or (_normal_in_t(vm, sig, minexp) and np.float64(lo[k]) > np.float64(hi[k]) * (1.0 + 2.0 ** -20)))


@jit_minmax
def _bounds_cols(aq, af, n, sig, minexp, vmax, lb, ub):
    # _bounds of row 0 for every group at once: _value_bounds' expressions without branches (a value at level 0
    # computed on 1.0 and left out), across groups on vector registers; the same terms, and a maximum and a
    # minimum (any order) of them
    for k in range(n):
        lb[k] = 0.0
        ub[k] = np.inf
    for i in range(32):
        for k in range(n):
            a = aq[i, k]
            on = a > 0
            v = np.float64(af[i, k])  # loaded unconditionally: a conditional load or store is a masked one (slow on AMD)
            v = v if on else 1.0
            e = _ilogb(v)
            big = max(e, minexp + sig - 1)
            kq = max(big - sig + 1, minexp)
            u = _exp2(kq)
            ud = u * 0.5 if (v == _exp2(e)) & (big - sig >= minexp) else u
            nq = v * _exp2(-kq)  # v / u exactly, below 2^12
            odd = (np.int32(nq) & np.int32(1)) == np.int32(1)
            lo = v - ud * 0.5
            hi = v + u * 0.5
            lo = lo + abs(lo) * EXCL if odd else lo
            hi = hi - abs(hi) * EXCL if odd else hi
            rep = (nq == _rint(nq)) & (v <= vmax)
            rl = 1.0 / np.float64(a if on else np.float32(1.0))
            tl = lo * rl if rep else np.inf
            th = hi * rl if rep else -np.inf
            lb[k] = max(lb[k], tl if on else 0.0)  # lb >= 0: a value at level 0 leaves it
            ub[k] = min(ub[k], th if on else np.inf)


@jit
def _choose_cols(fmt, min_error, n, grp, spread, aq, af, levels, scr, cand, ok, cnt, sq, exact, res, hard):
    # _choose for every group (the author's m is the ratio lookup's or none, no NaN/inf): the candidates of _search
    # in its order (the author's least-squares step is the first candidate again: not a slot), each valid for some
    # group evaluated for all, the same choice rule; then the chosen scale's error figures. res: scale, exact
    # count, sq, worst and summed error. hard[k]: group k needs _one_group (min-error: a tie, or a squared error
    # the per-level form cannot give exactly)
    sig, minexp, vmax = fmt
    s, safe, ma = grp[0], grp[1], grp[2]
    _candidates_cols(fmt, n, s, safe, ma, spread, aq, af, scr, cand, ok, res[3:5])
    bc, bcnt, bsq = res[0], res[1], res[2]
    for k in range(n):
        hard[k] = False
    for j in range(8):
        need = False
        for k in range(n):
            need = need or ok[j, k]
        if not need:
            continue
        if min_error:
            _sq_levels_cols(cand, j, levels[0], levels[1], grp, n, sig, minexp, sq, exact)
            for k in range(n):
                take = (j == 0) | (ok[j, k] & (bsq[k] != 0.0))  # at 0 every value is exact: nothing is better
                hard[k] = hard[k] | (take & (~exact[k] | ((j > 0) & (sq[k] == bsq[k]))))  # a tie: the counts
                better = take & ((j == 0) | (sq[k] < bsq[k]))
                bc[k] = cand[j, k] if better else bc[k]
                bsq[k] = sq[k] if better else bsq[k]
        else:
            _eval_cols(cand, j, aq, af, n, sig, cnt, sq)
            for k in range(n):
                nn, e = cnt[k], sq[k]
                if j == 0 or (ok[j, k] and (nn > bcnt[k] or (nn == bcnt[k] and e < bsq[k]))):
                    bc[k], bcnt[k], bsq[k] = cand[j, k], nn, e
    _errors_cols(bc, aq, af, n, sig, res[3], res[4], bcnt)


@jit
def _candidates_cols(fmt, n, s, safe, ma, spread, aq, af, scr, cand, ok, lbub):
    # _search's candidates for every group, slot j of group k at [j, k], ok[j, k] where valid and not a duplicate
    sig, minexp, vmax = fmt
    aqg, ax1, lo, hi = scr
    _round_cols(s, n, sig, minexp, vmax, cand[0], cand[1], cand[2])
    _round1_cols(s, n, 8, -133, BF16_MAX, cand[7])  # bf16 of the step, then T (slot 7)
    _round1_cols(cand[7], n, sig, minexp, vmax, cand[7])
    for k in range(n):
        mk = np.int32(ma[k])  # 1..8 or 0: int32 converts to float64 on vector registers, int64 does not
        cand[6, k] = safe[k] / np.float64(mk) if mk else 0.0
    _round1_cols(cand[6], n, sig, minexp, vmax, cand[6])
    _unbounded_cols(aq, af, n, sig, minexp, spread, lo, hi, ok[3])
    need = 0
    for k in range(n):
        need += not ok[3, k]
    # The exact interval for every group in one vector pass where many need it (peaked levels: most do), else
    # group by group: on an AVX2 EPYC the pass costs what about a sixth of the chunk's groups take one at a time
    cols = need * 4 >= n
    if cols:
        _bounds_cols(aq, af, n, sig, minexp, vmax, lbub[0], lbub[1])
    for k in range(n):
        if ok[3, k]:  # no scale reproduces every value
            lbub[0, k], lbub[1, k] = 1.0, 0.0
            continue
        if not cols:
            for i in range(32):
                aqg[0, i] = aq[i, k]
                ax1[i] = af[i, k]
            lbub[0, k], lbub[1, k] = _bounds(aqg, ax1, sig, minexp, vmax)
        if lbub[0, k] <= lbub[1, k]:
            cand[3, k], cand[4, k], cand[5, k] = _round_fmt(min(max(s[k], lbub[0, k]), lbub[1, k]), sig, minexp, vmax)
    for j in range(8):  # (branch-free: & and | rather than and and or)
        for k in range(n):
            ok[j, k] = (j < 3) | ((j < 6) & (lbub[0, k] <= lbub[1, k])) | ((j >= 6) & (ma[k] > 0))
        for t in range(j):  # a duplicate cannot be strictly better
            for k in range(n):
                ok[j, k] = ok[j, k] & ~(ok[t, k] & (cand[t, k] == cand[j, k]))


@jit
def quantize_rows(words, packed, scales, stats, ratio_table, lowbit, sig, minexp, vmax, osig, ominexp, ovmax,
                  min_error, other_every):
    """grid.run_kernel's call: every group of words (uint16 [rows, cols]) into packed (uint32 [rows, cols/8]),
    scales (float64 [rows, cols/32]) and the stats vector (grid.S_*); the other format's figures from the groups
    of every other_every-th chunk of CHUNK (grid.in_other_sample)."""
    return _rows(words, packed, scales, stats, ratio_table, lowbit, (sig, minexp, vmax), (osig, ominexp, ovmax),
                 min_error, other_every, True)


@jit
def quantize_rows_per_group(words, packed, scales, stats, ratio_table, lowbit, sig, minexp, vmax, osig, ominexp,
                            ovmax, min_error, other_every):
    """quantize_rows with every group through _one_group (the kernel before groups were side by side; tests)."""
    return _rows(words, packed, scales, stats, ratio_table, lowbit, (sig, minexp, vmax), (osig, ominexp, ovmax),
                 min_error, other_every, False)


@jit_inline
def _account(acc, stats, gi, ng, fig, fig_o, off, nf, nz, sxx, other):
    # group gi's figures (row-major, ng groups a row) into the block's totals, in group order (the sums' order is
    # the block's); the other format's only for a group of its sample
    acc[0] += fig[0]
    acc[2] += fig[1]
    acc[4] = max(acc[4], fig[2])
    acc[6] += fig[3]
    if other:
        acc[1] += fig_o[0]
        acc[3] += fig_o[1]
        acc[5] = max(acc[5], fig_o[2])
        acc[7] += fig_o[3]
        acc[12] += 1
        acc[13] += sxx
    acc[8] += sxx
    acc[9] += nz
    acc[10] += nf
    if off:
        if acc[11] == 0:
            r = gi // ng
            stats[6] = r
            stats[7] = gi - r * ng
            stats[8] = fig[2]
            stats[9] = fig_o[2]
            stats[17] = nf > 0
        acc[11] += 1


@jit
def _pack_cols(q, n, start, fast, pf, words32):
    # the nibbles (level + 8) of row 0's levels, eight to a word, for the groups of the fast path
    for j in range(4):
        for k in range(n):
            words32[j, k] = 0
        for t in range(8):
            for k in range(n):
                words32[j, k] |= np.uint32(np.int32(q[j * 8 + t, k]) + 8) << np.uint32(4 * t)
    for k in range(n):
        if fast[k]:
            for j in range(4):
                pf[(start + k) * 4 + j] = words32[j, k]


@jit
def _rows(words, packed, scales, stats, table, lowbit, fmt, ofmt, min_error, other_every, side_by_side):
    # scratch allocated once per call: one group's (_one_group) and CHUNK groups' (value i of group k at [i, k])
    x, ax, inv = np.empty(32), np.empty(32), np.empty(32)
    af, bn = np.empty(32, dtype=np.float32), np.empty(32, dtype=np.float32)
    q, aq = np.empty((2, 32)), np.empty((2, 32), dtype=np.float32)
    nib = np.empty((2, 32), dtype=np.uint32)
    rt, err = np.empty(32, dtype=np.float32), np.empty(32)
    cand, auth = np.empty(9), np.empty(9, dtype=np.bool_)
    wt, bins = np.empty((32, CHUNK), dtype=np.uint16), np.empty((32, CHUNK), dtype=np.int32)
    words32 = np.empty((4, CHUNK), dtype=np.uint32)
    xc, qc = np.empty((32, CHUNK)), np.empty((32, CHUNK), dtype=np.float32)  # levels -8..7: exact in float32
    afc, aqc = np.empty((32, CHUNK), dtype=np.float32), np.empty((32, CHUNK), dtype=np.float32)
    # NaN/inf, -0, ratio mask, m, author's m, misses, exact count, kx, level histogram
    ints = np.zeros((9, CHUNK), dtype=np.int64)
    nf, nz, mask, m, ma, bad, cnt, kx = ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6], ints[7]
    hist = ints[8]
    levels = (np.empty((9, CHUNK)), np.empty((9, CHUNK)))  # per level magnitude 0..8: count, sum of |x|
    fl = np.zeros((9, CHUNK))
    sxx, amax, safe, s, f, sqq, sq, d, tol = fl[0], fl[1], fl[2], fl[3], fl[4], fl[5], fl[6], fl[7], fl[8]
    f32 = np.empty((5, CHUNK), dtype=np.float32)
    spread = (f32[0], f32[1], f32[2])
    scr = (aq, ax, f32[3], f32[4])
    neg, fast = np.empty(CHUNK, dtype=np.bool_), np.zeros(CHUNK, dtype=np.bool_)
    hard = np.empty((2, CHUNK), dtype=np.bool_)
    grp = (s, safe, ma, kx, amax, sxx)
    candc, ok = np.empty((8, CHUNK)), np.empty((8, CHUNK), dtype=np.bool_)
    res = np.zeros((10, CHUNK))  # per format: scale, exact count, sq, worst, summed error
    acc = np.zeros(14)
    rows, cols = words.shape
    ng = cols // 32
    # flat views: group gi's words, packed words and scale at gi * 32, gi * 4 and gi (no division per group)
    wf, pf, sf = words.reshape(rows * cols), packed.reshape(rows * ng * 4), scales.reshape(rows * ng)
    for start in range(0, rows * ng, CHUNK):
        n = min(CHUNK, rows * ng - start)
        other = other_every > 0 and (start // CHUNK) % other_every == 0  # the other format's sample
        if side_by_side:
            _columns(wf, start, n, wt, xc, afc, nf, nz, sxx, kx, amax, safe)
            _peaks(xc, n, table, lowbit, amax, safe, mask, m, neg, bins)
            _levels_cols(xc, n, m, safe, qc, aqc, s, f, sqq, d, tol, bad, hist)
            _author_cols(xc, n, mask, m, safe, bad, ma, x)
            _spread_cols(aqc, afc, n, spread[0], spread[1], spread[2])
            if min_error:
                _per_level_cols(aqc, afc, n, hist, levels[0], levels[1])
            for k in range(n):
                hard[1, k] = False
            for o in range(2 if other else 1):
                _choose_cols(fmt if o == 0 else ofmt, min_error, n, grp, spread, aqc, afc, levels, scr,
                             candc, ok, cnt, sq, fast, res[5 * o:5 * o + 5], hard[o])
            for k in range(n):  # else: an author's grid of its own, a NaN/inf, the target past the tolerance, ...
                fast[k] = (nf[k] == 0 and (ma[k] == 0 or ma[k] == m[k]) and res[3, k] <= 2.0 and not hard[0, k]
                           and not hard[1, k])
            _pack_cols(qc, n, start, fast, pf, words32)
        for k in range(n):
            gi = start + k
            if fast[k]:
                sf[gi] = res[0, k]
                _account(acc, stats, gi, ng, (res[1, k], res[2, k], res[3, k], res[4, k]),
                         (res[6, k], res[7, k], res[8, k], res[9, k]), False, nf[k], nz[k], sxx[k], other)
            else:
                r = gi // ng
                c, fig, fig_o, off, nfg, nzg, sxg = _one_group(words, r, gi - r * ng, table, lowbit, fmt, ofmt,
                                                                min_error, other, packed, x, ax, af, bn, inv, q, aq,
                                                                nib, rt, err, cand, auth)
                sf[gi] = c
                _account(acc, stats, gi, ng, fig, fig_o, off, nfg, nzg, sxg, other)
    stats[0] = rows * ng
    stats[1], stats[2] = acc[0], acc[1]
    stats[3], stats[4] = acc[4], acc[5]
    stats[11], stats[12] = acc[6], acc[7]
    stats[13], stats[14] = acc[2], acc[3]
    stats[5] = acc[11]
    stats[10] = acc[10]
    stats[15] = acc[8]
    stats[16] = acc[9]
    stats[18], stats[19] = acc[12], acc[13]
