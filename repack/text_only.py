"""Step 1b of the article: drop the vision and audio towers; the checkpoint becomes a Gemma4ForCausalLM.

    python3 repack/text_only.py OUT OUT-text

`model.language_model.*` becomes `model.*`, the text_config is promoted to the top level; every other tensor
is byte-identical.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from repack.cli import run_build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="text_only.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", metavar="SRC")
    ap.add_argument("out", metavar="OUT")
    ap.add_argument("--force", action="store_true", help="replace OUT if it exists")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    return run_build(args.src, args.out, dict(quantize_linears=False, text_only=True, embed_int4=False,
                                              embed_tokens=False, force=args.force), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
