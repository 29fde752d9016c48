"""The numba kernel behind `repack.grid.quantize`: the algorithm of `quantize_numpy`, one pass per group.

Kept in its own module so that importing the library never triggers compilation; numba caches the compiled
code next to this file (or in NUMBA_CACHE_DIR).

Where the time would go, and how it is avoided without changing any decision of the reference:
- A candidate scale c has only 8 runtime magnitudes, R[a] = T(c * a) for a = 1..8 (T(-p) = -T(p)), so the
  runtime rounding is emulated 8 times per candidate, not 32.
- Its squared runtime error is sum x^2 + sum_a R[a] * (A[a] * R[a] - 2 * B[a]), with A[a] the number of values
  at level +-a and B[a] the sum of their magnitudes (both per group, shared by every candidate with the same
  levels): 8 lanes instead of 32 values. Every term is an integer multiple of 2^(2k) (2^k: the smallest quantum
  of the source values and of c), so when every partial sum stays below 2^(53+2k) this sum, in any order, and
  the reference's left-to-right sum of (T(c*q) - x)^2 are both exact, hence equal. That holds when
  max(R[8], amax) < 2^(23+k) (the partial sums are bounded by 128 * max^2); otherwise the group takes the
  per-value left-to-right sum.
- Exactness is tested against per-value intervals (T(p) == x exactly when lo <= p <= hi, tables built by
  `grid`), and only where the objective needs the count: min-error counts only on a tie of squared errors and
  for the chosen scale.
- A candidate equal to one already evaluated (same value, same levels) cannot be strictly better, so it is not
  evaluated again.
"""

from __future__ import annotations

import numba as nb
import numpy as np

# Adding and subtracting 1.5 * 2^52 rounds a float64 of magnitude below 2^51 to the nearest integer, ties to
# even (the default rounding mode), exactly like rint but without a library call in the inner loops.
RND = 6755399441055744.0
AUTHOR_TOL = 2.0 ** -7
NO_QUANTUM = 10000  # exponent standing for "no nonzero source value"


@nb.njit(cache=True, inline="always")
def _rint(v):
    return (v + RND) - RND


@nb.njit(cache=True, inline="always")
def _ilogb(v, fb, ub):
    # floor(log2(v)) of a positive normal float64, from its exponent bits (no libm call)
    fb[0] = v
    return np.int64((ub[0] >> np.uint64(52)) & np.uint64(0x7FF)) - 1023


@nb.njit(cache=True, inline="always")
def _exp2(k, fb, ub):
    ub[0] = np.uint64(k + 1023) << np.uint64(52)
    return fb[0]


@nb.njit(cache=True, inline="always")
def _round_fmt(s, sig, minexp, vmax, fb, ub):
    # nearest representable value of a format with `sig` significand bits, and its two neighbours
    if s <= 0.0:
        return 0.0, 0.0, 0.0
    if s > vmax:
        s = vmax
    kq = max(_ilogb(s, fb, ub) - sig + 1, minexp)
    qu = _exp2(kq, fb, ub)
    # s * 2^-kq is s / qu exactly (a power-of-two scaling, far from overflow and underflow), without a division
    c0 = np.rint(s * _exp2(-kq, fb, ub)) * qu
    e0 = _ilogb(c0, fb, ub)
    qu0 = _exp2(max(e0 - sig + 1, minexp), fb, ub)
    qd = qu0
    if c0 == _exp2(e0, fb, ub) and e0 - sig >= minexp:  # a power of two: finer spacing below
        qd = qu0 * 0.5
    return c0, max(c0 - qd, 0.0), min(c0 + qu0, vmax)


@nb.njit(cache=True, inline="always")
def _round1(s, sig, minexp, vmax, fb, ub):
    c0, _, _ = _round_fmt(s, sig, minexp, vmax, fb, ub)
    return c0


@nb.njit(cache=True, inline="always")
def _levels(f, x, q, nib, agg):
    # levels for the step 1/f (also as nibbles, level + 8, for packing), their least-squares step, and per
    # magnitude a = 1..8 the count (agg[0, a]) and summed magnitude (agg[1, a]) of the values at level +-a
    sqx = 0.0
    sqq = 0.0
    for a in range(9):
        agg[0, a] = 0.0
        agg[1, a] = 0.0
    for i in range(32):
        l = _rint(x[i] * f)
        if l < -8.0:
            l = -8.0
        elif l > 7.0:
            l = 7.0
        q[i] = l
        nib[i] = np.uint32(int(l) + 8)
        sqx += l * x[i]
        sqq += l * l
    for i in range(32):
        a = int(abs(q[i]))
        agg[0, a] += 1.0
        agg[1, a] += abs(x[i])
    return sqx / sqq if sqq > 0 else 0.0


