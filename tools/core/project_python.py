"""The project's scripts run as `python3 FILE` (server.py, patch_triton_turing.py) run on its virtualenv, as
./vllm-t4 does: `python3` first on PATH may be one without the project's packages. Standard library only: it runs
before those packages are known to be importable."""

from __future__ import annotations

import os
import sys
from pathlib import Path

_REEXEC = "GEMMA4_T4_REEXEC"  # set across the one re-exec, so it never loops


def on_project_venv(script: str) -> None:
    """Re-runs `script` (its arguments kept) on the Python of the .venv beside it when another Python started it;
    where there is no such Python, the caller goes on (and says what is missing if its imports fail)."""
    here = Path(script).resolve()
    venv = here.parent / ".venv"
    python = venv / "bin" / "python"
    if (os.environ.pop(_REEXEC, None) is None and python.is_file()
            and os.path.realpath(sys.prefix) != os.path.realpath(venv)):
        os.environ[_REEXEC] = "1"
        os.execv(python, [str(python), str(here), *sys.argv[1:]])


def missing_packages(script: str, exc: ImportError) -> SystemExit:
    """The one line a script prints when this Python lacks the project's packages and no .venv could run it."""
    name = Path(script).name
    print(f"{name}: {sys.executable} lacks the project's packages ({exc}) and {Path(script).resolve().parent / '.venv'} "
          "has no Python; run ./setup.sh", file=sys.stderr)
    return SystemExit(1)
