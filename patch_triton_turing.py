#!/usr/bin/env python3
"""Applies, checks or reverts the Turing clamp in the installed vLLM's Triton unified attention.

  ./patch_triton_turing.py            apply (idempotent; backs up the original next to it)
  ./patch_triton_turing.py --check    exit 0 when applied (or not needed: this vLLM's tiles fit), 1 when not,
                                       2 when the file is one it cannot patch (as apply refuses it)
  ./patch_triton_turing.py --revert   restore the original
  --target FILE                        work on FILE instead of the installed vLLM's file (the file itself: a
                                       symbolic link to it is refused, naming the file to pass)

It runs on the project's virtualenv (.venv, what ./setup.sh makes), whatever `python3` is first on PATH: the
vLLM it patches is the one the project serves with. Bad input (a file it cannot patch) exits 2, a failure of the
machine (a full disk) 1. Why and what: tools/serving/turing/patch.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_VENV = _HERE / ".venv"
_REEXEC = "GEMMA4_T4_PATCH_REEXEC"  # set across the one re-exec, so it never loops


def _in_project_venv() -> bool:
    return os.path.realpath(sys.prefix) == os.path.realpath(_VENV)


def _to_project_venv() -> None:
    """Re-runs this file on the project's virtualenv, as ./vllm-t4 does, when another Python started it."""
    python = _VENV / "bin" / "python"
    if os.environ.pop(_REEXEC, None) is None and python.is_file() and not _in_project_venv():
        os.environ[_REEXEC] = "1"
        os.execv(python, [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])


if __name__ == "__main__":
    _to_project_venv()

sys.path.insert(0, str(_HERE))

try:
    import argparse

    from tools.core.commands import CLI
    from tools.core.errors import BadInput, ToolFailure
    from tools.serving import turing_patch
except ImportError as _exc:  # a Python without the project's packages, and no .venv beside this file
    print(f"patch_triton_turing.py: {sys.executable} lacks the project's packages ({_exc}) and {_VENV} has no "
          "Python; run ./setup.sh", file=sys.stderr)
    raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="patch_triton_turing.py",
                                 description="Turing (sm_75) shared-memory clamp for vLLM's Triton attention.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="exit 0 when the clamp is applied or not needed, 1 when not, 2 when the file cannot be "
                           "patched")
    mode.add_argument("--revert", action="store_true", help="restore the original file")
    # a str, not a Path: Path("") is ".", and an empty --target is to be refused as such
    ap.add_argument("--target", default=None,
                    help=f"file to work on (default: the installed vLLM's {turing_patch.RELATIVE_PATH})")
    args = ap.parse_args(argv)
    try:
        if args.check:
            status = turing_patch.check(args.target)
            print(status.message)
            return 0 if status.applied or not status.needed else 1
        status = turing_patch.revert(args.target) if args.revert else turing_patch.apply(args.target)
        print(status.message)
        return 0
    except BadInput as exc:
        print(f"patch_triton_turing.py: {exc.render(CLI)}", file=sys.stderr)
        return 2
    except ToolFailure as exc:  # the machine's (a full disk, no vLLM installed), not the input's
        print(f"patch_triton_turing.py: {exc.render(CLI)}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"patch_triton_turing.py: {exc.filename or args.target}: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
