"""Grid recovery: levels, scales, bit-identity, off-grid detection; the numba kernel against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from repack.grid import grid
from repack.stand_ins.synthetic import grid_words

from tests.helpers.fixtures import IN_PROCESS_TORCH


def _values(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("impl", ["numpy", "fast"])
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_recovers_the_grid_with_peaks_below_level_8(impl, target):
    rng = np.random.default_rng(1)
    words = grid_words(64, 256, rng)  # peaks at levels 4..8: amax/8 or amax/7 would be wrong for most groups
    f = grid.quantize_numpy if impl == "numpy" else grid.quantize
    packed, scales, stats = f(words, target, "runtime-exact")  # the exactness figures below are its criterion
    s = grid.GridStats.from_vector(stats)
    assert s.groups == 64 * 8 and s.offgrid == 0
    decoded = grid.decode(packed, scales)
    src = _values(words)
    # the exact count is the runtime's: T(level * scale) equal in value to the source
    runtime = grid.runtime_values(decoded, target)
    assert s.exact == int((runtime == src).sum()) and s.exact > 0.6 * s.values
    assert s.worst_ulps <= 1.0
    # levels as stored: nibble = level + 8, low nibble first
    u = packed.view(np.uint32)
    lv = np.stack([(u >> (4 * j)) & 0xF for j in range(8)], -1).reshape(64, 256).astype(int) - 8
    assert lv.min() >= -8 and lv.max() <= 7
    peaks = np.abs(lv.reshape(64, 8, 32)).max(-1)
    assert set(np.unique(peaks)) >= {4, 5, 6, 7, 8}


def _special_groups(words: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    words = words.copy()
    words[0, :32] = 0  # an all-zero group
    words[1, 32:64] = words[1, 32:64] ^ 0x8000  # a sign-flipped group
    words[2, 5] = 0x7FC0  # NaN
    words[3, 40] = 0xFF80  # -inf
    words[4, :32] = (rng.standard_normal(32).astype(np.float32).view(np.uint32) >> 16)  # no grid
    words[5, :32] = rng.integers(0, 0x10000, 32)  # any words at all
    for row, step in ((6, 1e-6), (7, 3e4), (8, 1e-30)):  # below fp16's normal range, near its top, far below
        v = np.float32(step) * rng.integers(-8, 8, 32).astype(np.float32)
        words[row, :32] = (v.view(np.uint32) >> 16).astype(np.uint16)
    words[9, :32:3] = 0x8000  # minus zeros
    return words


def _kernel_equals_reference(words: np.ndarray, target: str, objective: str):
    """The numba kernel's (packed, scales, stats) for words, asserted equal to the numpy reference's."""
    a = grid.quantize_numpy(words, target, objective)
    b = grid.quantize(words, target, objective)
    assert np.array_equal(a[0], b[0]), (target, objective)
    assert np.array_equal(a[1], b[1]), (target, objective)
    assert np.allclose(a[2], b[2], rtol=1e-12, atol=0), (target, objective)
    return b


def test_fast_kernel_matches_numpy_reference():
    rng = np.random.default_rng(2)
    for step_dtype, jitter in ((np.float16, 0.0), (np.float32, 0.0), (np.float32, 0.3)):
        words = _special_groups(grid_words(96, 512, rng, step_dtype=step_dtype, jitter=jitter), rng)
        for target in ("float16", "bfloat16"):
            for objective in ("runtime-exact", "min-error"):
                _kernel_equals_reference(words, target, objective)


def test_scales_chosen_for_one_runtime_reproduce_fewer_values_in_the_other():
    rng = np.random.default_rng(3)
    words = grid_words(128, 512, rng, step_dtype=np.float32)  # steps representable in neither format
    src = _values(words)
    p16, c16, st16 = grid.quantize(words, "float16", "runtime-exact")
    pbf, cbf, stbf = grid.quantize(words, "bfloat16", "runtime-exact")
    s16, sbf = grid.GridStats.from_vector(st16), grid.GridStats.from_vector(stbf)
    # each figure for the other dtype is what the build for that dtype gives
    assert s16.exact_other == sbf.exact and sbf.exact_other == s16.exact
    assert s16.worst_ulps <= 2 and sbf.worst_ulps <= 2
    # the bf16 build's scales (as fp16 values, exact) computed in fp16 arithmetic: fewer exact values
    cross = grid.runtime_values(grid.decode(pbf, cbf), "float16")
    assert int((cross == src).sum()) < s16.exact


def test_off_grid_group_is_reported_with_row_and_group():
    rng = np.random.default_rng(4)
    words = grid_words(8, 128, rng)
    words[5, 2 * 32 + 7] += 40  # 40 ulps off
    s = grid.GridStats.from_vector(grid.quantize(words)[2])
    assert s.offgrid == 1
    row, group, err, _ = s.first_offgrid
    assert (row, group) == (5, 2) and err > 2


def test_base_model_values_are_off_grid():
    rng = np.random.default_rng(5)
    words = ((rng.standard_normal((16, 256), dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    s = grid.GridStats.from_vector(grid.quantize(words)[2])
    assert s.offgrid == s.groups


@IN_PROCESS_TORCH
def test_packing_matches_compressed_tensors_pack_to_int32():
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    rng = np.random.default_rng(6)
    words = grid_words(16, 128, rng)
    packed, scales, _ = grid.quantize(words)
    u = packed.view(np.uint32)
    lv = (np.stack([(u >> (4 * j)) & 0xF for j in range(8)], -1).reshape(16, 128).astype(np.int8) - 8)
    theirs = pack_to_int32(torch.from_numpy(lv), 4).numpy()
    assert theirs.dtype == np.int32 and np.array_equal(theirs, packed)


def _adversarial(rng: np.random.Generator) -> np.ndarray:
    """Groups aimed at the kernel's shortcuts: the vector sum of squared errors and its exactness bound, float32
    runtime rounding (overflow, subnormals), the interval over the values' bounds, the author's m read from the
    ratio mask, extremes from the words' bits (zeros of both signs, negative peaks)."""
    rows = []
    for levels in ("uniform", "peaked"):
        for step_dtype in (np.float16, np.float32):
            for jitter in (0.0, 0.26):
                rows.append(grid_words(8, 256, rng, step_dtype=step_dtype, jitter=jitter, levels=levels))
    w = np.concatenate(rows)
    g = w.reshape(-1, 32)
    n = len(g)
    k = 0

    def put(vals):
        nonlocal k
        g[k % n] = vals
        k += 1

    def words_of(v):
        b = np.asarray(v, dtype=np.float32).view(np.uint32)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)

    lv = rng.integers(-8, 8, 32).astype(np.float32)
    for step in (2.0 ** -140, 2.0 ** -130, 1e-38, 3e-8, 6e-5, 2e3, 8.2e3, 9e3, 4e4, 1e36):  # subnormal..overflow
        put(words_of(lv * np.float32(step)))
    put(words_of(np.where(np.arange(32) == 5, -8.0, 7.0) * np.float32(0.01)))  # peak -8 against 7s
    put(words_of(np.where(np.arange(32) == 5, 7.0, -7.0) * np.float32(0.01)))  # +7 and -7: a tie of peaks
    put(words_of(np.full(32, 0.37, np.float32)))  # every value equal
    put(words_of(np.full(32, -0.37, np.float32)))
    put(np.where(np.arange(32) % 2 == 0, 0x8000, 0x0000).astype(np.uint16))  # only zeros of both signs
    v = lv * np.float32(0.02)
    v[3] = np.float32(1e-30)  # one value 100 binades below the rest: the exactness bound fails
    put(words_of(v))
    v = lv * np.float32(0.02)
    v[7] = 0.0
    v[9] = -0.0
    put(words_of(v))
    put(rng.integers(0, 0x0080, 32).astype(np.uint16) | (rng.integers(0, 2, 32) << 15).astype(np.uint16))  # subnormals
    for m in range(1, 9):  # every peak level, levels all multiples of a divisor of it
        d = next(dd for dd in (4, 2, 1) if m % dd == 0 and m > dd) if m > 1 else 1
        l = rng.integers(-m // d, m // d + 1, 32) * d
        l[0] = -m if m == 8 else m
        put(words_of(l.astype(np.float32) * np.float32(0.013)))
    return w


def test_fast_kernel_matches_numpy_reference_on_adversarial_groups():
    rng = np.random.default_rng(21)
    words = _adversarial(rng)
    for target in ("float16", "bfloat16"):
        for objective in ("runtime-exact", "min-error"):
            s = grid.GridStats.from_vector(_kernel_equals_reference(words, target, objective)[2])
            assert s.offgrid >= 1  # the group with one value 100 binades down is reported off the grid


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
@pytest.mark.parametrize("objective", ["min-error", "runtime-exact"])
def test_groups_side_by_side_give_the_bytes_of_one_group_at_a_time(target, objective):
    """The kernel takes groups side by side and sends the uncommon ones (NaN/inf, an author's grid of its own, a
    target error past the tolerance, min-error ties or sums the per-level form cannot give exactly) through the
    one-group path, the kernel as it was before. Its packed levels and scales must be those of every group
    through the one-group path, byte for byte, and its figures the same: on every distribution, the adversarial
    and special groups, any words at all, fp16 steps (runtime products at rounding ties), and block sizes that
    are no multiple of the chunk."""
    pytest.importorskip("numba")
    from repack.grid import _kernel_numba as k

    rng = np.random.default_rng(47)
    blocks = [_adversarial(rng), _special_groups(grid_words(96, 512, rng, jitter=0.26), rng),
              rng.integers(0, 0x10000, (24, 1024)).astype(np.uint16), grid_words(3, 96, rng)]
    for levels in ("uniform", "peaked"):
        for step_dtype in (np.float16, np.float32):
            for jitter in (0.0, 0.26):
                blocks.append(grid_words(16, 1536, rng, step_dtype=step_dtype, jitter=jitter, levels=levels))
    for i, w in enumerate(blocks):
        every = 1 + 2 * (i % 2)  # every group's other-dtype figures, or a sample of them
        a = grid.run_kernel(k.quantize_rows_per_group, w, target, objective, every)
        b = grid.run_kernel(k.quantize_rows, w, target, objective, every)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]), w.shape
        assert np.allclose(a[2], b[2], rtol=1e-12, atol=0), w.shape
        assert a[1].tobytes() == b[1].tobytes()  # -0.0 and 0.0 compare equal: the stored bytes too


