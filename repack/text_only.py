"""Step 1b of the article: drop the vision and audio towers; the checkpoint becomes a Gemma4ForCausalLM.

    python3 repack/text_only.py OUT OUT-text

`model.language_model.*` becomes `model.*`, the text_config is promoted to the top level; every other tensor
is byte-identical.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.cli.repack_cli import build_command, step_main  # noqa: E402

STEP = build_command("text_only.py", "OUT to OUT-text without the towers",
                     only=frozenset({"source", "output", "force"}),  # no scales: nothing is packed
                     quantize_linears=False, text_only=True, embed_int4=False, embed_tokens=False)


def main(argv: list[str] | None = None) -> int:
    return step_main(argv, "text_only.py", __doc__, STEP)


if __name__ == "__main__":
    raise SystemExit(main())
