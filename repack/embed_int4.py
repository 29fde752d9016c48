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

from repack.cli import add_scale_dtype, run_build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="embed_int4.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", metavar="SRC")
    ap.add_argument("out", metavar="OUT")
    ap.add_argument("--embed-tokens", action="store_true",
                    help="also pack embed_tokens and write it as an untied int4 lm_head")
    add_scale_dtype(ap)
    args = ap.parse_args(argv)
    return run_build(args.src, args.out, dict(quantize_linears=False, text_only=False, embed_int4=True,
                                              embed_tokens=args.embed_tokens, scale_dtype=args.scale_dtype,
                                              target_dtype=args.target_dtype, objective=args.objective,
                                              force=args.force), args.json)


if __name__ == "__main__":
    raise SystemExit(main())
