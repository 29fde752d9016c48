"""`python -m repack.kernel_cache` (./setup.sh runs it): the grid kernel is compiled into numba's cache."""

from __future__ import annotations

import pytest

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

    import os

    code = ("import sys, numpy as np; from repack import grid; assert grid.implementation() == 'numba'; "
            "w = (np.arange(64, dtype=np.uint16) + 0x3F00).reshape(2, 32); "
            "a = grid.quantize(w); b = grid.quantize_numpy(w); "
            "assert all(np.array_equal(x, y) for x, y in zip(a[:2], b[:2])); "
            "print('numba' in sys.modules, 'scipy.linalg' in sys.modules)")
    env = dict(os.environ, REPACK_NO_AOT="1")  # the JIT kernel
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "True False"


def test_scipy_linalg_imports_normally_once_the_kernel_is_loaded():
    import subprocess
    import sys

    code = "from repack import grid; grid.implementation(); import scipy.linalg; print(scipy.linalg.norm([3, 4]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "5.0"


# The ahead-of-time module (numba.pycc): what builds load where it is current


def _adversarial_words():
    import numpy as np

    from repack.synthetic import grid_words

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


@pytest.fixture(scope="module")
def aot_dir(tmp_path_factory):
    """An ahead-of-time module built for this machine into a folder of its own (a few seconds)."""
    import shutil

    pytest.importorskip("numba")
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler: the ahead-of-time module cannot be built here (builds use the JIT kernel)")
    d = tmp_path_factory.mktemp("aot")
    mp = pytest.MonkeyPatch()
    mp.setenv("NUMBA_CACHE_DIR", str(d))
    mp.delenv("REPACK_NO_AOT", raising=False)
    try:
        path = kernel_cache.build_aot()
    except RuntimeError as e:
        mp.undo()
        pytest.fail(f"the ahead-of-time module did not build on this machine: {e}")
    yield d, path
    mp.undo()


def test_aot_module_takes_the_same_decisions_as_the_jit_kernel_and_the_reference(aot_dir, monkeypatch):
    import numpy as np

    from repack import _kernel_numba, grid

    d, path = aot_dir
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(d))
    aot = kernel_cache.load_aot()
    assert aot is not None and path.name.startswith("_kernel_aot-")
    w = _adversarial_words()
    ro = np.frombuffer(w.tobytes(), np.uint16).reshape(w.shape)  # read-only, as a build's memory map
    for target in ("float16", "bfloat16"):
        for objective in ("min-error", "runtime-exact"):
            a = grid.run_kernel(aot, ro, target, objective)
            j = grid.run_kernel(_kernel_numba.quantize_rows, w, target, objective)
            r = grid.quantize_numpy(w, target, objective)
            for x, y in zip(a, j):  # the same machine code
                assert np.array_equal(x, y, equal_nan=True)
            assert np.array_equal(a[0], r[0]) and np.array_equal(a[1], r[1])
            # the error totals are sums in another order than numpy's (report figures)
            assert np.allclose(a[2], r[2], rtol=1e-12, atol=0), (target, objective)


def test_aot_module_releases_the_gil_so_row_blocks_run_on_every_core(aot_dir):
    # pycc's own wrapper holds the GIL through the call; built with release_gil it imports the calls that
    # release and take it back
    _, path = aot_dir
    data = path.read_bytes()
    assert b"PyEval_SaveThread" in data and b"PyEval_RestoreThread" in data


def test_a_build_process_with_a_current_aot_module_never_imports_numba(aot_dir):
    import os
    import subprocess
    import sys

    d, _ = aot_dir
    code = ("import sys, numpy as np; from repack import grid; assert grid.implementation() == 'numba'; "
            "w = (np.arange(64, dtype=np.uint16) + 0x3F00).reshape(2, 32); "
            "a = grid.quantize(w); b = grid.quantize_numpy(w); "
            "assert all(np.array_equal(x, y) for x, y in zip(a, b)); print('numba' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "REPACK_NO_AOT"}
    env["NUMBA_CACHE_DIR"] = str(d)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == "False"


def test_a_stale_or_broken_aot_module_is_not_used(aot_dir, monkeypatch, tmp_path):
    d, path = aot_dir
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(d))
    key = kernel_cache.aot_key()
    # the kernel's source changed: another key, no module for it
    edited = tmp_path / "_kernel_numba.py"
    edited.write_bytes(kernel_cache._KERNEL_SOURCE.read_bytes() + b"\n# edited\n")
    monkeypatch.setattr(kernel_cache, "_KERNEL_SOURCE", edited)
    assert kernel_cache.aot_key() != key
    assert kernel_cache.load_aot() is None
    # another CPU: another key
    monkeypatch.undo()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(d))
    monkeypatch.setattr(kernel_cache, "_cpu_features", lambda: "sse2")
    assert kernel_cache.aot_key() != key and kernel_cache.load_aot() is None
    # a damaged module under the current key (truncated: mapping it would crash the process), or one without its
    # digest: not loaded, the JIT kernel is used
    monkeypatch.undo()
    bad = tmp_path / "bad"
    bad.mkdir()
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(bad))
    kernel_cache.aot_path(key).write_bytes(path.read_bytes()[:4096])
    kernel_cache._digest_path(kernel_cache.aot_path(key)).write_bytes(
        kernel_cache._digest_path(path).read_bytes())
    assert kernel_cache.load_aot() is None
    kernel_cache.aot_path(key).write_bytes(path.read_bytes())
    kernel_cache._digest_path(kernel_cache.aot_path(key)).unlink()
    assert kernel_cache.load_aot() is None
    # REPACK_NO_AOT ignores a current one
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(d))
    assert kernel_cache.load_aot() is not None
    monkeypatch.setenv("REPACK_NO_AOT", "1")
    assert kernel_cache.load_aot() is None


def test_the_kernel_refuses_words_it_would_misread():
    # the ahead-of-time kernel checks no argument types: grid does, for either kernel
    import numpy as np

    from repack import grid

    for bad in (np.zeros((2, 32), np.int32), np.zeros(64, np.uint16), np.zeros((2, 48), np.uint16)):
        with pytest.raises(ValueError, match="uint16"):
            grid.quantize(bad)
