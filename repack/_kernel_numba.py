"""The numba kernel behind `repack.grid.quantize`: the algorithm of `quantize_numpy`, one pass per group.

Kept in its own module so that importing the library never triggers compilation; numba caches the compiled
code next to this file (or in NUMBA_CACHE_DIR).
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np


@nb.njit(cache=True, inline="always")
def _round_fmt(s, sig, minexp, vmax):
    # nearest representable value of a format with `sig` significand bits, and its two neighbours
    if s <= 0.0:
        return 0.0, 0.0, 0.0
    if s > vmax:
        s = vmax
    e = math.frexp(s)[1]
    qu = math.ldexp(1.0, max(e - sig, minexp))
    c0 = np.rint(s / qu) * qu
    f0, e0 = math.frexp(c0)
    qu0 = math.ldexp(1.0, max(e0 - sig, minexp))
    qd = qu0
    if f0 == 0.5 and e0 - 1 - sig >= minexp:
        qd = qu0 / 2
    return c0, max(c0 - qd, 0.0), min(c0 + qu0, vmax)


@nb.njit(cache=True, inline="always")
def _count(c, q, lo, hi, ev):
    n = 0
    for i in range(32):
        r = c * q[i]
        if (r > lo[i] and r < hi[i]) or (ev[i] and (r == lo[i] or r == hi[i])):
            n += 1
    return n


@nb.njit(cache=True, inline="always")
def _best(s, lb, ub, sig, minexp, vmax, q, lo, hi, ev):
    # the rounded least-squares step and its neighbours; then, unless one reproduces every value, the
    # representable values nearest the interval [lb, ub] of scales that would reproduce every value
    c0, cd, cu = _round_fmt(s, sig, minexp, vmax)
    best = c0
    bn = _count(c0, q, lo, hi, ev)
    n = _count(cd, q, lo, hi, ev)
    if n > bn:
        best, bn = cd, n
    n = _count(cu, q, lo, hi, ev)
    if n > bn:
        best, bn = cu, n
    if bn < 32 and lb <= ub:
        k0, kd, ku = _round_fmt(min(max(s, lb), ub), sig, minexp, vmax)
        n = _count(k0, q, lo, hi, ev)
        if n > bn:
            best, bn = k0, n
        n = _count(kd, q, lo, hi, ev)
        if n > bn:
            best, bn = kd, n
        n = _count(ku, q, lo, hi, ev)
        if n > bn:
            best, bn = ku, n
    return best, bn


@nb.njit(cache=True, inline="always")
def _err(c, q, x, inv):
    w = 0.0
    for i in range(32):
        d = abs(c * q[i] - x[i])
        if d != 0.0:
            e = d * inv[i]
            if e > w:
                w = e
    return w


@nb.njit(nogil=True, cache=True)
def quantize_rows(words, packed, scales, stats, ratio_table, lowbit, value_t, lo_t, hi_t, even_t, inv_t,
                  sig, minexp, vmax, osig, ominexp, ovmax):
    rows, cols = words.shape
    ng = cols // 32
    x = np.empty(32)
    q = np.empty(32)
    lo = np.empty(32)
    hi = np.empty(32)
    inv = np.empty(32)
    ev = np.empty(32, dtype=np.bool_)
    n_ident = 0
    n_ident_o = 0
    worst = 0.0
    worst_o = 0.0
    n_off = 0
    n_nonfinite = 0
    for r in range(rows):
        for g in range(ng):
            base = g * 32
            pmax = -np.inf
            pmin = np.inf
            for i in range(32):
                w = words[r, base + i]
                if (w & 0x7F80) == 0x7F80:
                    n_nonfinite += 1
                v = value_t[w]
                x[i] = v
                lo[i] = lo_t[w]
                hi[i] = hi_t[w]
                ev[i] = even_t[w]
                inv[i] = inv_t[w]
                pmax = max(pmax, v)
                pmin = min(pmin, v)
            amax = max(pmax, -pmin)
            neg_only = -pmin > pmax
            safe = amax if amax > 0 else 1.0
            k = 1024.0 / safe
            mask = 0xFF
            for i in range(32):
                b = int(np.rint(x[i] * k)) + 1024
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
            f = m / safe
            sqx = 0.0
            sqq = 0.0
            lb = 0.0
            ub = np.inf
            for i in range(32):
                l = np.rint(x[i] * f)
                if l < -8.0:
                    l = -8.0
                elif l > 7.0:
                    l = 7.0
                q[i] = l
                sqx += l * x[i]
                sqq += l * l
                if l > 0.0:
                    lb = max(lb, lo[i] / l)
                    ub = min(ub, hi[i] / l)
                elif l < 0.0:
                    lb = max(lb, hi[i] / l)
                    ub = min(ub, lo[i] / l)
            s = sqx / sqq if sqq > 0 else 0.0
            c, n = _best(s, lb, ub, sig, minexp, vmax, q, lo, hi, ev)
            co, no = _best(s, lb, ub, osig, ominexp, ovmax, q, lo, hi, ev)
            e = _err(c, q, x, inv)
            eo = _err(co, q, x, inv)
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
                    word |= np.uint32(int(q[j * 8 + t]) + 8) << np.uint32(4 * t)
                packed[r, g * 4 + j] = word
    stats[0] = rows * ng
    stats[1] = n_ident
    stats[2] = n_ident_o
    stats[3] = worst
    stats[4] = worst_o
    stats[5] = n_off
    stats[10] = n_nonfinite
