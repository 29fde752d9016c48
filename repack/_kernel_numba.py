"""The numba kernel behind `repack.grid.quantize`: the algorithm of `quantize_numpy`, one group at a time.

Plain numba: loops over a group's 32 values that take every decision the reference takes, on the same numbers.
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

# One njit decorator for all: compiled into numba's on-disk cache, callable without the GIL.
jit = nb.njit(cache=True, nogil=True)
# For the loops taking maxima and minima: no NaN reaches them (a NaN source is decoded as 0) and the sign of a
# zero never decides, so they may be computed in any order, on vector registers.
jit_minmax = nb.njit(cache=True, nogil=True, fastmath={"nnan", "nsz"})


@jit
def _rint(v):
    return (v + RND) - RND


@jit
def _exp2(k):
    # 2^k for a normal float64 (-1022 <= k <= 1023), from its exponent bits
    return np.int64((k + 1023) << 52).view(np.float64)


@jit
def _ilogb(v):
    # floor(log2(v)) of a normal float64 v > 0, from its exponent bits
    return ((np.float64(v).view(np.int64) >> 52) & 0x7FF) - 1023


@jit
def _round_fmt(s, sig, minexp, vmax):
    # nearest representable value of a format with `sig` significand bits, and its two neighbours
    if s <= 0.0:
        return 0.0, 0.0, 0.0
    if s > vmax:
        s = vmax
    kq = max(_ilogb(s) - sig + 1, minexp)
    qu = _exp2(kq)
    c0 = _rint(s * _exp2(-kq)) * qu  # s * 2^-kq is s / qu exactly (a power-of-two scaling)
    e0 = _ilogb(c0)
    qu0 = _exp2(max(e0 - sig + 1, minexp))
    qd = qu0
    if c0 == _exp2(e0) and e0 - sig >= minexp:  # a power of two: finer spacing below
        qd = qu0 * 0.5
    return c0, max(c0 - qd, 0.0), min(c0 + qu0, vmax)


@jit
def _round1(s, sig, minexp, vmax):
    return _round_fmt(s, sig, minexp, vmax)[0]


@nb.njit(cache=True, nogil=True, fastmath={"reassoc"})  # only sum x^2, a report total, is reordered
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


@nb.njit(cache=True, nogil=True, fastmath={"reassoc"})
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


@jit
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


@nb.njit(cache=True, nogil=True, fastmath={"reassoc"})
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


@nb.njit(cache=True, nogil=True, fastmath={"reassoc"})
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
def _group(x, ax, af, bn, inv, nf, kx, table, lowbit, fmt, ofmt, min_error, q, aq, nib, rt, err, cand, auth):
    # One decoded group: its levels (rows 0 and 1 of q, aq, nib: the ratio lookup's m, the author's m), the
    # scale chosen for the target format `fmt` (sig, minexp, vmax) and the other format's search for the
    # report. Returns (scale, uses row 1, (exact, sq, worst, summed error) for fmt and for ofmt, off the grid).
    sig, minexp, vmax = fmt
    amax, safe, neg_only, mask, m = _peak_level(x, table, lowbit)
    regular = kx == NO_QUANTUM or amax < _exp2(45 + kx)
    m_a = _author_m(x, mask, safe)
    has_a = m_a > 0
    da = safe / m_a if has_a else 0.0
    for attempt in range(2):
        s = _levels(m / safe, x, q, aq, nib, 0, regular)
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
    osig, ominexp, ovmax = ofmt
    co, ao, no, sqo, eo, eto = _choose(s, sa, da, has_a, m_a == m, nf, amax, kx, spread, min_error, osig, ominexp, ovmax,
                                       aq, ax, af, bn, inv, rt, err, cand, auth)
    off = e > 2.0
    if off and nf == 0:  # past the tolerance: on the grid all the same if another candidate is within it
        off = _min_worst(s, sa, da, has_a, m_a == m, sig, minexp, vmax, aq, ax, af, inv, rt, err, cand) > 2.0
    return c, a, (n, sq, e, et), (no, sqo, eo, eto), off


@jit
def quantize_rows(words, packed, scales, stats, ratio_table, lowbit, sig, minexp, vmax, osig, ominexp, ovmax,
                  min_error):
    """grid.run_kernel's call: every group of words (uint16 [rows, cols]) into packed (uint32 [rows, cols/8]),
    scales (float64 [rows, cols/32]) and the stats vector (grid.S_*)."""
    # scratch for one group, allocated once per call: the values (_decode), the levels of the ratio lookup's m
    # and of the author's m (rows 0 and 1), a runtime table and the candidates
    x, ax, inv = np.empty(32), np.empty(32), np.empty(32)
    af, bn = np.empty(32, dtype=np.float32), np.empty(32, dtype=np.float32)
    q, aq = np.empty((2, 32)), np.empty((2, 32), dtype=np.float32)
    nib = np.empty((2, 32), dtype=np.uint32)
    rt, err = np.empty(32, dtype=np.float32), np.empty(32)
    cand, auth = np.empty(9), np.empty(9, dtype=np.bool_)
    fmt, ofmt = (sig, minexp, vmax), (osig, ominexp, ovmax)
    rows, cols = words.shape
    ng = cols // 32
    n_exact = n_exact_o = 0
    sqsum = sqsum_o = worst = worst_o = esum = esum_o = x2 = 0.0
    n_negzero = n_nonfinite = n_off = 0
    for r in range(rows):
        for g in range(ng):
            nf, nz, sxx, kx = _decode(words, r, g * 32, x, ax, af, bn, inv)
            x2 += sxx
            n_negzero += nz
            n_nonfinite += nf
            c, a, fig, fig_o, off = _group(x, ax, af, bn, inv, nf, kx, ratio_table, lowbit, fmt, ofmt, min_error,
                                           q, aq, nib, rt, err, cand, auth)
            n_exact += fig[0]
            n_exact_o += fig_o[0]
            sqsum += fig[1]
            sqsum_o += fig_o[1]
            worst = max(worst, fig[2])
            worst_o = max(worst_o, fig_o[2])
            esum += fig[3]
            esum_o += fig_o[3]
            if off:
                if n_off == 0:
                    stats[6] = r
                    stats[7] = g
                    stats[8] = fig[2]
                    stats[9] = fig_o[2]
                    stats[17] = nf > 0
                n_off += 1
            scales[r, g] = c
            ua = int(a)
            for j in range(4):
                word = np.uint32(0)
                for t in range(8):
                    word |= nib[ua, j * 8 + t] << np.uint32(4 * t)
                packed[r, g * 4 + j] = word
    stats[0] = rows * ng
    stats[1], stats[2] = n_exact, n_exact_o
    stats[3], stats[4] = worst, worst_o
    stats[11], stats[12] = esum, esum_o
    stats[13], stats[14] = sqsum, sqsum_o
    stats[5] = n_off
    stats[10] = n_nonfinite
    stats[15] = x2
    stats[16] = n_negzero
