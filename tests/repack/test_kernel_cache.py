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


def _fresh_process_quantizes(env: dict, compared: str, report: str) -> str:
    """Runs the kernel in a new process as a build loads it, asserts its outputs (`compared`: the slice of
    (packed, scales, stats)) equal to the numpy reference, and returns what `report` evaluates to there."""
    import subprocess
    import sys

    code = ("import sys, numpy as np; from repack import grid; assert grid.implementation() == 'numba'; "
            "w = (np.arange(64, dtype=np.uint16) + 0x3F00).reshape(2, 32); "
            "a = grid.quantize(w); b = grid.quantize_numpy(w); "
            f"assert all(np.array_equal(x, y) for x, y in zip(a{compared}, b{compared})); print({report})")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def test_loading_the_kernel_does_not_import_scipy_linalg():
    # numba's array functions import scipy.linalg (0.1-0.2 s of every build's start) only to know whether
    # np.dot may call BLAS; a fresh process loads and runs the kernel without it, and the kernel still agrees
    # with the numpy reference
    import os

    env = dict(os.environ, REPACK_NO_AOT="1")  # the JIT kernel
    assert _fresh_process_quantizes(env, "[:2]", "'numba' in sys.modules, 'scipy.linalg' in sys.modules") == \
        "True False"


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
def aot_build(tmp_path_factory):
    """An ahead-of-time module built for this machine into a folder of its own (a few seconds), by two builds at
    once, the folder seeded with what builds clean up: returns (folder, path, what the builds and the folder
    showed)."""
    import tempfile
    import threading
    import warnings

    pytest.importorskip("numba")
    probe_tmp = tmp_path_factory.mktemp("aot-probe")  # the probe leaves its files in the temporary folder
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as probe_mp:
        warnings.simplefilter("ignore")  # numba.pycc is pending deprecation
        from numba.pycc.platform import external_compiler_works

        probe_mp.setattr(tempfile, "tempdir", str(probe_tmp))
        works = external_compiler_works()
    if not works:
        pytest.skip("no C and C++ compiler: the ahead-of-time module cannot be built here (builds use the JIT kernel)")
    d = tmp_path_factory.mktemp("aot")
    tmp = tmp_path_factory.mktemp("aot-tmp")
    mp = pytest.MonkeyPatch()
    mp.setenv("NUMBA_CACHE_DIR", str(d))
    mp.delenv("REPACK_NO_AOT", raising=False)
    mp.setattr(tempfile, "tempdir", str(tmp))
    key = kernel_cache.aot_key()
    machine = key.split("-")[0]
    suffix = kernel_cache.aot_path(key).name.split(key)[1]
    older = d / f"_kernel_aot-{machine}-0000000000000000{suffix}"  # this machine, an older kernel source
    other = d / f"_kernel_aot-000000000000-0000000000000000{suffix}"  # another machine or interpreter
    for f in (older, other):
        f.write_bytes(b"not a module")
    (d / ".aot-interrupted").mkdir()
    results, errors = [], []

    def build():
        try:
            results.append(kernel_cache.build_aot(reuse=True))
        except RuntimeError as e:
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mp.undo()
    if errors:
        pytest.fail(f"the ahead-of-time module did not build on this machine: {errors[0]}")
    seen = {"built": sorted(built for _, built in results), "older": older.exists(), "other": other.exists(),
            "leftovers": sorted(p.name for p in d.glob(".aot-*")), "tmp": sorted(p.name for p in tmp.iterdir())}
    yield d, results[0][0], seen


@pytest.fixture
def aot_dir(aot_build):
    return aot_build[:2]


def test_aot_builds_are_locked_reused_and_tidy(aot_build, monkeypatch):
    # two builds at once into one folder: one builds, the other waits and reuses it; this machine's module of an
    # older kernel source and an interrupted build's folder are removed, another machine's module is kept, and
    # numba's temporary files stayed inside the build's own folder
    d, path, seen = aot_build
    assert seen == {"built": [False, True], "older": False, "other": True, "leftovers": [], "tmp": []}
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(d))
    assert kernel_cache.current_aot_path() == path and kernel_cache.load_aot() is not None


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

    d, _ = aot_dir
    env = {k: v for k, v in os.environ.items() if k != "REPACK_NO_AOT"}
    env["NUMBA_CACHE_DIR"] = str(d)
    assert _fresh_process_quantizes(env, "", "'numba' in sys.modules") == "False"


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
    kernel_cache._digest_path(kernel_cache.aot_path(key)).write_bytes(kernel_cache._digest_path(path).read_bytes())
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


def test_an_unwritable_cache_folder_is_one_line_and_builds_use_the_jit_kernel(tmp_path, monkeypatch, capsys):
    # setup.sh runs this under `set -e`: a folder it cannot write must not end the install with a traceback
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(blocker))
    with pytest.raises(RuntimeError, match="cannot write it into"):
        kernel_cache.build_aot()
    monkeypatch.setattr(kernel_cache, "warm", lambda: "numba")
    assert kernel_cache.main() == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1].startswith("repack grid kernel: no ahead-of-time module (cannot write it into")
    assert kernel_cache.load_aot() is None


def test_with_repack_no_aot_a_current_module_is_reported_not_rebuilt(aot_dir, monkeypatch, capsys):
    d, path = aot_dir
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(d))
    monkeypatch.setenv("REPACK_NO_AOT", "1")
    monkeypatch.setattr(kernel_cache, "warm", lambda: "numba")
    before = path.stat().st_mtime_ns
    assert kernel_cache.main() == 0
    out = capsys.readouterr().out
    assert "the ahead-of-time module is current" in out and "REPACK_NO_AOT is set, so builds ignore it" in out
    assert path.stat().st_mtime_ns == before