@pytest.mark.parametrize("impl", ["numpy", "fast"])
@pytest.mark.parametrize("every", [0, 2, 8])
def test_the_other_dtype_figures_are_those_of_its_sample(impl, every):
    """The report's other-dtype figures come from every `every`-th run of 64 groups: on exactly those groups, what
    the other dtype's own build gives (its scales decoded and computed in its runtime); the packed levels, the
    scales and the target's figures are those of a build computing every group's."""
    rng = np.random.default_rng(48)
    words = grid_words(40, 3072, rng, step_dtype=np.float32, jitter=0.26)  # 3,840 groups: 60 runs of 64
    f = grid.quantize_numpy if impl == "numpy" else grid.quantize
    full, part = f(words, "float16", "min-error", 1), f(words, "float16", "min-error", every)
    assert np.array_equal(full[0], part[0]) and full[1].tobytes() == part[1].tobytes()
    assert np.array_equal(full[2][grid.TARGET_STATS], part[2][grid.TARGET_STATS])
    pb, cb, _ = grid.quantize_numpy(words, "bfloat16", "min-error")
    r = grid.runtime_values(grid.decode(pb, cb), "bfloat16").reshape(-1, 32)
    x = _values(words).reshape(-1, 32)
    o = grid.in_other_sample(len(x), every)
    assert o.sum() == (0 if not every else 64 * len(range(0, 60, every)))
    s = grid.GridStats.from_vector(part[2])
    assert s.values_other == 32 * int(o.sum()) and s.exact_other == int((r[o] == x[o]).sum())
    assert s.sq_src_other == pytest.approx(float((x[o] ** 2).sum()), rel=1e-12)
    assert s.sq_err_other == pytest.approx(float(((r[o] - x[o]) ** 2).sum()), rel=1e-9)
    ulp = np.ldexp(1.0, np.maximum((words.reshape(-1, 32)[o].astype(np.int64) >> 7) & 0xFF, 1) - 134)
    assert s.worst_ulps_other == pytest.approx(float((np.abs(r[o] - x[o]) / ulp).max(initial=0.0)), abs=1e-12)