@nb.njit(cache=True, inline="always")
def _bounds(q, lo, hi, recip):
    # the interval of scales reproducing every value exactly (level 0 constrains nothing)
    lb = 0.0
    ub = np.inf
    for i in range(32):
        l = q[i]
        rl = recip[int(l) + 8]
        if l > 0.0:
            lb = max(lb, lo[i] * rl)
            ub = min(ub, hi[i] * rl)
        elif l < 0.0:
            lb = max(lb, hi[i] * rl)
            ub = min(ub, lo[i] * rl)
    return lb, ub


@nb.njit(cache=True, inline="always")
def _count(c, q, lo, hi):
    n = 0
    for i in range(32):
        r = c * q[i]
        n += (r >= lo[i]) & (r <= hi[i])
    return n


@nb.njit(cache=True, inline="always")
def _runtime_mags(c, w):
    # w[0][a] = T(c * a) for a = 0..8, branch-free through bit patterns: the quantum 2^k of each product comes
    # from its exponent field and rint(p * 2^-k) * 2^k is the round-to-nearest-even value (a zero product gets
    # the smallest quantum and stays 0); past the format's largest value: inf
    rm, rmu, s1, s1u, s2, s2u = w[0], w[1], w[2], w[3], w[4], w[5]
    sig, minexp, vmax = int(w[6][0]), int(w[6][1]), w[6][2]
    for a in range(9):
        rm[a] = c * a
    for a in range(9):
        k = max(np.int64((rmu[a] >> np.uint64(52)) & np.uint64(0x7FF)) - 1023 - sig + 1, minexp)
        s1u[a] = np.uint64(1023 - k) << np.uint64(52)
        s2u[a] = np.uint64(1023 + k) << np.uint64(52)
    for a in range(9):
        v = _rint(rm[a] * s1[a]) * s2[a]
        rm[a] = v if v <= vmax else np.inf


@nb.njit(cache=True, inline="always")
def _sq_agg(rm, agg, sxx):
    acc = sxx
    for a in range(1, 9):
        acc += rm[a] * (agg[0, a] * rm[a] - 2.0 * agg[1, a])
    return acc


@nb.njit(cache=True, inline="always")
def _sq_seq(rm, q, x):
    # the reference's order: (T(c*q) - x)^2 summed left to right
    acc = 0.0
    for i in range(32):
        l = q[i]
        r = rm[int(abs(l))]
        d = (r if l >= 0.0 else -r) - x[i]
        acc += d * d
    return acc


@nb.njit(cache=True, inline="always")
def _sq(c, lv, lagg, x, sxx, amax, kx, w, fb, ub):
    # squared runtime error of scale c with levels lv: exact aggregate form when provably equal, else per value
    rm = w[0]
    sig, minexp = int(w[6][0]), int(w[6][1])
    _runtime_mags(c, w)
    if c > 0.0:
        kr = max(_ilogb(c, fb, ub) - sig + 1, minexp)
        k = min(kx, kr)
        mx = max(rm[8], amax)
        if k < 1000 and mx < _exp2(23 + k, fb, ub):
            return _sq_agg(rm, lagg, sxx)
        return _sq_seq(rm, lv, x)
    return sxx  # every runtime value is 0


