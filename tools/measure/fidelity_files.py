"""Fidelity's files: the corpus it scores and the reference file (REF.json) it records and checks against.

REF.json is one JSON object written a window per line (header line, `"windows": [`, one window a line, footer),
so that it can be written and read a window at a time: only one window's top-k is ever in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from tools.core.atomic_files import TempFile
from tools.core.errors import BadInput, op, param

RECORD_KIND = "gemma4-t4/logprob-record"
RECORD_VERSION = 1
DEFAULT_CORPUS = Path(__file__).resolve().parent / "data" / "fidelity-corpus.txt"


# ------------------------------------------------------------------------------------------------------------
# The corpus


def load_corpus(path: str | Path | None) -> tuple[Path, str, str]:
    """(path, text, sha256 of its bytes); a one-line BadInput for a missing, empty or non-UTF-8 file."""
    p = Path(path) if path else DEFAULT_CORPUS
    if not p.is_file():
        raise BadInput(f"corpus {p}: no such file; pass a UTF-8 text file with {param('corpus')}", field="corpus")
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"corpus {p}: not UTF-8 (byte {exc.start}: {data[exc.start:exc.start + 1]!r}); convert it "
                       f"to UTF-8 text") from exc
    if not text.strip():
        raise BadInput(f"corpus {p}: empty; pass a text file with at least one window of tokens")
    return p, text, hashlib.sha256(data).hexdigest()


# ------------------------------------------------------------------------------------------------------------
# The reference file: one JSON object, a window per line, so it can be written and read a window at a time.


class RefWriter:
    """REF.json written a window at a time to a temporary file beside it (tools.core.atomic_files: a killed
    record's leftover is swept by the next write there), put in place by commit()."""

    def __init__(self, out: Path, header: dict[str, Any], *, force: bool) -> None:
        self.out, self.force = out, force
        self.f = TempFile.open(out)
        head = {"kind": RECORD_KIND, "version": RECORD_VERSION, "header": header}
        self.f.write(json.dumps(head)[:-1] + ",\n\"windows\": [\n")
        self.n = 0

    def window(self, obj: dict[str, Any]) -> None:
        if self.n:
            self.f.write(",\n")
        self.f.write(json.dumps(obj, separators=(",", ":")))
        self.n += 1

    def commit(self, footer: dict[str, Any]) -> None:
        self.f.write("\n],\n\"footer\": " + json.dumps(footer) + "}\n")
        try:
            self.f.publish(replace=self.force)
        except FileExistsError as exc:
            raise BadInput(f"{self.out} appeared while recording; nothing overwritten (pass "
                           f"{param('force', True)} to replace it)", field="force") from exc

    def abort(self) -> None:
        self.f.discard()


def read_reference(path: str | Path):
    """(header, footer, iterator over windows): reads REF.json a line at a time."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: reference file not found; write one with {op('fidelity.record', out=str(p))}",
                       field="reference")
    hint = f"{p}: not a logprob reference; pass a file written by {op('fidelity.record')}"
    try:
        with open(p, "rb") as f:
            first = f.readline().decode("utf-8").rstrip()
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))
            last = f.read().decode("utf-8", errors="replace").rstrip().splitlines()[-1]
        head = json.loads(first.rstrip(",") + "}")
        tail = json.loads("{" + last)
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise BadInput(hint) from exc
    if not isinstance(head, dict) or head.get("kind") != RECORD_KIND or "footer" not in tail:
        raise BadInput(hint)
    if head.get("version") != RECORD_VERSION:
        raise BadInput(f"{p}: reference version {head.get('version')}, this tool reads {RECORD_VERSION}; "
                       f"record it again")

    def windows():
        with open(p, encoding="utf-8") as f:
            f.readline()
            f.readline()  # "windows": [
            for line in f:
                line = line.strip()
                if line.startswith("]"):
                    return
                try:
                    yield json.loads(line.rstrip(","))
                except ValueError as exc:
                    raise BadInput(f"{hint} (window line unreadable)") from exc

    return head["header"], tail["footer"], windows()
