"""Compile the grid kernel ahead of use: into numba's on-disk cache, and as an extension module.

numba compiles `repack._kernel_numba` on its first call, a minute or more of CPU; ./setup.sh runs this once per
install so that the first build does not pay for it, and the test suite runs it before its workers start so that
two of them never compile it at once (after an edit of the kernel). When the cache is current it only loads it.

The same kernel is also compiled ahead of time (numba.pycc, which needs a C and C++ compiler) into an extension
module, `_kernel_aot-MACHINE-SOURCE.so` next to numba's cache: a build loads it in milliseconds and never imports
numba, whose import and first dispatch (typing registries, the cached code) take 0.4-1 s of every build's start.
MACHINE covers what the machine code depends on besides the kernel: numpy's version (its C API), the
interpreter's ABI and the CPU's features (the code uses the host's instructions, as numba's JIT does); SOURCE the
kernel's source. Where it is missing, stale or damaged, builds use the JIT kernel. REPACK_NO_AOT=1 ignores it.

    python -m repack.kernel_cache
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
import warnings
from pathlib import Path

AOT_NAME = "_kernel_aot"
_KERNEL_SOURCE = Path(__file__).with_name("_kernel_numba.py")
# quantize_rows(words, packed, scales, stats, ratio_table, lowbit, sig, minexp, vmax, osig, ominexp, ovmax,
# min_error): the argument types grid.run_kernel passes (the module's wrapper checks none of them: grid does)
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


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p + b"\0")
    return h.hexdigest()


def aot_key() -> str | None:
    """MACHINE-SOURCE (see the module docstring); None where the CPU's features cannot be read (then only the
    JIT kernel is used)."""
    features = _cpu_features()
    if features is None:
        return None
    import numpy as np

    machine = _sha(*(s.encode() for s in (np.__version__, sys.implementation.cache_tag, platform.machine(),
                                          features)))
    return f"{machine[:12]}-{_sha(_KERNEL_SOURCE.read_bytes())[:16]}"


def aot_path(key: str) -> Path:
    return cache_dir() / f"{AOT_NAME}-{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def current_aot_path() -> Path | None:
    """The module for this machine and kernel source if it is the file that was built (its digest, written after
    it, matches: a damaged one, e.g. truncated, would crash the process that maps it); else None."""
    key = aot_key()
    if key is None:
        return None
    path = aot_path(key)
    try:
        if path.is_file() and _sha(path.read_bytes()) == _digest_path(path).read_text().strip():
            return path
    except (OSError, UnicodeDecodeError):
        pass
    return None


def load_aot():
    """The ahead-of-time kernel's quantize_rows, or None (no current module, REPACK_NO_AOT, or it does not load:
    then the JIT kernel is used)."""
    if os.environ.get("REPACK_NO_AOT"):
        return None
    path = current_aot_path()
    if path is None:
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


class _Lock:
    """An exclusive lock on the cache folder's ahead-of-time builds (one builds, the others wait and reuse)."""

    def __init__(self, folder: Path):
        self.path = folder / f"{AOT_NAME}.lock"

    def __enter__(self):
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def build_aot(*, reuse: bool = False) -> tuple[Path, bool]:
    """Compiles the kernel into the ahead-of-time module for this machine (seconds once the JIT kernel is in
    numba's cache, a minute or more from cold; needs numba and a C and C++ compiler), unless `reuse` and a current
    one exists. Returns (its path, whether it was built). Written whole or not at all, under a lock on the cache
    folder; removes the modules of older kernel sources for this machine and what interrupted builds left.
    Raises RuntimeError with a one-line reason where it cannot be built."""
    key = aot_key()
    if key is None:
        raise RuntimeError("the CPU's features cannot be read (/proc/cpuinfo)")
    target = aot_path(key)
    folder = target.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _Lock(folder):
            if reuse and current_aot_path() == target:
                return target, False
            for old in folder.glob(".aot-*"):  # the lock is free: no build is running, these were interrupted
                shutil.rmtree(old, ignore_errors=True)
            with tempfile.TemporaryDirectory(prefix=".aot-", dir=folder) as tmp:
                built = _compile(Path(tmp))
                digest = Path(tmp) / "digest"
                digest.write_text(_sha(built.read_bytes()) + "\n")
                _digest_path(target).unlink(missing_ok=True)  # no moment where an old digest names a new file
                os.replace(built, target)
                os.replace(digest, _digest_path(target))
            machine = key.split("-")[0]
            for old in folder.glob(f"{AOT_NAME}-{machine}-*"):  # this machine's modules of other kernel sources
                if old not in (target, _digest_path(target)) and old.is_file() and not old.is_symlink():
                    old.unlink(missing_ok=True)
    except OSError as e:
        raise RuntimeError(f"cannot write it into {folder} ({e.strerror or e}: {e.filename or folder})") from None
    return target, True


