"""Step 2 of the article: pack the embedding tables as int4.

    python3 repack/embed_int4.py OUT-text OUT-text-emb4 --embed-tokens

Packs the per-layer embedding table (PLE) and, with --embed-tokens, the token embedding, whose levels and
scales are written again as an untied int4 lm_head (tie_word_embeddings: false). Aborts on any off-grid group.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.cli.repack_cli import STEP_FLAGS, build_from_args, build_parser  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="embed_int4.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    build_parser(ap, only=STEP_FLAGS | {"embed_tokens"})
    args = ap.parse_args(argv)
    return build_from_args(args, quantize_linears=False, text_only=False, embed_int4=True)


if __name__ == "__main__":
    raise SystemExit(main())
