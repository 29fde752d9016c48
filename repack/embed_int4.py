"""Step 2 of the article: pack the embedding tables as int4.

    python3 repack/embed_int4.py OUT-text OUT-text-emb4 --embed-tokens

Packs the per-layer embedding table (PLE) and, with --embed-tokens, the token embedding, whose levels and
scales are written again as an untied int4 lm_head (tie_word_embeddings: false). Aborts on any off-grid group.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.cli.repack_cli import STEP_FLAGS, build_command, step_main  # noqa: E402

STEP = build_command("embed_int4.py", "OUT-text to OUT-text-emb4 with int4 embedding tables",
                     only=STEP_FLAGS | {"embed_tokens"}, quantize_linears=False, text_only=False, embed_int4=True)


def main(argv: list[str] | None = None) -> int:
    return step_main(argv, "embed_int4.py", __doc__, STEP)


if __name__ == "__main__":
    raise SystemExit(main())
