"""The numba kernel behind `repack.grid.quantize`: the algorithm of `quantize_numpy`, one pass per group.

Kept in its own module so that importing the library never triggers compilation; numba caches the compiled
code next to this file (or in NUMBA_CACHE_DIR).

It takes every decision the reference takes, on the same numbers; what makes it fast:
- The loops over a group's 32 values run on vector registers: values, 1/ulp and extremes come from the words'
  bits (no table lookups; integer maxima where LLVM would not vectorize a float one), and the runtime values
  T(c * |q|) are float32 lanes: the product has at most 14 significant bits, so it is exact in float32, and
  T is the hardware's float16 conversion (F16C) or round-to-nearest-even on the bfloat16 bits. The candidates'
  sums and counts are single <32 x float> expressions (_group_pass).
- (T(c*q) - x)^2 = (T(c*|q|) - |x|)^2 (a level has its value's sign or is 0). Every difference is an integer
  multiple of 2^k (2^k: the smallest quantum among the source values and c); when T(8c) and the largest
  magnitude are below 2^(23+k), each difference is exact in float32 and every partial sum of the squares is
  exact in float64, so a vector sum in any order equals the reference's left-to-right sum. Otherwise (values
  spread over more than ~15 binades, overflow) the left-to-right sum itself is taken.
  Near the best scale the differences are small enough that the squares and their sum are exact in float32
  (checked on the sum itself), which halves the vectors again; the sums and counts compute the runtime
  values on the way (no array in between), one function per format.
- A reduction over 32 values runs to the array's length, not the constant 32: LLVM fully unrolls a short
  constant loop into a scalar chain before it would vectorize it.
- Values are counted exact (T(c*q) == x) only where the objective needs the count: every candidate for
  runtime-exact; for min-error a tie of squared errors and the chosen scale.
- Whether any scale reproduces every value is first decided from the spread of the values' ratios to their
  levels (one float32 pass for both dtypes, with a margin rounding cannot cross), then, when a search needs
  the interval, from each value's own spacing in T (a float32 pass for T); only an undecided group pays for
  the exact float64 interval.
- The interval of scales reproducing every value is the reference's max/min over the values' bounds; two
  different values at one level have disjoint intervals, so that case needs no test of its own.
- The article author's m is the first m in 1..8 passing its test, and a passing m is always in the group's
  ratio mask (its tolerance, 2^-7 plus half a ratio bin, is inside the table's 0.0085, and fractions with
  denominators up to 8 are 1/56 apart): only the mask's m are tried.
- A candidate equal to one already evaluated (same value, same levels) cannot be strictly better.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

# Adding and subtracting 1.5 * 2^52 rounds a float64 of magnitude below 2^51 to the nearest integer, ties to
# even (the default rounding mode), exactly like rint but without a library call in the inner loops.
# Functions that run once per group are inlined (numba's inline="always") unless they carry fastmath flags of
# their own: a call passes every array as seven arguments, which costs more than the small loops themselves.
RND = 6755399441055744.0
AUTHOR_TOL = 2.0 ** -7
NO_QUANTUM = 10000  # exponent standing for "no nonzero source value"
BF16_MAX = 3.3895313892515355e38
EXCL = 2.0 ** -30  # grid.EXCL: the relative nudge that excludes an interval's end
FP16_SIG = 11  # float16's significand bits: the runtime is float16, else bfloat16


def _bitcast(name, src, dst, ir_dst):
    """An intrinsic reading a `src` value's bits as a `dst` (no memory round trip)."""
    def cast(typingctx, v):
        if v != src:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir_dst)
        return dst(src), codegen
    cast.__name__ = cast.__qualname__ = name
    return intrinsic(cast)


_f2u = _bitcast("_f2u", types.float64, types.int64, ir.IntType(64))
_u2f = _bitcast("_u2f", types.int64, types.float64, ir.DoubleType())
_f32bits = _bitcast("_f32bits", types.float32, types.int32, ir.IntType(32))
_bitsf32 = _bitcast("_bitsf32", types.int32, types.float32, ir.FloatType())


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
# reference's left-to-right result) or where the figure is a report total compared with a tolerance. Their trip
# count is the array's length, not the constant 32: LLVM fully unrolls a short constant loop into a scalar chain
# before it would vectorize it.