def test_synthetic_level_distributions_differ():
    rng = np.random.default_rng(22)
    u = grid_words(64, 256, rng, levels="uniform")
    p = grid_words(64, 256, rng, levels="peaked")
    lv = {}
    for name, w in (("u", u), ("p", p)):
        packed, scales, stats = grid.quantize(w)
        assert grid.GridStats.from_vector(stats).offgrid == 0
        x = packed.view(np.uint32)
        lv[name] = np.stack([(x >> (4 * j)) & 0xF for j in range(8)], -1).astype(int) - 8
    assert np.mean(np.abs(lv["p"]) <= 1) > 2 * np.mean(np.abs(lv["u"]) <= 1)
    with pytest.raises(ValueError, match="levels"):
        grid_words(1, 32, rng, levels="normal")


# Two groups of peaked levels (mostly 0 and +-1, a few +-5) with fp32 steps and values rounded the other way
# (grid_words(levels="peaked", jitter=0.26), about one group in ten million): min-error's float16 scale leaves a
# level-1 value 2.125 ulps off, trading it for the level-5 values' absolute error; the true step in float16
# puts every value within 1 ulp. They are on the grid.
PEAKED_OTHER_WAY = np.array([
    [0xbe10, 0x0, 0xbce5, 0x0, 0x3ce4, 0xbce5, 0x0, 0x0, 0x0, 0x3e10, 0x3ce4, 0x0, 0x3d65, 0x0, 0x0, 0x3ce5,
     0x3de5, 0x0, 0x0, 0xbce5, 0xbce5, 0x3d65, 0xbe10, 0xbce5, 0x3e10, 0xbce5, 0x0, 0xbce4, 0x3d65, 0x0, 0x0, 0x0],
    [0x3ced, 0x0, 0xbdb2, 0xbe15, 0x0, 0x0, 0x3ced, 0xbe15, 0x3e15, 0xbd6d, 0x0, 0x0, 0x3ced, 0xbd6d, 0x0, 0xbcec,
     0x3e15, 0x3cec, 0xbced, 0x0, 0xbcec, 0xbcec, 0x0, 0xbced, 0x3ced, 0x3ced, 0x0, 0x0, 0xbced, 0x3ced, 0x0, 0xbced],
], dtype=np.uint16)


