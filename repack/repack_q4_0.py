"""Step 1 of the article: the linear layers to compressed-tensors W4A16; towers and embeddings stay bf16.

    python3 repack/repack_q4_0.py repack SRC OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.cli.repack_cli import STEP_FLAGS, build_command, step_main  # noqa: E402

STEP = build_command("repack", "SRC (QAT q4_0-unquantized) to OUT with int4 linears", only=STEP_FLAGS,
                     quantize_linears=True, text_only=False, embed_int4=False, embed_tokens=False)


def main(argv: list[str] | None = None) -> int:
    return step_main(argv, "repack_q4_0.py", __doc__, STEP, subcommand=True)


if __name__ == "__main__":
    raise SystemExit(main())
