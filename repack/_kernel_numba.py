"""The numba kernel behind `repack.grid.quantize`: the algorithm of `quantize_numpy`, one pass per group.

Kept in its own module so that importing the library never triggers compilation; numba caches the compiled
code next to this file (or in NUMBA_CACHE_DIR).
"""

from __future__ import annotations

import numba as nb
import numpy as np

# A product scale * level has at most 15 significant bits and a rounding midpoint at most 9, so moving an
# excluded end by this relative amount is the same as excluding it.
EXCL = 2.0 ** -30
# Adding and subtracting 1.5 * 2^52 rounds a float64 of magnitude below 2^51 to the nearest integer, ties to
# even (the default rounding mode), exactly like rint but without a library call in the inner loops.
RND = 6755399441055744.0


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
def _count3(c0, c1, c2, q, lo, hi):
    # three candidates in one pass over the group (one load of each bound, three independent sums)
    n0 = 0
    n1 = 0
    n2 = 0
    for i in range(32):
        a = lo[i]
        b = hi[i]
        r0 = c0 * q[i]
        r1 = c1 * q[i]
        r2 = c2 * q[i]
        n0 += (r0 >= a) & (r0 <= b)
        n1 += (r1 >= a) & (r1 <= b)
        n2 += (r2 >= a) & (r2 <= b)
    return n0, n1, n2


@nb.njit(cache=True, inline="always")
def _pick(best, bn, c0, c1, c2, n0, n1, n2):
    # candidates in order; only a strict improvement replaces the best
    if n0 > bn:
        best, bn = c0, n0
    if n1 > bn:
        best, bn = c1, n1
    if n2 > bn:
        best, bn = c2, n2
    return best, bn


@nb.njit(cache=True, inline="always")
def _best(s, lb, ub, sig, minexp, vmax, q, lo, hi, nvals, fb, bb):
    # the rounded least-squares step and its neighbours; then, unless one reproduces every value, the
    # representable values nearest the interval [lb, ub] of scales that would reproduce every value.
    # A candidate only replaces the best on a strict improvement, so skipping when one reproduces all
    # values changes nothing.
    c0, cd, cu = _round_fmt(s, sig, minexp, vmax, fb, bb)
    n0, nd, nu = _count3(c0, cd, cu, q, lo, hi)
    best, bn = _pick(c0, n0, c0, cd, cu, n0, nd, nu)
    if bn < nvals and lb <= ub:
        k0, kd, ku = _round_fmt(min(max(s, lb), ub), sig, minexp, vmax, fb, bb)
        m0, md, mu = _count3(k0, kd, ku, q, lo, hi)
        best, bn = _pick(best, bn, k0, kd, ku, m0, md, mu)
    return best, bn


@nb.njit(cache=True, inline="always")
def _fit(f, x, q, nib, lo, hi, recip):
    # levels for the step 1/f (also as nibbles, level + 8, for packing), their least-squares step, and the
    # interval of steps reproducing every value
    sqx = 0.0
    sqq = 0.0
    lb = 0.0
    ub = np.inf
    for i in range(32):
        l = _rint(x[i] * f)
        if l < -8.0:
            l = -8.0
        elif l > 7.0:
            l = 7.0
        q[i] = l
        li = int(l) + 8
        nib[i] = np.uint32(li)
        sqx += l * x[i]
        sqq += l * l
        # the interval of steps that reproduce this value (none for level 0), without sign branches
        rl = recip[li]
        p1 = lo[i] * rl
        p2 = hi[i] * rl
        lb = max(lb, min(p1, p2))
        ub = min(ub, max(p1, p2) if l != 0.0 else np.inf)
    s = sqx / sqq if sqq > 0 else 0.0
    return s, lb, ub


@nb.njit(cache=True, inline="always")
def _err(c, q, x, inv):
    w = 0.0
    for i in range(32):
        w = max(w, abs(c * q[i] - x[i]) * inv[i])
    return w


# Only the no-NaN / no-signed-zero assumptions, which hold here (every term is a finite value >= 0: inv is 0
# exactly where x is 0 and the level 0), so the max reductions vectorize; no flag that changes rounding (no
# contraction into FMA, no reassociation), so every product and difference is the same as in _err. Not
# inlined at numba level, where the caller's (strict) flags would replace these.
@nb.njit(cache=True, fastmath={"nnan", "nsz"})
def _err2(c, co, q, x, inv):
    w = 0.0
    wo = 0.0
    for i in range(32):
        w = max(w, abs(c * q[i] - x[i]) * inv[i])
        wo = max(wo, abs(co * q[i] - x[i]) * inv[i])
    return w, wo