@pytest.mark.parametrize("objective", ["min-error", "runtime-exact"])
@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_a_group_is_on_the_grid_when_any_candidate_is_within_the_tolerance(target, objective):
    ref = grid.quantize_numpy(PEAKED_OTHER_WAY, target, objective)
    fast = grid.quantize(PEAKED_OTHER_WAY, target, objective)
    for a, b in zip(ref, fast):
        np.testing.assert_array_equal(a, b)
    s = grid.GridStats.from_vector(ref[2])
    assert s.offgrid == 0 and s.first_offgrid is None
    if (target, objective) == ("float16", "min-error"):
        assert s.worst_ulps > grid.TOL_ULPS  # the objective's own choice is past the tolerance, and kept
    # a value moved far off is still refused, by both implementations
    bad = PEAKED_OTHER_WAY.copy()
    bad[1, 9] += 40
    for st in (grid.quantize_numpy(bad, target, objective)[2], grid.quantize(bad, target, objective)[2]):
        off = grid.GridStats.from_vector(st)
        assert off.offgrid == 1 and off.first_offgrid[:2] == (1, 0)


@pytest.mark.parametrize("fmt", ["fp16", "bf16"])
def test_kernel_interval_bounds_equal_the_reference_tables_for_every_value(fmt):
    """The kernel computes each value's interval of runtime-reproducing reals instead of reading grid's tables:
    for every positive finite bf16 value, the same two numbers (or the same empty interval)."""
    pytest.importorskip("numba")
    import numba

    from repack.grid import _kernel_numba as k

    assert k.EXCL == grid.EXCL
    sig, minexp, vmax = grid.bits_of(fmt)

    @numba.njit
    def all_bounds(v, lo, hi):
        for i in range(len(v)):
            lo[i], hi[i] = k._value_bounds(v[i], sig, minexp, vmax)

    words = np.arange(1, 0x7F80)  # every positive finite magnitude word
    v = grid.VALUE_TABLE[words]
    lo, hi = np.empty_like(v), np.empty_like(v)
    all_bounds(v, lo, hi)
    lo_t, hi_t = grid.INTERVALS[grid.target_of(fmt)]
    assert np.array_equal(lo, lo_t[words]) and np.array_equal(hi, hi_t[words])


