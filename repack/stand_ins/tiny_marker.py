"""The marker of a folder the tiny model (repack.stand_ins.tiny_model) wrote: what its `force` may replace.

A config.json is no such mark: a fetched source or a repack build has one too. The marker is a hidden file, so a
repack of the tiny source does not carry it into the build (repack.source.checkpoint's side files leave hidden files
aside).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MARKER = ".gemma4-t4-tiny-model.json"
MADE_BY = "repack.tiny_model"


def mark(out: Path, kind: str) -> None:
    """Marks `out` (a source or a drafter) as written by the tiny model."""
    (out / MARKER).write_text(json.dumps({"made_by": MADE_BY, "kind": kind}) + "\n")


def not_replaceable(out: str | Path) -> str | None:
    """None when `out` may be replaced by a new tiny model: absent, an empty folder, or a folder the tiny model
    wrote (its marker); else why not, in a few words."""
    p = Path(out)
    if not os.path.lexists(p):
        return None
    if p.is_symlink() or not p.is_dir():
        return "it is not a folder"
    try:
        if not any(p.iterdir()):
            return None
        made = json.loads((p / MARKER).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return f"it has no {MARKER}, so this tool did not write it"
    if not (isinstance(made, dict) and made.get("made_by") == MADE_BY):
        return f"its {MARKER} is not this tool's"
    return None


def refusal(out: Path, force: bool) -> str | None:
    """Why the command line may not write `out` (it exists, not empty: --force replaces only what this tool
    wrote), or None."""
    if not os.path.lexists(out) or (out.is_dir() and not out.is_symlink() and not any(out.iterdir())):
        return None
    if not force:
        return f"{out} exists: pass --force to replace it, or choose another"
    why = not_replaceable(out)
    return why and (f"{out} exists and --force replaces only a folder this tool wrote: {why}; choose another or "
                    "move it away")


__all__ = ["MARKER", "mark", "not_replaceable", "refusal"]
