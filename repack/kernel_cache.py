"""Compile the grid kernel ahead of use: into numba's on-disk cache, and as an extension module.

numba compiles `repack._kernel_numba` on its first call, a minute or more of CPU; ./setup.sh runs this once per
install so that the first build does not pay for it, and the test suite runs it before its workers start so that
two of them never compile it at once (after an edit of the kernel). When the cache is current it only loads it.

The same kernel is also compiled ahead of time (numba.pycc) into an extension module, `_kernel_aot-KEY.so` next
to numba's cache: a build loads it in milliseconds and never imports numba, whose import and first dispatch
(typing registries, the cached code) take 0.5-0.6 s of every build's start. KEY covers what the machine code
depends on: the kernel's source, numpy's version (its C API), the interpreter's ABI and the CPU's features (the
code uses the host's instructions, as numba's JIT does). Where it is missing or stale, builds use the JIT kernel.
REPACK_NO_AOT=1 ignores it.

    python -m repack.kernel_cache
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

AOT_NAME = "_kernel_aot"
_KERNEL_SOURCE = Path(__file__).with_name("_kernel_numba.py")
# quantize_rows(words, packed, scales, stats, ratio_table, lowbit, sig, minexp, vmax, osig, ominexp, ovmax,
# min_error): the argument types grid.quantize passes (the module's wrapper checks none of them: grid does)
_SIGNATURE = ("void(uint16[:, ::1], uint32[:, ::1], float64[:, ::1], float64[::1], int32[::1], int8[::1], "
              "int64, int64, float64, int64, int64, float64, boolean)")


def cache_dir() -> Path:
    """Where numba caches the JIT kernel, and where the ahead-of-time module goes."""
    d = os.environ.get("NUMBA_CACHE_DIR")
    return Path(d) if d else Path(__file__).with_name("__pycache__")


def _cpu_features() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def aot_key() -> str | None:
    """The ahead-of-time module's key (see the module docstring); None where the CPU's features cannot be read
    (then only the JIT kernel is used)."""
    features = _cpu_features()
    if features is None:
        return None
    import numpy as np

    h = hashlib.sha256(_KERNEL_SOURCE.read_bytes())
    for part in (np.__version__, sys.implementation.cache_tag, platform.machine(), features):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def aot_path(key: str) -> Path:
    return cache_dir() / f"{AOT_NAME}-{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def load_aot():
    """The ahead-of-time kernel's quantize_rows, or None (no module for this key, REPACK_NO_AOT, or it does not
    load: then the JIT kernel is used)."""
    if os.environ.get("REPACK_NO_AOT"):
        return None
    key = aot_key()
    if key is None:
        return None
    path = aot_path(key)
    try:
        # a damaged file (truncated, overwritten) would crash the process that maps it: it is loaded only if it
        # is the file that was built, as its digest, written after it, says
        if _digest(path.read_bytes()) != _digest_path(path).read_text().strip():
            return None
    except OSError:
        return None
    name = f"repack.{AOT_NAME}"  # the last part names its init function
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    try:
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module.quantize_rows
    except (ImportError, OSError, AttributeError):
        return None


def build_aot() -> Path:
    """Compiles the kernel into the ahead-of-time module for this machine (a few seconds; needs numba and a C
    compiler) and removes those of other keys. Written whole or not at all (compiled in a temporary folder, then
    renamed). Raises RuntimeError with the reason where it cannot be built."""
    key = aot_key()
    if key is None:
        raise RuntimeError("the CPU's features cannot be read (/proc/cpuinfo)")
    target = aot_path(key)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numba.pycc is pending deprecation; the JIT kernel remains
            import numba.pycc.compiler as pycc_compiler
            from numba.core.compiler import Flags
            from numba.pycc import CC
    except ImportError as e:
        raise RuntimeError(f"numba.pycc is not importable ({e})") from None
    from . import _kernel_numba

    class _GilFreeFlags(Flags):
        # pycc's wrapper holds the GIL through the call; a build runs the kernel in one thread per core
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.release_gil = True

    cc = CC(AOT_NAME)
    cc.target_cpu = "host"
    cc.verbose = False
    cc.export("quantize_rows", _SIGNATURE)(_kernel_numba.quantize_rows.py_func)
    saved = pycc_compiler.Flags
    with tempfile.TemporaryDirectory(prefix=".aot-", dir=target.parent) as tmp:
        cc.output_dir = tmp
        pycc_compiler.Flags = _GilFreeFlags
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cc.compile()
        except Exception as e:  # a missing C compiler surfaces as distutils/setuptools errors of several kinds
            raise RuntimeError(f"numba.pycc could not build it ({type(e).__name__}: {e})") from None
        finally:
            pycc_compiler.Flags = saved
        built = [p for p in Path(tmp).iterdir() if p.name.startswith(AOT_NAME)]
        if len(built) != 1:
            raise RuntimeError(f"numba.pycc wrote {[p.name for p in built]}, not one module")
        digest = Path(tmp) / "digest"
        digest.write_text(_digest(built[0].read_bytes()) + "\n")
        _digest_path(target).unlink(missing_ok=True)  # no moment where an old digest names a new file
        os.replace(built[0], target)
        os.replace(digest, _digest_path(target))
    for old in target.parent.glob(f"{AOT_NAME}-*"):
        if old not in (target, _digest_path(target)):
            old.unlink(missing_ok=True)
    return target


def warm() -> str:
    """Compiles (or loads) both specialisations a build uses and returns the implementation in use."""
    import numpy as np

    from repack import grid

    if grid.implementation() != "numba":
        return grid.implementation()
    grid._import_numba_arrays_without_scipy()
    from repack import _kernel_numba

    # the JIT kernel (the tests and the benchmark use it, and builds where the ahead-of-time module is missing):
    # both specialisations a build can pass, a writable array and a read-only one (a memory map)
    for w in (np.zeros((1, 32), np.uint16), np.frombuffer(bytes(64), np.uint16).reshape(1, 32)):
        grid.run_kernel(_kernel_numba.quantize_rows, w)
    return "numba"


def main() -> int:
    t = time.monotonic()
    impl = warm()
    if impl != "numba":
        print("repack grid kernel: numba is not importable; builds use the numpy reference (slow)")
        return 1
    print(f"repack grid kernel: compiled or loaded from numba's cache in {time.monotonic() - t:.1f} s")
    t = time.monotonic()
    key = aot_key()
    if key is not None and aot_path(key).is_file() and load_aot() is not None:
        print("repack grid kernel: the ahead-of-time module is current")
        return 0
    try:
        path = build_aot()
    except RuntimeError as e:
        print(f"repack grid kernel: no ahead-of-time module ({e}); builds use the JIT kernel, 0.5 s more to start")
        return 0
    print(f"repack grid kernel: ahead-of-time module built in {time.monotonic() - t:.1f} s ({path.name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
