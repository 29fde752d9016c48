"""Compile the grid kernel into numba's on-disk cache (repack/__pycache__, or NUMBA_CACHE_DIR) ahead of use.

numba compiles `repack._kernel_numba` on its first call, a minute or more of CPU; ./setup.sh runs this once per
install so that the first build does not pay for it, and the test suite runs it before its workers start so that
two of them never compile it at once (after an edit of the kernel). When the cache is current it only loads it.

    python -m repack.kernel_cache
"""

from __future__ import annotations

import time


def warm() -> str:
    """Compiles (or loads) both specialisations a build uses and returns the implementation in use."""
    import numpy as np

    from repack import grid

    if grid.implementation() != "numba":
        return grid.implementation()
    grid.quantize(np.zeros((1, 32), np.uint16))  # a writable array, as the tests and the library pass
    grid.quantize(np.frombuffer(bytes(64), np.uint16).reshape(1, 32))  # read-only, as a build's memory map
    return "numba"


def main() -> int:
    t = time.monotonic()
    impl = warm()
    if impl != "numba":
        print("repack grid kernel: numba is not importable; builds use the numpy reference (slow)")
        return 1
    print(f"repack grid kernel: compiled or loaded from numba's cache in {time.monotonic() - t:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