def test_kernel_float32_no_interval_decision_is_never_wrong():
    """The kernel skips the exact interval of scales that reproduce every value when a float32 pass says none
    exists: that pass must never say so where the exact interval (grid's own expressions) is not empty, for any
    levels and values, including ends that touch, subnormals and overflow; and it must decide most groups of
    off-grid-rounded data, or the shortcut saves nothing."""
    pytest.importorskip("numba")
    import math

    import numba

    from repack.grid import _kernel_numba as k

    (s16, e16, v16), (sbf, ebf, vbf) = grid.bits_of("fp16"), grid.bits_of("bf16")

    @numba.njit
    def decide(aq_all, ax_all, out):
        aq = np.empty((2, 32), dtype=np.float32)
        bn = np.empty(32, dtype=np.float32)  # each value's binade, as the kernel's decoding gives it
        for g in range(ax_all.shape[0]):
            ax = ax_all[g]
            af = ax.astype(np.float32)
            for i in range(32):
                bn[i] = 0.0 if ax[i] < 2.0 ** -126 else 2.0 ** (math.frexp(ax[i])[1] - 1)
            aq[0] = aq_all[g]
            rmax, rmin, vmin = k._ratio_spread(aq, af)
            sure16 = k._surely_unbounded(rmax, rmin, vmin, s16, e16)
            surebf = k._surely_unbounded(rmax, rmin, vmin, sbf, ebf)
            lb16, ub16 = k._bounds(aq, ax, s16, e16, v16)
            lbbf, ubbf = k._bounds(aq, ax, sbf, ebf, vbf)
            out[g, 0], out[g, 1] = sure16, not lb16 <= ub16
            out[g, 2], out[g, 3] = surebf, not lbbf <= ubbf
            # the per-value decision, taken where the spread leaves the question open
            out[g, 4] = k._surely_unbounded_per_value(aq, af, bn, vmin, s16, e16)
            out[g, 5] = k._surely_unbounded_per_value(aq, af, bn, vmin, sbf, ebf)

    def bf16(v):
        b = np.asarray(v, dtype=np.float32).view(np.uint32)
        return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).view(np.float32).astype(np.float64)

    rng = np.random.default_rng(5)
    n = 40000
    lv = rng.integers(0, 9, (n, 32))
    lv[rng.random(n) < 0.2] = rng.integers(0, 2, 32)  # few distinct levels: wide intervals
    step = np.exp2(rng.uniform(-140, 120, n))[:, None]
    step[: n // 2] = np.exp2(rng.uniform(-30, 10, n // 2))[:, None]  # weights' own range
    # exactly on a grid, off by a few float16/bfloat16 half-spacings (ends that touch or nearly do), or rounded
    nudge = rng.choice([0.0, 2.0 ** -12, 2.0 ** -11, 2.0 ** -9, 2.0 ** -8, 1e-3], (n, 1))
    rel = 1 + nudge * rng.choice([-1.0, 0.0, 1.0], (n, 32))
    ax = np.abs(bf16(np.minimum(step * lv * rel, 3e38)))
    ax[lv == 0] = np.abs(bf16(step * rng.uniform(0, 0.4, (n, 32))))[lv == 0]
    n_made = len(ax)
    for levels in ("uniform", "peaked"):  # the benchmark's data, levels as the kernel computes them
        for sd, jit in ((np.float16, 0.0), (np.float32, 0.0), (np.float32, 0.26)):
            w = grid_words(64, 512, rng, step_dtype=sd, jitter=jit, levels=levels).reshape(-1, 32)
            v = np.abs(grid.VALUE_TABLE[w])
            amax = np.maximum(v.max(1, keepdims=True), 1e-30)
            lv = np.vstack([lv, np.clip(np.rint(v / amax * 7), 0, 8).astype(lv.dtype)])
            ax = np.vstack([ax, v])
    ax[~np.isfinite(ax)] = 0.0
    out = np.zeros((len(ax), 6), dtype=np.bool_)
    decide(lv.astype(np.float32), np.ascontiguousarray(ax), out)
    for sure, empty in ((out[:, 0], out[:, 1]), (out[:, 2], out[:, 3])):
        assert not (sure & ~empty).any()  # never says "no interval" where there is one
        assert sure[n_made:].sum() >= 0.9 * empty[n_made:].sum(), (sure[n_made:].sum(), empty[n_made:].sum())
    for sure, empty, spread in ((out[:, 4], out[:, 1], out[:, 0]), (out[:, 5], out[:, 3], out[:, 2])):
        assert not (sure & ~empty).any()
        # it decides nearly all the empty cases of grid data, and most of those the spread left open
        assert sure[n_made:].sum() >= 0.98 * empty[n_made:].sum(), (sure[n_made:].sum(), empty[n_made:].sum())
        left = empty[n_made:] & ~spread[n_made:]
        assert (sure[n_made:] & left).sum() >= 0.7 * left.sum(), ((sure[n_made:] & left).sum(), left.sum())
    assert out[:, 1].any() and (~out[:, 1]).any() and (~out[:, 3]).any()  # both cases were tried