@nb.njit(cache=True, inline="always")
def _search(s, q, qa, sa, da, has_a, same_a, x, lo, hi, recip, agg, agga, sxx, amax, kx, nvalid, w, cand, auth,
            fb, ub, min_error):
    # the candidates of grid._search, in the same order, skipping those that cannot be valid or cannot be
    # strictly better (a duplicate of one evaluated); stops once nothing can be strictly better (every finite
    # value exact). Returns (scale, uses the author's levels, count, sq).
    sig, minexp, vmax = int(w[6][0]), int(w[6][1]), w[6][2]
    cand[0], cand[1], cand[2] = _round_fmt(s, sig, minexp, vmax, fb, ub)
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
                if cand[t] == c and auth[t] == a:
                    dup = True
            if dup:
                j += 1
                continue
            lv = qa if a else q
            if min_error:
                sq = _sq(c, lv, agga if a else agg, x, sxx, amax, kx, w, fb, ub)
                if j == 0 or sq < bsq:
                    best, ba, bn, bsq = c, a, -1, sq
                elif sq == bsq:
                    n = _count(c, lv, lo, hi)
                    if bn < 0:
                        bn = _count(best, qa if ba else q, lo, hi)
                    if n > bn:
                        best, ba, bn, bsq = c, a, n, sq
                if bsq == 0.0:
                    if bn < 0:
                        bn = nvalid
                    return best, ba, bn, bsq
            else:
                n = _count(c, lv, lo, hi)
                if n == 32:
                    return c, a, n, 0.0
                if n >= bn:
                    sq = _sq(c, lv, agga if a else agg, x, sxx, amax, kx, w, fb, ub)
                    if j == 0 or n > bn or sq < bsq:
                        best, ba, bn, bsq = c, a, n, sq
            j += 1
        # the next candidates, computed only when needed
        if stage == 0:
            stage = 1
            lb, ubnd = _bounds(q, lo, hi, recip)
            if lb <= ubnd:
                cand[3], cand[4], cand[5] = _round_fmt(min(max(s, lb), ubnd), sig, minexp, vmax, fb, ub)
                auth[3] = auth[4] = auth[5] = False
                nc = 6
        elif stage == 1:
            stage = 2
            if has_a:
                cand[nc] = _round1(da, sig, minexp, vmax, fb, ub)
                auth[nc] = not same_a
                nc += 1
                if not same_a:  # with the same levels this is the first candidate again
                    cand[nc] = _round1(sa, sig, minexp, vmax, fb, ub)
                    auth[nc] = True
                    nc += 1
                cand[nc] = _round1(_round1(sa, 8, -133, 3.3895313892515355e38, fb, ub), sig, minexp, vmax, fb, ub)
                auth[nc] = not same_a
                nc += 1
        else:
            if bn < 0:
                bn = _count(best, qa if ba else q, lo, hi)
            return best, ba, bn, bsq


@nb.njit(cache=True, inline="always")
def _errors(c, q, x, inv, nf, n, w):
    # worst and summed runtime error in bf16 ulps of the source (a group holding NaN/inf: worst is inf)
    if n == 32:  # every value exact (and finite)
        return 0.0, 0.0
    rm = w[0]
    _runtime_mags(c, w)
    m = 0.0
    t = 0.0
    for i in range(32):
        l = q[i]
        r = rm[int(abs(l))]
        e = abs((r if l >= 0.0 else -r) - x[i]) * inv[i]
        m = max(m, e)
        t += e
    if nf:
        m = np.inf
    return m, t


@nb.njit(cache=True, inline="always")
def _err(c, q, x, inv):
    w = 0.0
    for i in range(32):
        w = max(w, abs(c * q[i] - x[i]) * inv[i])
    return w


