"""Fidelity's files: the corpus it scores and the reference file (REF.json) it records and checks against.

REF.json is one JSON object written a window per line (header line, `"windows": [`, one window a line, footer),
so that it can be written and read a window at a time: only one window's top-k is ever in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tools.core.atomic_files import TempFile
from tools.core.errors import BadInput, op, param
from tools.core.json_files import field_of

RECORD_KIND = "gemma4-t4/logprob-record"
RECORD_VERSION = 1
DEFAULT_CORPUS = Path(__file__).resolve().parents[1] / "data" / "fidelity-corpus.txt"


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


# The reference's parts as the check reads them: strict, so that a damaged REF.json is one line naming the file,
# the line and the field, never a traceback from the arithmetic that first touches a value.
LogProb = Annotated[float, Field(le=0)]  # a log-probability: at most 0 (-inf allowed: a token vLLM rules out)


class RefHeader(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    tokenizer_sha256: str
    window: int = Field(gt=0)
    top_k: int = Field(ge=1)
    first_scored: int = Field(ge=1)
    prefix_ids: list[int] = Field(default_factory=list)
    text_shape: dict[str, Any] = Field(default_factory=dict)
    windows: int = Field(0, ge=0)


class RefFooter(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    windows: int = Field(ge=0)
    tokens: int = Field(ge=0)
    complete: bool = True


class RefWindow(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    index: int = Field(ge=0)
    start: int = Field(ge=0)
    ids: list[int] = Field(min_length=1)
    actual: list[LogProb]
    top: list[list[tuple[int, LogProb]]]

    @model_validator(mode="after")
    def _aligned(self) -> "RefWindow":
        if len(self.top) != len(self.actual):
            raise ValueError(f"{len(self.actual)} actual logprobs but {len(self.top)} top lists")
        return self


def _part(p: Path, model: type[BaseModel], data: Any, where: str) -> BaseModel:
    """`data` (a dict, or a window's JSON text) as `model`: one line naming the file, the part and the field."""
    if not isinstance(data, (dict, str)):
        raise BadInput(f"{p}: {where} is a JSON {type(data).__name__}, not an object; the file is damaged, record "
                       f"it again with {op('fidelity.record')}", field="reference")
    try:
        return model.model_validate_json(data) if isinstance(data, str) else model.model_validate(data)
    except ValidationError as exc:
        name, msg = field_of(exc)
        if exc.errors()[0]["type"] == "json_invalid":
            name, msg = "(top level)", "not JSON"
        raise BadInput(f"{p}: {where} field {name!r}: {msg.lower()}; the file is damaged, record it again with "
                       f"{op('fidelity.record')}", detail={"path": str(p), "field": name},
                       field="reference") from None


def read_reference(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], Iterator[dict[str, Any]]]:
    """(header, footer, iterator over windows): reads REF.json a line at a time, each part through its model."""
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
        raise BadInput(hint, field="reference") from exc
    if not isinstance(head, dict) or head.get("kind") != RECORD_KIND or not isinstance(tail, dict) \
            or "footer" not in tail:
        raise BadInput(hint, field="reference")
    if head.get("version") != RECORD_VERSION:
        raise BadInput(f"{p}: reference version {head.get('version')}, this tool reads {RECORD_VERSION}; "
                       f"record it again", field="reference")
    header = _part(p, RefHeader, head.get("header"), "header").model_dump()
    footer = _part(p, RefFooter, tail["footer"], "footer").model_dump()

    def windows() -> Iterator[dict[str, Any]]:
        with open(p, encoding="utf-8", errors="replace") as f:
            f.readline()
            f.readline()  # "windows": [
            for n, line in enumerate(f, 3):
                line = line.strip()
                if line.startswith("]"):
                    return
                if not line.startswith("{"):
                    raise BadInput(f"{hint} (line {n}: not a window object)", field="reference")
                yield _part(p, RefWindow, line.rstrip(","), f"line {n}: window").model_dump()

    for _ in windows():  # every window checked before any server is asked (one window in memory at a time)
        pass
    return header, footer, windows()
