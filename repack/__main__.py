import gc
import os
import sys

# A build is a few seconds of work behind a fixed start and exit; these trim what is not the build's (measured in
# evidence/repack-bench.md):
# - numba probes for a BLAS by importing scipy.linalg (about 0.2 s) the first time it loads any function; the grid
#   kernel does no linear algebra, and nothing else this command runs uses scipy.
if "scipy.linalg" not in sys.modules:
    sys.modules["scipy.linalg"] = None  # type: ignore[assignment]
# - numpy's OpenBLAS starts a worker thread per core at import, which spins beside the kernel's workers (about 1%
#   of a build's CPU); nothing this command runs uses BLAS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# - the garbage collector would traverse the start's long-lived objects (numba's type system, pydantic models)
#   over and over while they are created, and once more at exit (about 0.3 s); the build makes no garbage cycles
#   worth collecting.
gc.disable()

from tools.cli.repack_cli import main  # noqa: E402

rc = main()
sys.stdout.flush()
sys.stderr.flush()
gc.freeze()  # exit without a last collection over every object
raise SystemExit(rc)
