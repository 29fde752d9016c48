"""The numba kernel behind `repack.grid.quantize`: the algorithm of `quantize_numpy`, one pass per group.

Kept in its own module so that importing the library never triggers compilation; numba caches the compiled
code next to this file (or in NUMBA_CACHE_DIR).

It takes every decision the reference takes, on the same numbers; what makes it fast:
- A candidate scale c has only 8 runtime magnitudes, R[a] = T(c * a) for a = 1..8 (T(-p) = -T(p)), each
  rounded branch-free by a magic-number add in its binade: 8 roundings per candidate, not 32.
- Its squared runtime error is sum x^2 + sum_a R[a] * (A[a] * R[a] - 2 * B[a]), with A[a] the number of values
  at level +-a and B[a] the sum of their magnitudes (per group, shared by every candidate with those levels).
  Every term is an integer multiple of 2^(2k) (2^k: the smallest quantum among the source values and c), and
  the partial sums of both this form and the reference's left-to-right sum of (T(c*q) - x)^2 are bounded by
  128 * max(R[8], amax)^2; when that is below 2^(53+2k) both are exact, hence equal. Otherwise (values spread
  over more than ~15 binades, overflow) the per-value left-to-right sum is taken.
- Values are counted exact (T(c*q) == x) only where the objective needs the count: every candidate for
  runtime-exact; for min-error a tie of squared errors and the chosen scale.
- The interval of scales reproducing every value is empty as soon as two values at one level differ (T(c*l)
  is one value); otherwise it is bounded by one value per level.
- The article author's m is the first m in 1..8 passing its test, and a passing m is always in the group's
  ratio mask (its tolerance, 2^-7 plus half a ratio bin, is inside the table's 0.0085, and fractions with
  denominators up to 8 are 1/56 apart): only the mask's m are tried.
- A candidate equal to one already evaluated (same value, same levels) cannot be strictly better.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

# Adding and subtracting 1.5 * 2^52 rounds a float64 of magnitude below 2^51 to the nearest integer, ties to
# even (the default rounding mode), exactly like rint but without a library call in the inner loops.
RND = 6755399441055744.0
AUTHOR_TOL = 2.0 ** -7
NO_QUANTUM = 10000  # exponent standing for "no nonzero source value"
BF16_MAX = 3.3895313892515355e38


@intrinsic
def _f2u(typingctx, v):
    """The bits of a float64 as an int64 (no memory round trip)."""
    if v != types.float64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


@intrinsic
def _u2f(typingctx, v):
    """An int64 bit pattern as a float64."""
    if v != types.int64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.int64), codegen


@nb.njit(cache=True, inline="always", _nrt=False)
def _rint(v):
    return (v + RND) - RND


@nb.njit(cache=True, inline="always", _nrt=False)
def _ilogb(v):
    # floor(log2(v)) of a positive normal float64, from its exponent bits
    return ((_f2u(v) >> 52) & 0x7FF) - 1023


@nb.njit(cache=True, inline="always", _nrt=False)
def _exp2(k):
    return _u2f((k + 1023) << 52)


@nb.njit(cache=True, inline="always", _nrt=False)
def _round_fmt(s, sig, minexp, vmax):
    # nearest representable value of a format with `sig` significand bits, and its two neighbours
    if s <= 0.0:
        return 0.0, 0.0, 0.0
    if s > vmax:
        s = vmax
    kq = max(_ilogb(s) - sig + 1, minexp)
    qu = _exp2(kq)
    # s * 2^-kq is s / qu exactly (a power-of-two scaling, far from overflow and underflow), without a division
    c0 = _rint(s * _exp2(-kq)) * qu
    e0 = _ilogb(c0)
    qu0 = _exp2(max(e0 - sig + 1, minexp))
    qd = qu0
    if c0 == _exp2(e0) and e0 - sig >= minexp:  # a power of two: finer spacing below
        qd = qu0 * 0.5
    return c0, max(c0 - qd, 0.0), min(c0 + qu0, vmax)


@nb.njit(cache=True, inline="always", _nrt=False)
def _round1(s, sig, minexp, vmax):
    c0, _, _ = _round_fmt(s, sig, minexp, vmax)
    return c0


# Reductions are separate (not numba-inlined) functions so that their own fastmath flags apply: "reassoc" lets
# LLVM vectorize a float sum, which is only done where every partial sum is exact (then any order gives the
# reference's left-to-right result) or where the figure is a report total compared with a tolerance.


@nb.njit(cache=True, fastmath={"reassoc", "nnan", "nsz"}, _nrt=False)
def _scan(words, r, base, value_tab, inv_tab, x, inv, wm):
    # decodes one group; returns (NaN/inf count, -0 count, sum x^2, max, min, smallest quantum exponent)
    nf = 0
    nz = 0
    sxx = 0.0
    pmax = -np.inf
    pmin = np.inf
    kx = NO_QUANTUM
    for i in range(32):
        w = np.int64(words[r, base + i])
        v = value_tab[w]
        x[i] = v
        inv[i] = inv_tab[w]
        wm[i] = w & 0x7FFF
        nf += (w & 0x7F80) == 0x7F80
        nz += w == 0x8000
        sxx += v * v
        pmax = max(pmax, v)
        pmin = min(pmin, v)
        # quantum exponent of a nonzero bf16 value (subnormals: that of the lowest binade)
        kq = max((w >> 7) & 0xFF, 1) - 134
        kx = min(kx, kq if v != 0.0 else NO_QUANTUM)
    return nf, nz, sxx, pmax, pmin, kx


@nb.njit(cache=True, _nrt=False)
def _ratio_mask(x, k, table):
    mask = 0xFF
    for i in range(32):
        b = int(_rint(x[i] * k)) + 1024
        b = min(max(b, 0), 2048)
        mask &= table[b]
    return mask


@nb.njit(cache=True, _nrt=False)
def _author_misses(x, fa, d, tol):
    # values farther than tol from their level (rounded, clipped to 4 bits) times d
    bad = 0
    for i in range(32):
        l = min(max(_rint(x[i] * fa), -8.0), 7.0)
        bad += not abs(l * d - x[i]) <= tol
    return bad


@nb.njit(cache=True, _nrt=False)
def _quantize_levels(f, x, q, qi, nib, j):
    # levels for the step 1/f (as floats, as table indices level + 8, as nibbles for packing) into row j;
    # returns sum q^2
    sqq = 0
    for i in range(32):
        l = min(max(_rint(x[i] * f), -8.0), 7.0)
        q[j, i] = l
        li = int(l) + 8
        qi[j, i] = li
        nib[j, i] = np.uint32(li)
        sqq += (li - 8) * (li - 8)
    return sqq


@nb.njit(cache=True, fastmath={"reassoc"}, _nrt=False)
def _dot_any_order(q, j, x):
    acc = 0.0
    for i in range(32):
        acc += q[j, i] * x[i]
    return acc


@nb.njit(cache=True, _nrt=False)
def _dot_in_order(q, j, x):
    acc = 0.0
    for i in range(32):
        acc += q[j, i] * x[i]
    return acc


@nb.njit(cache=True, inline="always", _nrt=False)
def _levels(f, x, wm, q, qi, nib, agg, wmin, wmax, regular, j):
    # levels for the step 1/f, their least-squares step, and per magnitude a = 1..8: the count (agg[0, a]) and
    # summed magnitude (agg[1, a]) of the values at level +-a, and the smallest and largest magnitude word among
    # them. `regular`: every partial sum of level * x is exact (any order gives the reference's sum).
    sqq = _quantize_levels(f, x, q, qi, nib, j)
    sqx = _dot_any_order(q, j, x) if regular else _dot_in_order(q, j, x)
    for a in range(9):
        agg[j, 0, a] = 0.0
        agg[j, 1, a] = 0.0
        wmin[j, a] = 0x10000
        wmax[j, a] = -1
    for i in range(32):
        a = abs(qi[j, i] - 8)
        agg[j, 0, a] += 1.0
        agg[j, 1, a] += abs(x[i])
        wmin[j, a] = min(wmin[j, a], wm[i])
        wmax[j, a] = max(wmax[j, a], wm[i])
    return sqx / sqq if sqq > 0 else 0.0


@nb.njit(cache=True, inline="always", _nrt=False)
def _bounds(agg, wmin, wmax, lo_t, hi_t, recip):
    # (levels of row 0: the interval candidates go with the ratio levels)
    # The interval of scales reproducing every value exactly (level 0 constrains nothing); the reference takes
    # max/min over the values of lo/l and hi/l, which for equal values at each level are the terms below
    # (a negative value's bounds are the negated bounds of its magnitude, and 1/-l = -(1/l) exactly).
    lb = 0.0
    ub = np.inf
    for a in range(1, 9):
        if agg[0, 0, a] > 0.0:
            if wmin[0, a] != wmax[0, a]:
                return 1.0, 0.0  # two values at one level: no scale reproduces both
            rl = recip[a + 8]
            lb = max(lb, lo_t[wmax[0, a]] * rl)
            ub = min(ub, hi_t[wmax[0, a]] * rl)
    return lb, ub


@nb.njit(cache=True, inline="always", _nrt=False)
def _runtime(c, rm, sig, minexp, vmax):
    # rm[a] = T(c * a) for a = 0..8, branch-free: with 2^kq the format's quantum in the product's binade,
    # (p + 1.5 * 2^(52+kq)) - 1.5 * 2^(52+kq) is p rounded to a multiple of 2^kq, ties to even (p < 2^(51+kq));
    # past the format's largest value: inf. Returns T(8c).
    for a in range(9):
        p = c * a
        kq = max(((_f2u(p) >> 52) & 0x7FF) - 1023 - sig + 1, minexp)
        mg = _u2f(((kq + 1075) << 52) | (np.int64(1) << 51))
        r = (p + mg) - mg
        rm[a] = r if r <= vmax else np.inf
    return rm[8]


@nb.njit(cache=True, inline="always", _nrt=False)
def _signed(rm, rs):
    # rs[l + 8] = T(c * l) for l = -8..8 (T(-p) = -T(p))
    for a in range(9):
        rs[8 + a] = rm[a]
        rs[8 - a] = -rm[a]


@nb.njit(cache=True, inline="always", _nrt=False)
def _sq(c, qi, j, agg, x, sxx, amax, kx, rm, rs, sig, minexp, vmax):
    # squared runtime error of scale c with levels qi: the per-level form where provably equal to the
    # reference's left-to-right sum, else that sum
    r8 = _runtime(c, rm, sig, minexp, vmax)
    if c > 0.0:
        k = min(kx, max(_ilogb(c) - sig + 1, minexp))
        if max(r8, amax) < _exp2(23 + k):
            acc = sxx
            for a in range(1, 9):
                r = rm[a]
                acc += r * (agg[j, 0, a] * r - 2.0 * agg[j, 1, a])
            return acc
    _signed(rm, rs)
    acc = 0.0
    for i in range(32):
        d = rs[qi[j, i]] - x[i]
        acc += d * d
    return acc


@nb.njit(cache=True, inline="always", _nrt=False)
def _count(c, qi, j, x, rm, rs, nf, sig, minexp, vmax):
    # values with T(c*q) == x (NaN/inf sources are 0 at level 0: counted here, so taken off)
    _runtime(c, rm, sig, minexp, vmax)
    _signed(rm, rs)
    n = 0
    for i in range(32):
        n += rs[qi[j, i]] == x[i]
    return n - nf


@nb.njit(cache=True, inline="always", _nrt=False)
def _search(s, qi, sa, da, has_a, same_a, x, agg, wmin, wmax, lo_t, hi_t, recip, sxx, amax, kx, nf,
            rm, rs, cand, auth, sig, minexp, vmax, min_error):
    # the candidates of grid._search, in the same order, skipping those that cannot be valid or cannot be
    # strictly better (a duplicate of one evaluated); stops once nothing can be strictly better (every finite
    # value exact). Returns (scale, uses the author's levels, count, sq).
    cand[0], cand[1], cand[2] = _round_fmt(s, sig, minexp, vmax)
    auth[0] = auth[1] = auth[2] = False
    nc = 3
    best = cand[0]
    ba = False
    bn = -1
    bsq = np.inf
    j = 0
    stage = 0
    while True:
        while j < nc:
            c = cand[j]
            a = auth[j]
            dup = False
            for t in range(j):
                dup |= (cand[t] == c) & (auth[t] == a)
            if dup:
                j += 1
                continue
            if min_error:
                sq = _sq(c, qi, int(a), agg, x, sxx, amax, kx, rm, rs, sig, minexp, vmax)
                if j == 0 or sq < bsq:
                    best, ba, bn, bsq = c, a, -1, sq
                elif sq == bsq:
                    n = _count(c, qi, int(a), x, rm, rs, nf, sig, minexp, vmax)
                    if bn < 0:
                        bn = _count(best, qi, int(ba), x, rm, rs, nf, sig, minexp, vmax)
                    if n > bn:
                        best, ba, bn, bsq = c, a, n, sq
                if bsq == 0.0:  # every value exact: sq == 0 for no other count
                    return best, ba, 32 - nf, bsq
            else:
                n = _count(c, qi, int(a), x, rm, rs, nf, sig, minexp, vmax)
                if n == 32:
                    return c, a, n, 0.0
                if n >= bn:
                    sq = _sq(c, qi, int(a), agg, x, sxx, amax, kx, rm, rs, sig, minexp, vmax)
                    if j == 0 or n > bn or sq < bsq:
                        best, ba, bn, bsq = c, a, n, sq
            j += 1
        # the next candidates, computed only when needed
        if stage == 0:
            stage = 1
            lb, ubnd = _bounds(agg, wmin, wmax, lo_t, hi_t, recip)
            if lb <= ubnd:
                cand[3], cand[4], cand[5] = _round_fmt(min(max(s, lb), ubnd), sig, minexp, vmax)
                auth[3] = auth[4] = auth[5] = False
                nc = 6
        elif stage == 1:
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
            return best, ba, bn, bsq  # bn < 0: not counted yet


@nb.njit(cache=True, inline="always", _nrt=False)
def _errors(c, qi, j, x, inv, nf, n, rm, rs, sig, minexp, vmax):
    # exact values (when n < 0), worst and summed runtime error in bf16 ulps of the source (a group holding
    # NaN/inf: worst is inf)
    if n == 32:  # every value exact (and finite)
        return n, 0.0, 0.0
    _runtime(c, rm, sig, minexp, vmax)
    _signed(rm, rs)
    m = 0.0
    t = 0.0
    ne = 0
    for i in range(32):
        r = rs[qi[j, i]]
        ne += r == x[i]
        e = abs(r - x[i]) * inv[i]
        m = max(m, e)
        t += e
    if nf:
        m = np.inf
    return (ne - nf if n < 0 else n), m, t


@nb.njit(cache=True, _nrt=False)
def _min_worst(s, qi, sa, da, has_a, same_a, x, agg, wmin, wmax, lo_t, hi_t, recip, inv, nf, rm, rs, cand,
               sig, minexp, vmax):
    # grid._min_worst: the smallest worst runtime error over every candidate of _search (the rare off-grid path)
    cand[0], cand[1], cand[2] = _round_fmt(s, sig, minexp, vmax)
    nc = 3
    lb, ubnd = _bounds(agg, wmin, wmax, lo_t, hi_t, recip)
    if lb <= ubnd:
        cand[3], cand[4], cand[5] = _round_fmt(min(max(s, lb), ubnd), sig, minexp, vmax)
        nc = 6
    best = np.inf
    for j in range(nc):
        best = min(best, _errors(cand[j], qi, 0, x, inv, nf, -1, rm, rs, sig, minexp, vmax)[1])
    if has_a:
        a = 0 if same_a else 1  # the same m gives the same levels (row 0)
        best = min(best, _errors(_round1(da, sig, minexp, vmax), qi, a, x, inv, nf, -1, rm, rs, sig, minexp,
                                 vmax)[1])
        best = min(best, _errors(_round1(sa, sig, minexp, vmax), qi, a, x, inv, nf, -1, rm, rs, sig, minexp,
                                 vmax)[1])
        best = min(best, _errors(_round1(_round1(sa, 8, -133, BF16_MAX), sig, minexp, vmax), qi, a, x, inv, nf,
                                 -1, rm, rs, sig, minexp, vmax)[1])
    return best


@nb.njit(cache=True, inline="always", _nrt=False)
def _err(c, q, x, inv):
    w = 0.0
    for i in range(32):
        w = max(w, abs(c * q[0, i] - x[i]) * inv[i])
    return w


@nb.njit(nogil=True, cache=True)
def quantize_rows(words, packed, scales, stats, ratio_table, lowbit, recip, value_tab, inv_tab,
                  lo_t, hi_t, lo_o, hi_o, sig, minexp, vmax, osig, ominexp, ovmax, min_error):
    # scratch space, allocated once per block; the work itself runs without reference counting (arrays are
    # only indexed there), which would otherwise cost atomic operations in the innermost loops
    # rows 0 / 1 of the 2-row arrays: the levels of the ratio lookup's m / of the article author's m
    _rows(words, packed, scales, stats, ratio_table, lowbit, recip, value_tab, inv_tab, lo_t, hi_t, lo_o, hi_o,
          sig, minexp, vmax, osig, ominexp, ovmax, min_error, np.empty(17), np.empty(9), np.empty(9),
          np.empty(9, dtype=np.bool_), np.empty((2, 2, 9)), np.empty((2, 9), dtype=np.int64),
          np.empty((2, 9), dtype=np.int64), np.empty(32), np.empty(32, dtype=np.int64), np.empty((2, 32)),
          np.empty((2, 32), dtype=np.int64), np.empty(32), np.empty((2, 32), dtype=np.uint32))


@nb.njit(nogil=True, cache=True, _nrt=False)
def _rows(words, packed, scales, stats, ratio_table, lowbit, recip, value_tab, inv_tab,
          lo_t, hi_t, lo_o, hi_o, sig, minexp, vmax, osig, ominexp, ovmax, min_error,
          rs, rm, cand, auth, agg, wmin, wmax, x, wm, q, qi, inv, nib):
    rows, cols = words.shape
    ng = cols // 32
    n_exact = 0
    n_exact_o = 0
    worst = 0.0
    worst_o = 0.0
    esum = 0.0
    esum_o = 0.0
    sqsum = 0.0
    sqsum_o = 0.0
    x2 = 0.0
    n_negzero = 0
    n_off = 0
    n_nonfinite = 0
    for r in range(rows):
        for g in range(ng):
            base = g * 32
            nf, nz, sxx, pmax, pmin, kx = _scan(words, r, base, value_tab, inv_tab, x, inv, wm)
            x2 += sxx
            n_negzero += nz
            n_nonfinite += nf
            amax = max(pmax, -pmin)
            neg_only = -pmin > pmax
            safe = amax if amax > 0 else 1.0
            # level * x sums: multiples of 2^kx below 2^8 * amax, exact when amax < 2^(45+kx)
            regular = kx == NO_QUANTUM or amax < _exp2(45 + kx)
            mask = _ratio_mask(x, 1024.0 / safe, ratio_table)
            if not neg_only:
                mask &= 0x7F
            m = lowbit[mask]
            if m == 0:
                m = 8 if neg_only else 7
            # the article author's grid: the first m whose step amax/m puts every value within amax * 2^-7;
            # only the m of the ratio mask can pass (see the module docstring)
            m_a = 0
            tol = safe * AUTHOR_TOL
            for mm in range(1, 9):
                if not (mask >> (mm - 1)) & 1:
                    continue
                if _author_misses(x, mm / safe, safe / mm, tol) == 0:
                    m_a = mm
                    break
            has_a = m_a > 0
            sa = 0.0
            da = 0.0
            s = _levels(m / safe, x, wm, q, qi, nib, agg, wmin, wmax, regular, 0)
            if has_a:
                # the same m gives the same levels and step (then only q is used)
                if m_a != m:
                    sa = _levels(m_a / safe, x, wm, q, qi, nib, agg, wmin, wmax, regular, 1)
                else:
                    sa = s
                da = safe / m_a
            c, use_a, n, sq = _search(s, qi, sa, da, has_a, m_a == m, x, agg, wmin, wmax, lo_t, hi_t,
                                      recip, sxx, amax, kx, nf, rm, rs, cand, auth, sig, minexp, vmax, min_error)
            n, e, et = _errors(c, qi, int(use_a), x, inv, nf, n, rm, rs, sig, minexp, vmax)
            if e > 2.0:
                # The ratio lookup is a fast first guess; on a miss every peak level is tried and the one whose
                # least-squares fit is closest wins (ties: the smaller level, i.e. the coarser grid).
                best_m = m
                best_e = np.inf
                for mm in range(1, 9 if neg_only else 8):
                    sm = _levels(mm / safe, x, wm, q, qi, nib, agg, wmin, wmax, regular, 0)
                    em = _err(sm, q, x, inv)
                    if em < best_e:
                        best_e, best_m = em, mm
                m = best_m
                s = _levels(m / safe, x, wm, q, qi, nib, agg, wmin, wmax, regular, 0)
                if has_a:
                    if m_a != m:
                        sa = _levels(m_a / safe, x, wm, q, qi, nib, agg, wmin, wmax, regular, 1)
                    else:
                        sa = s
                c, use_a, n, sq = _search(s, qi, sa, da, has_a, m_a == m, x, agg, wmin, wmax, lo_t,
                                          hi_t, recip, sxx, amax, kx, nf, rm, rs, cand, auth, sig, minexp, vmax,
                                          min_error)
                n, e, et = _errors(c, qi, int(use_a), x, inv, nf, n, rm, rs, sig, minexp, vmax)
            co, use_ao, no, sqo = _search(s, qi, sa, da, has_a, m_a == m, x, agg, wmin, wmax, lo_o,
                                          hi_o, recip, sxx, amax, kx, nf, rm, rs, cand, auth, osig, ominexp, ovmax,
                                          min_error)
            no, eo, eto = _errors(co, qi, int(use_ao), x, inv, nf, no, rm, rs, osig, ominexp, ovmax)
            n_exact += n
            n_exact_o += no
            worst = max(worst, e)
            worst_o = max(worst_o, eo)
            esum += et
            esum_o += eto
            sqsum += sq
            sqsum_o += sqo
            if e > 2.0 and nf == 0:  # past the tolerance: on the grid all the same if another candidate is within
                e_min = _min_worst(s, qi, sa, da, has_a, m_a == m, x, agg, wmin, wmax, lo_t, hi_t, recip, inv, nf,
                                   rm, rs, cand, sig, minexp, vmax)
            else:
                e_min = e
            if e_min > 2.0:
                if n_off == 0:
                    stats[6] = r
                    stats[7] = g
                    stats[8] = e
                    stats[9] = eo
                    stats[17] = nf > 0
                n_off += 1
            scales[r, g] = c
            ua = int(use_a)
            for j in range(4):
                word = np.uint32(0)
                for t in range(8):
                    word |= nib[ua, j * 8 + t] << np.uint32(4 * t)
                packed[r, g * 4 + j] = word
    stats[0] = rows * ng
    stats[1] = n_exact
    stats[2] = n_exact_o
    stats[3] = worst
    stats[4] = worst_o
    stats[5] = n_off
    stats[10] = n_nonfinite
    stats[11] = esum
    stats[12] = esum_o
    stats[13] = sqsum
    stats[14] = sqsum_o
    stats[15] = x2
    stats[16] = n_negzero
