#!/usr/bin/env python3
"""Applies, checks or reverts the Turing clamp in the installed vLLM's Triton unified attention.

  ./patch_triton_turing.py            apply (idempotent; backs up the original next to it)
  ./patch_triton_turing.py --check    exit 0 when applied (or not needed: this vLLM's tiles fit), 1 when not
  ./patch_triton_turing.py --revert   restore the original
  --target FILE                        work on FILE instead of the installed vLLM's file

A vLLM whose tile-size decision the clamp cannot find is refused (exit 2, the file untouched).
Why and what: tools/serving/turing_patch.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tools.serving import turing_patch  # noqa: E402
from tools.core.errors import ToolFailure  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="patch_triton_turing.py",
                                 description="Turing (sm_75) shared-memory clamp for vLLM's Triton attention.")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 0 when the clamp is applied or not needed, 1 when not")
    mode.add_argument("--revert", action="store_true", help="restore the original file")
    ap.add_argument("--target", type=Path, default=None,
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
    except ToolFailure as exc:
        print(f"patch_triton_turing.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