@nb.njit(nogil=True, cache=True)
def quantize_rows(words, packed, scales, stats, ratio_table, lowbit, recip, value_tab, inv_tab,
                  lo_t, hi_t, lo_o, hi_o, sig, minexp, vmax, osig, ominexp, ovmax, min_error):
    rows, cols = words.shape
    ng = cols // 32
    fb = np.empty(1)
    bb = fb.view(np.uint64)
    rm = np.empty(9)
    s1 = np.empty(9)
    s2 = np.empty(9)
    fmt_t = np.array([float(sig), float(minexp), vmax])
    fmt_o = np.array([float(osig), float(ominexp), ovmax])
    wt = (rm, rm.view(np.uint64), s1, s1.view(np.uint64), s2, s2.view(np.uint64), fmt_t)
    wo = (rm, rm.view(np.uint64), s1, s1.view(np.uint64), s2, s2.view(np.uint64), fmt_o)
    cand = np.empty(9)
    auth = np.empty(9, dtype=np.bool_)
    agg = np.empty((2, 9))
    agga = np.empty((2, 9))
    x = np.empty(32)
    q = np.empty(32)
    qa = np.empty(32)
    lo = np.empty(32)
    hi = np.empty(32)
    lo2 = np.empty(32)
    hi2 = np.empty(32)
    inv = np.empty(32)
    nib = np.empty(32, dtype=np.uint32)
    niba = np.empty(32, dtype=np.uint32)
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
            nf = 0
            pmax = -np.inf
            pmin = np.inf
            sxx = 0.0
            kx = NO_QUANTUM
            for i in range(32):
                w = words[r, base + i]
                v = value_tab[w]
                x[i] = v
                inv[i] = inv_tab[w]
                lo[i] = lo_t[w]
                hi[i] = hi_t[w]
                lo2[i] = lo_o[w]
                hi2[i] = hi_o[w]
                nf += (w & 0x7F80) == 0x7F80
                n_negzero += w == 0x8000
                sxx += v * v
                pmax = max(pmax, v)
                pmin = min(pmin, v)
                # quantum exponent of a nonzero bf16 value (subnormals: that of the lowest binade)
                kq = max(np.int64((w >> 7) & 0xFF), 1) - 134
                kx = min(kx, kq if v != 0.0 else NO_QUANTUM)
            x2 += sxx
            n_nonfinite += nf
            amax = max(pmax, -pmin)
            neg_only = -pmin > pmax
            safe = amax if amax > 0 else 1.0
            k = 1024.0 / safe
            mask = 0xFF
            for i in range(32):
                b = int(_rint(x[i] * k)) + 1024
                if b < 0:
                    b = 0
                elif b > 2048:
                    b = 2048
                mask &= ratio_table[b]
            if not neg_only:
                mask &= 0x7F
            m = lowbit[mask]
            if m == 0:
                m = 8 if neg_only else 7
            # the article author's grid: the first m whose step amax/m puts every value within amax * 2^-7
            m_a = 0
            tol = safe * AUTHOR_TOL
            for mm in range(1, 9):
                d = safe / mm
                fa = mm / safe
                ok = True
                for i in range(32):
                    l = _rint(x[i] * fa)
                    if l < -8.0:
                        l = -8.0
                    elif l > 7.0:
                        l = 7.0
                    if not abs(l * d - x[i]) <= tol:
                        ok = False
                        break
                if ok:
                    m_a = mm
                    break
            has_a = m_a > 0
            sa = 0.0
            da = 0.0
            s = _levels(m / safe, x, q, nib, agg)
            if has_a:
                # the same m gives the same levels and step (then only q is used)
                sa = _levels(m_a / safe, x, qa, niba, agga) if m_a != m else s
                da = safe / m_a
            nvalid = 32 - nf
            c, use_a, n, sq = _search(s, q, qa, sa, da, has_a, m_a == m, x, lo, hi, recip, agg, agga, sxx, amax,
                                      kx, nvalid, wt, cand, auth, fb, bb, min_error)
            e, et = _errors(c, qa if use_a else q, x, inv, nf, n, wt)
            if e > 2.0:
                # The ratio lookup is a fast first guess; on a miss every peak level is tried and the one whose
                # least-squares fit is closest wins (ties: the smaller level, i.e. the coarser grid).
                best_m = m
                best_e = np.inf
                for mm in range(1, 9 if neg_only else 8):
                    sm = _levels(mm / safe, x, q, nib, agg)
                    em = _err(sm, q, x, inv)
                    if em < best_e:
                        best_e, best_m = em, mm
                m = best_m
                s = _levels(m / safe, x, q, nib, agg)
                if has_a:
                    sa = _levels(m_a / safe, x, qa, niba, agga) if m_a != m else s
                c, use_a, n, sq = _search(s, q, qa, sa, da, has_a, m_a == m, x, lo, hi, recip, agg, agga, sxx,
                                          amax, kx, nvalid, wt, cand, auth, fb, bb, min_error)
                e, et = _errors(c, qa if use_a else q, x, inv, nf, n, wt)
            co, use_ao, no, sqo = _search(s, q, qa, sa, da, has_a, m_a == m, x, lo2, hi2, recip, agg, agga, sxx,
                                          amax, kx, nvalid, wo, cand, auth, fb, bb, min_error)
            eo, eto = _errors(co, qa if use_ao else q, x, inv, nf, no, wo)
            n_exact += n
            n_exact_o += no
            worst = max(worst, e)
            worst_o = max(worst_o, eo)
            esum += et
            esum_o += eto
            sqsum += sq
            sqsum_o += sqo
            if e > 2.0:
                if n_off == 0:
                    stats[6] = r
                    stats[7] = g
                    stats[8] = e
                    stats[9] = eo
                    stats[17] = nf > 0
                n_off += 1
            scales[r, g] = c
            src = niba if use_a else nib
            for j in range(4):
                word = np.uint32(0)
                for t in range(8):
                    word |= src[j * 8 + t] << np.uint32(4 * t)
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
