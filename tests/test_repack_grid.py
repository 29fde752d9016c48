"""Grid recovery: levels, scales, bit-identity, off-grid detection; the numba kernel against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from repack import grid
from repack.synthetic import grid_words


def _values(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("impl", ["numpy", "fast"])
def test_recovers_the_grid_with_peaks_below_level_8(impl):
    rng = np.random.default_rng(1)
    words = grid_words(64, 256, rng)  # peaks at levels 4..8: amax/8 or amax/7 would be wrong for most groups
    f = grid.quantize_numpy if impl == "numpy" else grid.quantize
    packed, scales, stats = f(words, "fp16")
    s = grid.GridStats.from_vector(stats)
    assert s.groups == 64 * 8 and s.offgrid == 0
    decoded = grid.decode(packed, scales)
    src = _values(words)
    # Steps are fp16 values here, so fp16 scales reproduce every source value bit for bit.
    assert s.identical == s.values
    bf = (decoded.astype(np.float32).view(np.uint32) + 0x7FFF + ((decoded.astype(np.float32).view(np.uint32) >> 16) & 1)) >> 16
    assert np.array_equal(bf.astype(np.uint16), words)
    assert np.abs(decoded - src).max() <= np.abs(src).max() * 2 ** -8
    # levels as stored: nibble = level + 8, low nibble first
    u = packed.view(np.uint32)
    lv = np.stack([(u >> (4 * j)) & 0xF for j in range(8)], -1).reshape(64, 256).astype(int) - 8
    assert lv.min() >= -8 and lv.max() <= 7
    peaks = np.abs(lv.reshape(64, 8, 32)).max(-1)
    assert set(np.unique(peaks)) >= {4, 5, 6, 7, 8}


def test_fast_kernel_matches_numpy_reference():
    rng = np.random.default_rng(2)
    for step_dtype in (np.float16, np.float32):
        words = grid_words(96, 512, rng, step_dtype=step_dtype)
        words[0, :32] = 0  # an all-zero group
        words[1, 32:64] = words[1, 32:64] ^ 0x8000  # a sign-flipped group
        for sd in ("fp16", "bf16"):
            a = grid.quantize_numpy(words, sd)
            b = grid.quantize(words, sd)
            assert np.array_equal(a[0], b[0])
            assert np.array_equal(a[1], b[1])
            assert np.allclose(a[2], b[2], rtol=0, atol=1e-9)


def test_fp16_scales_reproduce_more_values_than_bf16():
    rng = np.random.default_rng(3)
    words = grid_words(128, 512, rng, step_dtype=np.float32)  # steps not representable in either format
    s16 = grid.GridStats.from_vector(grid.quantize(words, "fp16")[2])
    sbf = grid.GridStats.from_vector(grid.quantize(words, "bf16")[2])
    assert s16.identical > sbf.identical
    assert s16.identical_other == sbf.identical and sbf.identical_other == s16.identical
    assert s16.worst_ulps <= 2 and sbf.worst_ulps <= 2


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