def _compile(tmp: Path) -> Path:
    """numba.pycc's build of the kernel into tmp; numba's own temporary files go there too."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # numba.pycc is pending deprecation; the JIT kernel remains
            import numba.core.codegen as codegen
            import numba.pycc.compiler as pycc_compiler
            from numba.core.compiler import Flags
            from numba.pycc import CC
            from numba.pycc.platform import external_compiler_works
    except ImportError as e:
        raise RuntimeError(f"numba.pycc is not importable ({e})") from None
    from . import _kernel_numba

    class _GilFreeFlags(Flags):
        # pycc's wrapper holds the GIL through the call; a build runs the kernel in one thread per core
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.release_gil = True

    saved = pycc_compiler.Flags, codegen.AOTCPUCodegen._customize_tm_features, tempfile.tempdir
    pycc_compiler.Flags = _GilFreeFlags
    # pycc enables what the CPU model's name implies; a VM can mask some of it: the host's own features, as the
    # JIT takes them
    codegen.AOTCPUCodegen._customize_tm_features = lambda self: self._get_host_cpu_features()
    tempfile.tempdir = str(tmp)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not external_compiler_works():
                raise RuntimeError("no working C and C++ compiler (numba.pycc needs both, e.g. gcc and g++)")
            cc = CC(AOT_NAME)
            cc.output_dir = str(tmp)
            cc.target_cpu = "host"
            cc.verbose = False
            cc.export("quantize_rows", _SIGNATURE)(_kernel_numba.quantize_rows.py_func)
            cc.compile()
    except RuntimeError:
        raise
    except Exception as e:  # compiler and linker failures surface as setuptools errors of several kinds
        raise RuntimeError(f"numba.pycc could not build it ({type(e).__name__}: {' '.join(str(e).split())})") from None
    finally:
        pycc_compiler.Flags, codegen.AOTCPUCodegen._customize_tm_features, tempfile.tempdir = saved
    built = [p for p in tmp.iterdir() if p.name.startswith(AOT_NAME) and p.is_file()]
    if len(built) != 1:
        raise RuntimeError(f"numba.pycc wrote {[p.name for p in built]}, not one module")
    return built[0]


def warm() -> str:
    """Compiles (or loads) both specialisations of the JIT kernel a build can use and returns the implementation
    builds use: "numba" (the JIT kernel, and the ahead-of-time one where current), "aot" (numba is not
    importable, the ahead-of-time module is current) or "numpy"."""
    import numpy as np

    from repack import grid

    if grid.implementation() != "numba":
        return grid.implementation()
    try:
        import numba  # noqa: F401
    except ImportError:
        return "aot"
    grid._import_numba_arrays_without_scipy()
    from repack import _kernel_numba

    # the JIT kernel (the tests and the benchmark use it, and builds where the ahead-of-time module is missing):
    # both specialisations a build can pass, a writable array and a read-only one (a memory map)
    for w in (np.zeros((1, 32), np.uint16), np.frombuffer(bytes(64), np.uint16).reshape(1, 32)):
        grid.run_kernel(_kernel_numba.quantize_rows, w)
    return "numba"


def main() -> int:
    # SIGTERM as an exception, so that an interrupted build removes its temporary folder
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    t = time.monotonic()
    impl = warm()
    if impl == "numpy":
        print("repack grid kernel: numba is not importable; builds use the numpy reference (slow)")
        return 1
    if impl == "aot":
        print("repack grid kernel: numba is not importable; builds use the ahead-of-time module")
        return 0
    print(f"repack grid kernel: compiled or loaded from numba's cache in {time.monotonic() - t:.1f} s")
    t = time.monotonic()
    try:
        path, built = build_aot(reuse=True)
    except RuntimeError as e:
        print(f"repack grid kernel: no ahead-of-time module ({e}); builds use the JIT kernel, 0.4-1 s more to start")
        return 0
    what = f"built in {time.monotonic() - t:.1f} s" if built else "current"
    ignored = "; REPACK_NO_AOT is set, so builds ignore it" if os.environ.get("REPACK_NO_AOT") else ""
    print(f"repack grid kernel: the ahead-of-time module is {what} ({path.name}){ignored}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