@intrinsic
def _bf16_value(typingctx, w):
    """The float64 value of a bf16 word held in an int64's low 16 bits (the word shifted into a float32)."""
    if w != types.int64:
        return None

    def codegen(context, builder, sig, args):
        hi = builder.shl(builder.trunc(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.fpext(builder.bitcast(hi, ir.FloatType()), ir.DoubleType())
    return types.float64(types.int64), codegen


@intrinsic
def _binade(typingctx, v):
    """2^floor(log2 v) of a normal float32 v > 0: its exponent bits alone (on 32-bit lanes; numba's own integer
    arithmetic would widen them to 64)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        e = builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7F800000))
        return builder.bitcast(e, ir.FloatType())
    return types.float32(types.float32), codegen


@intrinsic
def _fp16_round(typingctx, v):
    """A float32 rounded to float16 (RNE; past its range: inf) and back: the hardware conversion (F16C)."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.float32), codegen


@intrinsic
def _bf16_round(typingctx, v):
    """A float32 >= 0 rounded to bfloat16 (RNE on the bits; past its range: inf), as a float32."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        b = builder.bitcast(args[0], i32)
        odd = builder.and_(builder.lshr(b, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        r = builder.add(builder.add(b, ir.Constant(i32, 0x7FFF)), odd)
        return builder.bitcast(builder.and_(r, ir.Constant(i32, 0xFFFF0000)), ir.FloatType())
    return types.float32(types.float32), codegen


# Helpers of the vector expressions (llvmlite intrinsics over a group's 32 values) below.


def _c_array(a, ndim, dtype):
    """Typing check: a C-contiguous array of this rank and dtype (its data is read as one vector)."""
    return isinstance(a, types.Array) and a.ndim == ndim and a.dtype == dtype and a.layout == "C"


def _llvm_fn(builder, name, rty, arg_tys):
    """An LLVM intrinsic, declared once in the module being built."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(rty, arg_tys), name)


def _vec_ptr(context, builder, ty, value, offset=None):
    """A <32 x element> pointer to array `value` (numba type `ty`) at flat element `offset` (an i64; None: 0),
    and the element's alignment."""
    data = context.make_array(ty)(context, builder, value).data
    if offset is not None:
        data = builder.gep(data, [offset])
    return builder.bitcast(data, ir.VectorType(data.type.pointee, 32).as_pointer()), ty.dtype.bitwidth // 8


def _vec_load(context, builder, ty, value, offset=None):
    ptr, align = _vec_ptr(context, builder, ty, value, offset)
    return builder.load(ptr, align=align)


def _vec_store(context, builder, vec, ty, value):
    ptr, align = _vec_ptr(context, builder, ty, value)
    builder.store(vec, ptr, align=align)


@intrinsic
def _scan(typingctx, words, off, x, ax, af, inv):
    """Decodes one group, the 32 bf16 words at flat index `off` of words (C-contiguous uint16): writes x (the
    values, float64; NaN/inf computed as 0, never exact), ax = |x|, af = |x| as float32 (exact: bf16 values)
    and inv (1/ulp of each value, zero and subnormals spaced like exponent 1; NaN/inf: 0). Returns (NaN/inf
    count, -0 count, sum x^2 in any order, the largest magnitude word among the values >= 0 and among the values
    < 0 (-1: none), the smallest quantum exponent of a nonzero value (NO_QUANTUM: none)). Everything comes from
    the words' bits, as one vector expression (the magnitude words of finite bf16 values order as their values
    do); as a loop LLVM also tested the five arrays for overlap at every call."""
    if not (_c_array(words, 2, types.uint16) and isinstance(off, types.Integer) and _c_array(x, 1, types.float64)
            and _c_array(ax, 1, types.float64) and _c_array(af, 1, types.float32)
            and _c_array(inv, 1, types.float64)):
        return None
    rtype = types.Tuple((types.int64, types.int64, types.float64, types.int64, types.int64, types.int64))

    def codegen(context, builder, sig, args):
        i32, i64 = ir.IntType(32), ir.IntType(64)
        f32, f64 = ir.FloatType(), ir.DoubleType()
        vi32, vi64, vf32, vf64 = (ir.VectorType(t, 32) for t in (i32, i64, f32, f64))

        def k(ty, v):
            return ir.Constant(ty, [v] * 32)

        def store(vec, i):
            _vec_store(context, builder, vec, sig.args[i], args[i])

        def intrin(name, rty, arg_tys):
            return _llvm_fn(builder, name, rty, arg_tys)

        o = context.cast(builder, args[1], sig.args[1], types.int64)
        w = builder.zext(_vec_load(context, builder, sig.args[0], args[0], o), vi32)
        e = builder.and_(builder.lshr(w, k(vi32, 7)), k(vi32, 0xFF))
        fin = builder.icmp_unsigned("!=", e, k(vi32, 0xFF))
        v32 = builder.bitcast(builder.shl(builder.select(fin, w, k(vi32, 0)), k(vi32, 16)), vf32)
        v = builder.fpext(v32, vf64)
        store(v, 2)
        store(builder.call(intrin("llvm.fabs.v32f64", vf64, [vf64]), [v]), 3)
        store(builder.call(intrin("llvm.fabs.v32f32", vf32, [vf32]), [v32]), 4)
        ie = builder.select(builder.icmp_unsigned(">", e, k(vi32, 1)), e, k(vi32, 1))
        invb = builder.shl(builder.sub(k(vi64, 1157), builder.zext(ie, vi64)), k(vi64, 52))
        store(builder.select(fin, builder.bitcast(invb, vf64), k(vf64, 0.0)), 5)
        mag = builder.and_(w, k(vi32, 0x7FFF))
        ctpop = intrin("llvm.ctpop.i32", i32, [i32])
        nf = builder.call(ctpop, [builder.bitcast(builder.not_(fin), i32)])
        nz = builder.call(ctpop, [builder.bitcast(builder.icmp_unsigned("==", w, k(vi32, 0x8000)), i32)])
        sxx = builder.call(intrin("llvm.vector.reduce.fadd.v32f64", f64, [f64, vf64]),
                           [ir.Constant(f64, 0.0), builder.fmul(v, v)], fastmath=("reassoc",))
        fm = builder.select(fin, mag, k(vi32, 0))
        neg = builder.and_(builder.icmp_unsigned("!=", builder.lshr(w, k(vi32, 15)), k(vi32, 0)),
                           builder.icmp_unsigned("!=", fm, k(vi32, 0)))
        smax = intrin("llvm.vector.reduce.smax.v32i32", i32, [vi32])
        posmag = builder.call(smax, [builder.select(neg, k(vi32, -1), fm)])
        negmag = builder.call(smax, [builder.select(neg, fm, k(vi32, -1))])
        quantum = builder.and_(fin, builder.icmp_unsigned("!=", mag, k(vi32, 0)))
        kx = builder.call(intrin("llvm.vector.reduce.smin.v32i32", i32, [vi32]),
                          [builder.select(quantum, builder.sub(ie, k(vi32, 134)), k(vi32, NO_QUANTUM))])
        out = [builder.zext(nf, i64), builder.zext(nz, i64), sxx,
               builder.sext(posmag, i64), builder.sext(negmag, i64), builder.sext(kx, i64)]
        return context.make_tuple(builder, sig.return_type, out)
    return rtype(words, off, x, ax, af, inv), codegen


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
    for i in range(len(x)):
        l = min(max(_rint(x[i] * fa), -8.0), 7.0)
        bad += not abs(l * d - x[i]) <= tol
    return bad


@nb.njit(cache=True, _nrt=False)
def _level_misses(q, x, d, tol):
    # _author_misses with the levels of row 0 (the same rounding of x * m / amax)
    bad = 0
    for i in range(len(x)):
        bad += not abs(q[0, i] * d - x[i]) <= tol
    return bad


@nb.njit(cache=True, inline="always", _nrt=False)
def _quantize_levels(f, x, q, aq, nib, j):
    # levels for the step 1/f (as floats, their magnitudes as floats, as nibbles level + 8 for packing) into
    # row j; returns sum q^2
    sqq = 0
    for i in range(32):
        l = min(max(_rint(x[i] * f), -8.0), 7.0)
        q[j, i] = l
        aq[j, i] = np.float32(abs(l))
        li = int(l)
        nib[j, i] = np.uint32(li + 8)
        sqq += li * li
    return sqq


@nb.njit(cache=True, fastmath={"reassoc"}, _nrt=False)
def _dot_any_order(q, j, x):
    acc = 0.0
    for i in range(len(x)):
        acc += q[j, i] * x[i]
    return acc


@nb.njit(cache=True, _nrt=False)
def _dot_in_order(q, j, x):
    acc = 0.0
    for i in range(32):
        acc += q[j, i] * x[i]
    return acc


@nb.njit(cache=True, inline="always", _nrt=False)
def _levels(f, x, q, aq, nib, regular, j):
    # levels for the step 1/f and their least-squares step. `regular`: every partial sum of level * x is exact
    # (any order gives the reference's sum).
    sqq = _quantize_levels(f, x, q, aq, nib, j)
    sqx = _dot_any_order(q, j, x) if regular else _dot_in_order(q, j, x)
    return sqx / sqq if sqq > 0 else 0.0


@nb.njit(cache=True, inline="always", _nrt=False)
def _value_bounds(v, sig, minexp, vmax):
    # grid._interval_tables for one magnitude v > 0, computed rather than looked up (the tables are 512 KiB
    # each, and a lookup per value missed the cache): the reals p with T(p) == v as [lo, hi], ends excluded by
    # a relative nudge where v's significand in T is odd (ties go to even); (inf, -inf) where v is not a value
    # of T. Every step is the table's own expression on the same numbers.
    e = _ilogb(v)
    big = max(e, minexp + sig - 1)  # the binade (below the normal range: the lowest normal one)
    k = max(big - sig + 1, minexp)
    u = _exp2(k)  # the spacing above v
    pow2 = (_f2u(v) & 0xFFFFFFFFFFFFF) == 0
    ub = u * 0.5 if pow2 and big - sig >= minexp else u  # below a power of two the spacing is finer
    n = v * _exp2(-k)  # v / u exactly, below 2^12
    rep = n == _rint(n) and v <= vmax
    lo = v - ub * 0.5
    hi = v + u * 0.5
    if (np.int64(n) & 1) == 1:
        lo = lo + abs(lo) * EXCL
        hi = hi - abs(hi) * EXCL
    return (lo, hi) if rep else (np.inf, -np.inf)


@nb.njit(cache=True, inline="always", _nrt=False)
def _bounds(aq, ax, sig, minexp, vmax):
    # (levels of row 0: the interval candidates go with the ratio levels)
    # The interval of scales reproducing every value exactly, as the reference takes it: the largest lo/l and
    # the smallest hi/l over the values (level 0 constrains nothing; a negative value's bounds are the negated
    # bounds of its magnitude and 1/-l = -(1/l) exactly, so each value's magnitude and |l| give its terms).
    # Two different values at one level have disjoint intervals, so then lb > ub. Maxima as integer maxima of
    # the bits (lb >= 0, ub > 0 or -inf, the same order for values >= 0), so the loop runs on vector registers.
    lbb = 0
    ubb = _f2u(np.inf)
    for i in range(len(ax)):
        a = aq[0, i]
        if a > 0.0:
            lo, hi = _value_bounds(ax[i], sig, minexp, vmax)
            rl = 1.0 / np.float64(a)  # the reference's RECIP: lo * (1/l), not lo / l
            lbb = max(lbb, _f2u(lo * rl))
            ubb = min(ubb, _f2u(hi * rl))
    return _u2f(lbb), _u2f(ubb)


@nb.njit(cache=True, _nrt=False)
def _ratio_spread(aq, af):
    # the largest and the smallest v / l over the values with a level (l > 0), and the smallest such v, on
    # float32 lanes; maxima as integer maxima of the bits (values >= 0), so the loop runs on vector registers
    inf_bits = np.int32(0x7F800000)
    hi = np.int32(0)
    lo = inf_bits
    vmin = inf_bits
    for i in range(len(af)):
        a = aq[0, i]
        on = a > 0  # level 0 constrains nothing
        r = af[i] / (a if on else np.float32(1.0))
        hi = max(hi, _f32bits(r) if on else np.int32(0))
        lo = min(lo, _f32bits(r) if on else inf_bits)
        vmin = min(vmin, _f32bits(af[i]) if on else inf_bits)
    return np.float64(_bitsf32(hi)), np.float64(_bitsf32(lo)), np.float64(_bitsf32(vmin))


@nb.njit(cache=True, inline="always", _nrt=False)
def _normal_in_t(vmin, sig, minexp):
    # every value with a level is in T's normal range and far from float32's subnormals (the float32 checks'
    # bounds hold only there)
    return vmin >= max(_exp2(minexp + sig - 1), 2.0 ** -96)


@nb.njit(cache=True, inline="always", _nrt=False)
def _surely_unbounded(rmax, rmin, vmin, sig, minexp):
    # True only where _bounds is certain to give lb > ub (no scale reproduces every value), decided from the
    # spread of v / l alone (most groups of real data have no such scale: 80-100% on the benchmark's
    # distributions). In T's normal range a value's interval is inside v (1 -+ 2^-sig) / l, and each computed
    # ratio is within 2^-23 of the real one: if the largest lower end exceeds the smallest upper end by more
    # than 2^-18, the reference's lb > ub (its own rounding is within 2^-51). Otherwise _bounds decides.
    if not _normal_in_t(vmin, sig, minexp):
        return False
    q = _exp2(-sig)
    return rmax * (1.0 - q) > rmin * (1.0 + q) * (1.0 + 2.0 ** -18)


@nb.njit(cache=True, _nrt=False)
def _interval_ends(aq, af, h_scale):
    # For T: the largest (v - h) / l and the smallest (v + h) / l over the values v with a level l > 0, where
    # h = 2^floor(log2 v) * h_scale, h_scale = 2^-sig (values too small for h to be normal fail the guard of
    # _surely_unbounded). In T's normal range an interval's ends are within h of v (half a spacing; below a
    # power of two a quarter, and an odd significand's ends are nudged inwards). v -+ h has at most 12
    # significant bits (exact), times 1/l: within 2^-23 of the real quotient. Maxima as integer maxima of the
    # bits (values >= 0), so the loop runs on vector registers.
    inf_bits = np.int32(0x7F800000)
    lo = np.int32(0)
    hi = inf_bits
    for i in range(len(af)):
        a = aq[0, i]
        on = a > 0  # level 0 constrains nothing
        v = af[i]
        rl = np.float32(1.0) / (a if on else np.float32(1.0))
        h = _binade(v) * h_scale
        lo = max(lo, _f32bits((v - h) * rl) if on else np.int32(0))
        hi = min(hi, _f32bits((v + h) * rl) if on else inf_bits)
    return np.float64(_bitsf32(lo)), np.float64(_bitsf32(hi))


@nb.njit(cache=True, inline="always", _nrt=False)
def _surely_unbounded_per_value(aq, af, vmin, sig, minexp):
    # _surely_unbounded's decision from each value's own spacing rather than the widest one (it decides most of
    # what the spread leaves open for bfloat16, whose spacing is 8 times float16's): each figure is within 2^-23
    # of an end that contains the real interval, and the reference's rounding is within 2^-51, so an excess of
    # more than 2^-20 cannot be crossed
    if not _normal_in_t(vmin, sig, minexp):
        return False
    lo, hi = _interval_ends(aq, af, np.float32(_exp2(-sig)))
    return lo > hi * (1.0 + 2.0 ** -20)


@nb.njit(cache=True, inline="always", _nrt=False)
def _round_t(p, sig):
    # T(p) for a float32 p >= 0 (exact products: see _runtime), as a float32; past T's range: inf
    return _fp16_round(p) if sig == FP16_SIG else _bf16_round(p)


@nb.njit(cache=True, inline="always", _nrt=False)
def _runtime(c, aq, j, rt, sig):
    # rt[i] = T(c * |level i|) of row j: the runtime value's magnitude (T(-p) = -T(p), and a level has the sign
    # of its value or is 0). The product has at most 14 significant bits, so it is exact in float32, and T is
    # float16 or bfloat16: float32 lanes, 16 to a vector register, as the reference computes it.
    c32 = np.float32(c)
    if sig == FP16_SIG:
        for i in range(len(rt)):  # not range(32): see the note on reductions
            rt[i] = _fp16_round(c32 * aq[j, i])
    else:
        for i in range(len(rt)):
            rt[i] = _bf16_round(c32 * aq[j, i])


@nb.njit(cache=True, fastmath={"reassoc"}, _nrt=False)
def _sq_any_order(rt, af):
    # only where every |T(c*q) - x| is a multiple of 2^k below 2^(23+k): exact in float32, its square in float64
    acc = 0.0
    for i in range(len(af)):
        d = np.float64(rt[i] - af[i])
        acc += d * d
    return acc


# The same sum on float32 lanes, the runtime values computed on the way (no array in between): exact where the
# result is below 2^(24+2k), see _sq. Written as one <32 x float> vector expression (see _group_pass).


def _splat(builder, v, ty):
    """A <32 x ...> vector of the scalar v (codegen helper of the vector expressions below)."""
    i32 = ir.IntType(32)
    u = builder.insert_element(ir.Constant(ty, ir.Undefined), v, ir.Constant(i32, 0))
    return builder.shuffle_vector(u, ir.Constant(ty, ir.Undefined), ir.Constant(ir.VectorType(i32, 32), [0] * 32))


def _runtime_vector(builder, p, fp16):
    """T(p) of a <32 x float> p >= 0: float16 (the F16C conversion and back) or bfloat16 (round-to-nearest-even
    on the bits), as float32 lanes (past T's range: inf), as _fp16_round / _bf16_round compute it."""
    v32 = p.type
    if fp16:
        return builder.fpext(builder.fptrunc(p, ir.VectorType(ir.HalfType(), 32)), v32)
    iv32 = ir.VectorType(ir.IntType(32), 32)
    bits = builder.bitcast(p, iv32)
    odd = builder.and_(builder.lshr(bits, ir.Constant(iv32, [16] * 32)), ir.Constant(iv32, [1] * 32))
    r = builder.add(builder.add(bits, ir.Constant(iv32, [0x7FFF] * 32)), odd)
    return builder.bitcast(builder.and_(r, ir.Constant(iv32, [0xFFFF0000] * 32)), v32)


def _candidate_typing(c, aq, j):
    return c == types.float32 and isinstance(j, types.Integer) and _c_array(aq, 2, types.float32)


def _candidate_runtime(context, builder, sig, args, fp16):
    """T(c32 * aq[j, :]) as <32 x float> from the first three arguments (c32, aq, j) of a pass."""
    row = builder.mul(context.cast(builder, args[2], sig.args[2], types.int64), ir.Constant(ir.IntType(64), 32))
    q = _vec_load(context, builder, sig.args[1], args[1], row)
    return _runtime_vector(builder, builder.fmul(q, _splat(builder, args[0], q.type)), fp16)


def _group_pass(name, fp16, count):
    """An intrinsic f(c32, aq, j, af) over a group's 32 values as one <32 x float> vector: T(c32 * aq[j, :]),
    T float16 (`fp16`) or bfloat16 (round-to-nearest-even on the bits), compared with af; returns the number of
    equal values (`count`) or the float32 sum of the squared differences, in any order (reassoc; used only
    where every partial sum is exact). aq is the C-contiguous (2, 32) float32 level array, af the 32 float32
    magnitudes. As a loop LLVM takes 8 lanes at a time and a serial chain of additions; one expression is two
    16-lane registers and a tree."""
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    v32 = ir.VectorType(f32, 32)

    def pass_(typingctx, c, aq, j, af):
        if not (_candidate_typing(c, aq, j) and _c_array(af, 1, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            t = _candidate_runtime(context, builder, sig, args, fp16)
            x = _vec_load(context, builder, sig.args[3], args[3])
            if count:
                eq = builder.bitcast(builder.fcmp_ordered("==", t, x), i32)
                return builder.zext(builder.call(_llvm_fn(builder, "llvm.ctpop.i32", i32, [i32]), [eq]), i64)
            d = builder.fsub(t, x)
            red = _llvm_fn(builder, "llvm.vector.reduce.fadd.v32f32", f32, [f32, v32])
            return builder.call(red, [ir.Constant(f32, 0.0), builder.fmul(d, d)], fastmath=("reassoc",))
        return (types.int64 if count else types.float32)(c, aq, j, af), codegen
    pass_.__name__ = pass_.__qualname__ = name
    return intrinsic(pass_)


def _error_pass(name, fp16):
    """An intrinsic f(c32, aq, j, ax, inv) -> (values with T(c32 * aq[j, :]) == ax, the worst error in ulps
    |T(.) - ax| * inv as the integer maximum of its bits (>= 0), their sum in any order (a report total)), on
    float64 lanes: one vector expression, no array of runtime values in between."""
    f64, i32, i64 = ir.DoubleType(), ir.IntType(32), ir.IntType(64)
    vd32, il32 = ir.VectorType(f64, 32), ir.VectorType(i64, 32)

    def pass_(typingctx, c, aq, j, ax, inv):
        if not (_candidate_typing(c, aq, j) and _c_array(ax, 1, types.float64) and _c_array(inv, 1, types.float64)):
            return None
        rtype = types.Tuple((types.int64, types.float64, types.float64))

        def codegen(context, builder, sig, args):
            r = builder.fpext(_candidate_runtime(context, builder, sig, args, fp16), vd32)
            x = _vec_load(context, builder, sig.args[3], args[3])
            w = _vec_load(context, builder, sig.args[4], args[4])
            eq = builder.bitcast(builder.fcmp_ordered("==", r, x), i32)
            ne = builder.zext(builder.call(_llvm_fn(builder, "llvm.ctpop.i32", i32, [i32]), [eq]), i64)
            fabs = _llvm_fn(builder, "llvm.fabs.v32f64", vd32, [vd32])
            e = builder.fmul(builder.call(fabs, [builder.fsub(r, x)]), w)
            smax = _llvm_fn(builder, "llvm.vector.reduce.smax.v32i64", i64, [il32])
            mb = builder.call(smax, [builder.bitcast(e, il32)])
            mb = builder.select(builder.icmp_signed(">", mb, ir.Constant(i64, 0)), mb, ir.Constant(i64, 0))
            red = _llvm_fn(builder, "llvm.vector.reduce.fadd.v32f64", f64, [f64, vd32])
            tot = builder.call(red, [ir.Constant(f64, 0.0), e], fastmath=("reassoc",))
            return context.make_tuple(builder, rtype, [ne, builder.bitcast(mb, f64), tot])
        return rtype(c, aq, j, ax, inv), codegen
    pass_.__name__ = pass_.__qualname__ = name
    return intrinsic(pass_)


_errors_fp16 = _error_pass("_errors_fp16", True)
_errors_bf16 = _error_pass("_errors_bf16", False)
_sq32_fp16 = _group_pass("_sq32_fp16", True, False)
_sq32_bf16 = _group_pass("_sq32_bf16", False, False)
_n_equal_fp16 = _group_pass("_n_equal_fp16", True, True)
_n_equal_bf16 = _group_pass("_n_equal_bf16", False, True)


@nb.njit(cache=True, _nrt=False)
def _sq_in_order(rt, ax):
    acc = 0.0
    for i in range(32):
        d = np.float64(rt[i]) - ax[i]
        acc += d * d
    return acc


@nb.njit(cache=True, inline="always", _nrt=False)
def _sq(c, aq, j, ax, af, rt, amax, kx, sig, minexp, vmax):
    # squared runtime error of scale c with the levels of row j: (T(c*q) - x)^2 = (T(c*|q|) - |x|)^2 exactly. A
    # vector sum where every partial sum is exact in any order (then equal to the reference's left-to-right
    # sum), else the left-to-right sum itself
    if c > 0.0:
        k = min(kx, max(_ilogb(c) - sig + 1, minexp))
        if max(np.float64(_round_t(np.float32(8.0 * c), sig)), amax) < _exp2(23 + k):
            # Each difference d is a multiple of 2^k, exact in float32. Near the best scale d is small: with
            # |d| < 2^(12+k), d^2 and every partial sum below 2^(24+2k) are exact in float32 (2k >= -148: no
            # subnormals; k <= 51: no overflow), and a float32 sum below 2^(24+2k) means no term or partial sum
            # reached it (squares and sums of terms >= 0 round monotonically); else the float64 sum.
            if -74 <= k <= 51:
                c32 = np.float32(c)
                a32 = _sq32_fp16(c32, aq, j, af) if sig == FP16_SIG else _sq32_bf16(c32, aq, j, af)
                if a32 < _exp2(24 + 2 * k):
                    return np.float64(a32)
            _runtime(c, aq, j, rt, sig)
            return _sq_any_order(rt, af)
    _runtime(c, aq, j, rt, sig)
    return _sq_in_order(rt, ax)


@nb.njit(cache=True, inline="always", _nrt=False)
def _count(c, aq, j, af, nf, sig):
    # values with T(c*q) == x (NaN/inf sources are 0 at level 0: counted there, so taken off)
    c32 = np.float32(c)
    return (_n_equal_fp16(c32, aq, j, af) if sig == FP16_SIG else _n_equal_bf16(c32, aq, j, af)) - nf


@nb.njit(cache=True, inline="always", _nrt=False)
def _search(s, aq, sa, da, has_a, same_a, ax, af, amax, kx, nf,
            rt, cand, auth, sig, minexp, vmax, min_error, no_interval, vmin):
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
                sq = _sq(c, aq, int(a), ax, af, rt, amax, kx, sig, minexp, vmax)
                if j == 0 or sq < bsq:
                    best, ba, bn, bsq = c, a, -1, sq
                elif sq == bsq:
                    n = _count(c, aq, int(a), af, nf, sig)
                    if bn < 0:
                        bn = _count(best, aq, int(ba), af, nf, sig)
                    if n > bn:
                        best, ba, bn, bsq = c, a, n, sq
                if bsq == 0.0:  # every value exact: sq == 0 for no other count
                    return best, ba, 32 - nf, bsq
            else:
                n = _count(c, aq, int(a), af, nf, sig)
                if n == 32:
                    return c, a, n, 0.0
                if n >= bn:
                    sq = _sq(c, aq, int(a), ax, af, rt, amax, kx, sig, minexp, vmax)
                    if j == 0 or n > bn or sq < bsq:
                        best, ba, bn, bsq = c, a, n, sq
            j += 1
        # the next candidates, computed only when needed
        if stage == 0:
            stage = 1
            lb, ubnd = 1.0, 0.0
            if not (no_interval or _surely_unbounded_per_value(aq, af, vmin, sig, minexp)):
                lb, ubnd = _bounds(aq, ax, sig, minexp, vmax)
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
def _errors(c, aq, j, ax, inv, rt, nf, n, sig):
    # exact values (when n < 0), worst and summed runtime error in bf16 ulps of the source (a group holding
    # NaN/inf: worst is inf)
    if n == 32:  # every value exact (and finite)
        return n, 0.0, 0.0
    c32 = np.float32(c)
    ne, m, t = _errors_fp16(c32, aq, j, ax, inv) if sig == FP16_SIG else _errors_bf16(c32, aq, j, ax, inv)
    if nf:
        m = np.inf
    return (ne - nf if n < 0 else n), m, t


@nb.njit(cache=True, _nrt=False)
def _min_worst(s, aq, sa, da, has_a, same_a, ax, inv, nf, rt, cand,
               sig, minexp, vmax):
    # grid._min_worst: the smallest worst runtime error over every candidate of _search (the rare off-grid path)
    cand[0], cand[1], cand[2] = _round_fmt(s, sig, minexp, vmax)
    nc = 3
    lb, ubnd = _bounds(aq, ax, sig, minexp, vmax)
    if lb <= ubnd:
        cand[3], cand[4], cand[5] = _round_fmt(min(max(s, lb), ubnd), sig, minexp, vmax)
        nc = 6
    best = np.inf
    for j in range(nc):
        best = min(best, _errors(cand[j], aq, 0, ax, inv, rt, nf, -1, sig)[1])
    if has_a:
        a = 0 if same_a else 1  # the same m gives the same levels (row 0)
        for c in (_round1(da, sig, minexp, vmax), _round1(sa, sig, minexp, vmax),
                  _round1(_round1(sa, 8, -133, BF16_MAX), sig, minexp, vmax)):
            best = min(best, _errors(c, aq, a, ax, inv, rt, nf, -1, sig)[1])
    return best


@nb.njit(cache=True, inline="always", _nrt=False)
def _err(c, q, x, inv):
    w = 0.0
    for i in range(32):
        w = max(w, abs(c * q[0, i] - x[i]) * inv[i])
    return w


@nb.njit(nogil=True, cache=True)
def quantize_rows(words, packed, scales, stats, ratio_table, lowbit, sig, minexp, vmax, osig, ominexp, ovmax,
                  min_error):
    # scratch space, allocated once per block; the work itself runs without reference counting (arrays are
    # only indexed there), which would otherwise cost atomic operations in the innermost loops
    # rows 0 / 1 of the 2-row arrays: the levels of the ratio lookup's m / of the article author's m
    _rows(words, packed, scales, stats, ratio_table, lowbit, sig, minexp, vmax, osig, ominexp, ovmax, min_error,
          np.empty(32, dtype=np.float32), np.empty(9), np.empty(9, dtype=np.bool_), np.empty(32), np.empty(32),
          np.empty(32, dtype=np.float32), np.empty((2, 32)), np.empty((2, 32), dtype=np.float32), np.empty(32),
          np.empty((2, 32), dtype=np.uint32))


@nb.njit(nogil=True, cache=True, _nrt=False)
def _rows(words, packed, scales, stats, ratio_table, lowbit, sig, minexp, vmax, osig, ominexp, ovmax, min_error,
          rt, cand, auth, x, ax, af, q, aq, inv, nib):
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
            nf, nz, sxx, posmag, negmag, kx = _scan(words, r * cols + base, x, ax, af, inv)
            x2 += sxx
            n_negzero += nz
            n_nonfinite += nf
            amax = _bf16_value(max(posmag, negmag))
            neg_only = negmag > posmag
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
            s = _levels(m / safe, x, q, aq, nib, regular, 0)
            m_a = 0
            tol = safe * AUTHOR_TOL
            for mm in range(1, 9):
                if not (mask >> (mm - 1)) & 1:
                    continue
                # the ratio lookup's m (the mask's lowest bit, tried first) has its levels in row 0 already
                if mm == m:
                    misses = _level_misses(q, x, safe / mm, tol)
                else:
                    misses = _author_misses(x, mm / safe, safe / mm, tol)
                if misses == 0:
                    m_a = mm
                    break
            has_a = m_a > 0
            sa = 0.0
            da = 0.0
            if has_a:
                # the same m gives the same levels and step (then only q is used)
                if m_a != m:
                    sa = _levels(m_a / safe, x, q, aq, nib, regular, 1)
                else:
                    sa = s
                da = safe / m_a
            rmax, rmin, vmin = _ratio_spread(aq, af)
            no_iv = _surely_unbounded(rmax, rmin, vmin, sig, minexp)
            no_iv_o = _surely_unbounded(rmax, rmin, vmin, osig, ominexp)
            c, use_a, n, sq = _search(s, aq, sa, da, has_a, m_a == m, ax, af,
                                      amax, kx, nf, rt, cand, auth, sig, minexp, vmax, min_error, no_iv, vmin)
            n, e, et = _errors(c, aq, int(use_a), ax, inv, rt, nf, n, sig)
            if e > 2.0:
                # The ratio lookup is a fast first guess; on a miss every peak level is tried and the one whose
                # least-squares fit is closest wins (ties: the smaller level, i.e. the coarser grid).
                best_m = m
                best_e = np.inf
                for mm in range(1, 9 if neg_only else 8):
                    sm = _levels(mm / safe, x, q, aq, nib, regular, 0)
                    em = _err(sm, q, x, inv)
                    if em < best_e:
                        best_e, best_m = em, mm
                m = best_m
                s = _levels(m / safe, x, q, aq, nib, regular, 0)
                if has_a:
                    if m_a != m:
                        sa = _levels(m_a / safe, x, q, aq, nib, regular, 1)
                    else:
                        sa = s
                rmax, rmin, vmin = _ratio_spread(aq, af)
                no_iv = _surely_unbounded(rmax, rmin, vmin, sig, minexp)
                no_iv_o = _surely_unbounded(rmax, rmin, vmin, osig, ominexp)
                c, use_a, n, sq = _search(s, aq, sa, da, has_a, m_a == m, ax, af,
                                          amax, kx, nf, rt, cand, auth, sig, minexp, vmax,
                                          min_error, no_iv, vmin)
                n, e, et = _errors(c, aq, int(use_a), ax, inv, rt, nf, n, sig)
            co, use_ao, no, sqo = _search(s, aq, sa, da, has_a, m_a == m, ax, af,
                                          amax, kx, nf, rt, cand, auth, osig, ominexp, ovmax, min_error,
                                          no_iv_o, vmin)
            no, eo, eto = _errors(co, aq, int(use_ao), ax, inv, rt, nf, no, osig)
            n_exact += n
            n_exact_o += no
            worst = max(worst, e)
            worst_o = max(worst_o, eo)
            esum += et
            esum_o += eto
            sqsum += sq
            sqsum_o += sqo
            if e > 2.0 and nf == 0:  # past the tolerance: on the grid all the same if another candidate is within
                e_min = _min_worst(s, aq, sa, da, has_a, m_a == m, ax, inv, nf,
                                   rt, cand, sig, minexp, vmax)
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
