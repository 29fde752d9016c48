"""Step 1 of the article: the linear layers to compressed-tensors W4A16; towers and embeddings stay bf16.

    python3 repack/repack_q4_0.py repack SRC OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.cli.repack_cli import STEP_FLAGS, build_from_args, build_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="repack_q4_0.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("repack", help="SRC (QAT q4_0-unquantized) to OUT with int4 linears")
    build_parser(r, only=STEP_FLAGS)
    args = ap.parse_args(argv)
    return build_from_args(args, quantize_linears=True, text_only=False, embed_int4=False, embed_tokens=False)


if __name__ == "__main__":
    raise SystemExit(main())
