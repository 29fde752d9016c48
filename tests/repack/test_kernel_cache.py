"""`python -m repack.kernel_cache` (./setup.sh runs it): the grid kernel is compiled into numba's cache."""

from __future__ import annotations

from repack import kernel_cache


def test_warm_loads_the_numba_kernel_and_says_so(capsys):
    assert kernel_cache.main() == 0
    out = capsys.readouterr().out
    assert out.startswith("repack grid kernel: compiled or loaded from numba's cache in ")


def test_without_numba_it_says_builds_fall_back(monkeypatch, capsys):
    from repack import grid

    monkeypatch.setattr(grid, "_kernel", None)
    monkeypatch.setenv("REPACK_NO_NUMBA", "1")
    assert kernel_cache.main() == 1
    assert "numba is not importable" in capsys.readouterr().out


def test_the_kernel_benchmark_loads_the_project_kernel_as_the_project_does():
    # Loading repack/_kernel_numba.py under another module name wrote numba cache entries for that file that
    # name the other module; the next `python -m repack` then failed with "No module named 'kernel_…'".
    import sys
    from pathlib import Path

    from repack import _kernel_numba

    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    try:
        import bench_repack
    finally:
        sys.path.remove(str(bench))
    assert bench_repack._load_kernel(Path(_kernel_numba.__file__)) is _kernel_numba.quantize_rows
    assert not [m for m in sys.modules if m.startswith("kernel_")]


def test_loading_the_kernel_does_not_import_scipy_linalg():
    # numba's array functions import scipy.linalg (0.1-0.2 s of every build's start) only to know whether
    # np.dot may call BLAS; a fresh process loads and runs the kernel without it, and the kernel still agrees
    # with the numpy reference
    import subprocess
    import sys

    code = ("import sys, numpy as np; from repack import grid; assert grid.implementation() == 'numba'; "
            "w = (np.arange(64, dtype=np.uint16) + 0x3F00).reshape(2, 32); "
            "a = grid.quantize(w); b = grid.quantize_numpy(w); "
            "assert all(np.array_equal(x, y) for x, y in zip(a[:2], b[:2])); "
            "print('scipy.linalg' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_scipy_linalg_imports_normally_once_the_kernel_is_loaded():
    import subprocess
    import sys

    code = "from repack import grid; grid.implementation(); import scipy.linalg; print(scipy.linalg.norm([3, 4]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "5.0"
