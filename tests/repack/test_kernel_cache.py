"""`python -m repack.grid.kernel_cache` (./setup.sh runs it): the grid kernel is compiled into numba's cache, and
what a build process then loads."""

from __future__ import annotations

import pytest

from repack.grid import kernel_cache


def test_warm_loads_the_numba_kernel_and_says_so(capsys):
    assert kernel_cache.main() == 0
    out = capsys.readouterr().out
    assert out.startswith("repack grid kernel: compiled or loaded from numba's cache in ")


def test_without_numba_it_says_builds_fall_back(monkeypatch, capsys):
    from repack.grid import grid

    monkeypatch.setattr(grid, "_kernel", None)
    monkeypatch.setenv("REPACK_NO_NUMBA", "1")
    assert kernel_cache.main() == 1
    assert "numba is not importable" in capsys.readouterr().out


def test_the_kernel_benchmark_loads_the_project_kernel_as_the_project_does():
    # Loading repack/grid/_kernel_numba.py under another module name wrote numba cache entries for that file that
    # name the other module; the next `python -m repack` then failed with "No module named 'kernel_…'".
    import sys
    from pathlib import Path

    from repack.grid import _kernel_numba

    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    try:
        import bench_repack
    finally:
        sys.path.remove(str(bench))
    assert bench_repack._load_kernel(Path(_kernel_numba.__file__)) is _kernel_numba.quantize_rows
    assert not [m for m in sys.modules if m.startswith("kernel_")]


def _fresh_process_quantizes(env: dict, compared: str, report: str) -> str:
    """Runs the kernel in a new process as a build loads it, asserts its outputs (`compared`: the slice of
    (packed, scales, stats)) equal to the numpy reference, and returns what `report` evaluates to there."""
    import subprocess
    import sys

    code = ("import sys, numpy as np; from repack.grid import grid; assert grid.implementation() == 'numba'; "
            "from repack.grid._kernel_numba import quantize_rows as k; "
            "w = (np.arange(64, dtype=np.uint16) + 0x3F00).reshape(2, 32); "
            "a = grid.quantize(w); b = grid.quantize_numpy(w); "
            f"assert all(np.array_equal(x, y) for x, y in zip(a{compared}, b{compared})); print({report})")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def test_a_build_process_loads_the_kernel_from_numbas_cache_without_compiling():
    # compiled once (here, or by setup.sh / the suite's start): a new process only loads the machine code
    import os

    assert kernel_cache.warm() == "numba"
    out = _fresh_process_quantizes(dict(os.environ), "[:2]",
                                   "sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values())")
    hits, misses = map(int, out.split())
    assert hits >= 1 and misses == 0, out


def _adversarial_words():
    import numpy as np

    from repack.stand_ins.synthetic import grid_words

    rng = np.random.default_rng(11)
    blocks = []
    for levels in ("uniform", "peaked"):
        for step_dtype, jitter in ((np.float16, 0.0), (np.float32, 0.26)):
            blocks.append(grid_words(8, 256, rng, step_dtype=step_dtype, jitter=jitter, levels=levels))
    w = np.vstack(blocks)
    w[0] = rng.integers(0, 0x10000, w.shape[1], dtype=np.uint16)  # any word: NaN, inf, subnormals, both signs
    w[1, :64] = rng.integers(0, 0x100, 64, dtype=np.uint16)  # subnormals
    w[2, :32] = 0x8000  # -0
    w[3, 32:64] = 0x7F7F  # the largest finite bf16: past float16's range
    return w


def test_the_kernel_on_a_read_only_block_takes_the_reference_decisions():
    # a build passes read-only views of its memory map (the second specialisation warm() compiles)
    import numpy as np

    from repack.grid import _kernel_numba, grid

    w = _adversarial_words()
    ro = np.frombuffer(w.tobytes(), np.uint16).reshape(w.shape)
    for target in ("float16", "bfloat16"):
        for objective in ("min-error", "runtime-exact"):
            a = grid.run_kernel(_kernel_numba.quantize_rows, ro, target, objective)
            b = grid.run_kernel(_kernel_numba.quantize_rows, w, target, objective)
            r = grid.quantize_numpy(w, target, objective)
            for x, y in zip(a, b):
                assert np.array_equal(x, y, equal_nan=True)
            assert np.array_equal(a[0], r[0]) and np.array_equal(a[1], r[1])
            # the error totals are sums in another order than numpy's (report figures)
            assert np.allclose(a[2], r[2], rtol=1e-12, atol=0), (target, objective)


def test_the_kernel_releases_the_gil_so_row_blocks_run_on_every_core():
    from repack.grid import _kernel_numba

    assert _kernel_numba.quantize_rows.targetoptions.get("nogil") is True


def test_the_kernel_refuses_words_it_would_misread():
    import numpy as np

    from repack.grid import grid

    for bad in (np.zeros((2, 32), np.int32), np.zeros(64, np.uint16), np.zeros((2, 48), np.uint16)):
        with pytest.raises(ValueError, match="uint16"):
            grid.quantize(bad)