@nb.njit(nogil=True, cache=True)
def quantize_rows(words, packed, scales, stats, ratio_table, lowbit, half_ulp, inv_ulp, recip,
                  sig, minexp, vmax, osig, ominexp, ovmax):
    rows, cols = words.shape
    ng = cols // 32
    fb = np.empty(1)
    bb = fb.view(np.uint64)
    bits = np.empty(32, dtype=np.uint32)
    f32 = bits.view(np.float32)
    x = np.empty(32)
    q = np.empty(32)
    lo = np.empty(32)
    hi = np.empty(32)
    ibits = np.empty(32, dtype=np.uint64)
    inv = ibits.view(np.float64)
    hbits = np.empty(32, dtype=np.uint64)
    h64 = hbits.view(np.float64)
    sbits = np.empty(1, dtype=np.uint32)
    sf32 = sbits.view(np.float32)
    nib = np.empty(32, dtype=np.uint32)
    n_ident = 0
    n_ident_o = 0
    worst = 0.0
    worst_o = 0.0
    n_off = 0
    n_nonfinite = 0
    for r in range(rows):
        for g in range(ng):
            base = g * 32
            # Integer pass (vectorizes): the value bits (0 for NaN/inf), half an ulp and 1/ulp as float64 bits
            # from the exponent field (exponent 0 is spaced like exponent 1), and the largest magnitude on
            # each side of zero (a zero of either sign counts as positive, as max/min of the values would).
            mp = -1
            mn = -1
            nf = 0
            for i in range(32):
                w = np.int64(words[r, base + i])
                e = (w >> 7) & 0xFF
                fin = e != 0xFF
                ee = max(e, 1)
                bits[i] = np.uint32(w if fin else 0) << np.uint32(16)
                hbits[i] = np.uint64(ee + (1023 - 135)) << np.uint64(52)
                ibits[i] = np.uint64((1023 + 134) - ee) << np.uint64(52)
                mag = (w & 0x7FFF) if fin else 0
                neg = ((w >> 15) != 0) & (mag != 0)
                mp = max(mp, -1 if neg else mag)
                mn = max(mn, mag if neg else -1)
                nf += not fin
            # Branch-free on purpose: sign, parity and power-of-two flags of random data would mispredict on
            # every value.
            for i in range(32):
                w = np.int64(words[r, base + i])
                e = (w >> 7) & 0xFF
                v = np.float64(f32[i])
                h = h64[i]
                pow2 = np.float64(((w & 0x7F) == 0) & (e > 1))
                below = h - 0.5 * h * pow2  # a power of two has finer spacing below it
                neg = np.float64(w >> 15)
                a = v - (below + (h - below) * neg)  # toward zero the spacing is `below`, away from it `h`
                b = v + (h + (below - h) * neg)
                odd = np.float64(w & 1) * EXCL  # odd mantissa: ties round away, so the ends are excluded
                lo[i] = a + abs(a) * odd
                hi[i] = b - abs(b) * odd
                x[i] = v
            if nf:  # NaN/inf: stored as level 0, counted, never identical
                n_nonfinite += nf
                for i in range(32):
                    if (words[r, base + i] & 0x7F80) == 0x7F80:
                        lo[i] = np.inf
                        hi[i] = -np.inf
                        inv[i] = 0.0
            sbits[0] = np.uint32(max(mp, mn)) << np.uint32(16)
            amax = np.float64(sf32[0])
            neg_only = mn > mp
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
            s, lb, ub = _fit(m / safe, x, q, nib, lo, hi, recip)
            c, n = _best(s, lb, ub, sig, minexp, vmax, q, lo, hi, 32, fb, bb)
            co, no = _best(s, lb, ub, osig, ominexp, ovmax, q, lo, hi, 32, fb, bb)
            e, eo = _err2(c, co, q, x, inv)
            if e > 2.0:
                # The ratio lookup is a fast first guess; on a miss every peak level is tried and the one whose
                # least-squares fit is closest wins (ties: the smaller level, i.e. the coarser grid).
                best_m = m
                best_e = np.inf
                for mm in range(1, 9 if neg_only else 8):
                    sm, _, _ = _fit(mm / safe, x, q, nib, lo, hi, recip)
                    em = _err(sm, q, x, inv)
                    if em < best_e:
                        best_e, best_m = em, mm
                s, lb, ub = _fit(best_m / safe, x, q, nib, lo, hi, recip)
                c, n = _best(s, lb, ub, sig, minexp, vmax, q, lo, hi, 32, fb, bb)
                co, no = _best(s, lb, ub, osig, ominexp, ovmax, q, lo, hi, 32, fb, bb)
                e, eo = _err2(c, co, q, x, inv)
            n_ident += n
            n_ident_o += no
            worst = max(worst, e)
            worst_o = max(worst_o, eo)
            if e > 2.0:
                if n_off == 0:
                    stats[6] = r
                    stats[7] = g
                    stats[8] = e
                    stats[9] = eo
                n_off += 1
            scales[r, g] = c
            for j in range(4):
                word = np.uint32(0)
                for t in range(8):
                    word |= nib[j * 8 + t] << np.uint32(4 * t)
                packed[r, g * 4 + j] = word
    stats[0] = rows * ng
    stats[1] = n_ident
    stats[2] = n_ident_o
    stats[3] = worst
    stats[4] = worst_o
    stats[5] = n_off
    stats[10] = n_nonfinite
