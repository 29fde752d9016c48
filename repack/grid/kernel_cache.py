"""Compile the grid kernel into numba's on-disk cache ahead of its first use.

numba compiles `repack.grid._kernel_numba` on its first call; ./setup.sh runs this once per install so that the first
build does not pay for it, and the test suite runs `warm()` before its workers start so that two of them never
compile it at once (after an edit of the kernel). When the cache is current it only loads it.

    python -m repack.kernel_cache
"""

from __future__ import annotations

import time

import numpy as np

from repack.grid import grid


def warm() -> str:
    """Compiles (or loads) both specialisations of the kernel a build can use, a writable array and a read-only
    one (a memory map), and returns the implementation builds use: "numba" or "numpy" (numba not importable)."""
    if grid.implementation() != "numba":
        return "numpy"
    from repack.grid import _kernel_numba

    for w in (np.zeros((1, 32), np.uint16), np.frombuffer(bytes(64), np.uint16).reshape(1, 32)):
        grid.run_kernel(_kernel_numba.quantize_rows, w)
    return "numba"


def main() -> int:
    t = time.monotonic()
    if warm() == "numpy":
        print("repack grid kernel: numba is not importable; builds use the numpy reference (slow)")
        return 1
    print(f"repack grid kernel: compiled or loaded from numba's cache in {time.monotonic() - t:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
