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

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

from tools.core.project_python import missing_packages, on_project_venv  # noqa: E402  (standard library only)

if __name__ == "__main__":
    on_project_venv(__file__)

try:
    import argparse

    from tools.core.commands import CLI
    from tools.core.errors import BadInput, ToolFailure
    from tools.serving import turing_patch
except ImportError as _exc:  # a Python without the project's packages, and no .venv beside this file
    raise missing_packages(__file__, _exc) from None


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
