"""Names the tools put into file and folder names (a run's label, a run id, a record's name): letters, digits,
'.', '_' and '-', starting with a letter or digit, at most 100 bytes so that a name fits a file name with the
time and hash a run folder adds."""

from __future__ import annotations

import re

from tools.core.errors import BadInput, param
from tools.core.text import clip

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_BYTES = 100
RULE = f"must be a name of letters, digits, '.', '_' or '-' (at most {MAX_BYTES} bytes, no spaces or slashes)"


def is_name(value: object) -> bool:
    return isinstance(value, str) and bool(NAME.fullmatch(value)) and len(value.encode(errors="replace")) <= MAX_BYTES


def check_name(value: str, field: str = "label", *, what: str | None = None) -> str:
    """`value` if it is such a name; else BadInput naming the parameter `field` (or, for a name no caller
    chose, `what` it is: "run id")."""
    if is_name(value):
        return value
    raise BadInput(f"{what or param(field)} {clip(repr(value))} {RULE}", {"input": clip(str(value))},
                   field=None if what else field)


__all__ = ["MAX_BYTES", "NAME", "RULE", "check_name", "is_name"]
