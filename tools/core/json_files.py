"""THE reader of a JSON file the caller names (a generation config, a drafter's config.json, a REF.json, a run's
results): the file read through one pydantic model, so that a damaged file is one line naming the file and the
field, never a traceback from whatever code first touches the value."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from tools.core.errors import BadInput

M = TypeVar("M", bound=BaseModel)


def _refuse(path: Path, why: str, remedy: str, field: str | None, file_field: str | None) -> BadInput:
    tail = f"; {remedy}" if remedy else ""
    return BadInput(f"{path}: {why}{tail}", detail={"path": str(path), "field": file_field}, field=field)


def field_of(exc: ValidationError) -> tuple[str, str]:
    """(the first failing field as a dotted path, its problem) of a model's refusal."""
    err = exc.errors(include_url=False)[0]
    return ".".join(str(x) for x in err["loc"]) or "(top level)", err["msg"]


def read_json(path: str | Path, *, remedy: str = "", field: str | None = None) -> Any:
    """The JSON value of `path`; BadInput naming the file (and `field`, the parameter that named it) when it is
    missing, a folder, unreadable, not UTF-8 or not JSON."""
    p = Path(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise _refuse(p, "no such file", remedy, field, None) from None
    except IsADirectoryError:
        raise _refuse(p, "is a folder, not a JSON file", remedy, field, None) from None
    except UnicodeDecodeError as exc:
        raise _refuse(p, f"not UTF-8 text (byte {exc.start})", remedy, field, None) from None
    except OSError as exc:
        raise _refuse(p, f"cannot be read ({exc.strerror or exc})", remedy, field, None) from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _refuse(p, f"not JSON ({exc})", remedy, field, None) from None


def check_json(path: str | Path, data: Any, model: type[M], *, remedy: str = "", field: str | None = None) -> M:
    """`data` (read from `path`) as `model`; BadInput naming the file and the field the model refuses."""
    p = Path(path)
    if not isinstance(data, dict):
        raise _refuse(p, f"a JSON {type(data).__name__} where an object is wanted", remedy, field, None)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        name, msg = field_of(exc)
        raise _refuse(p, f"field {name!r}: {msg.lower()}", remedy, field, name) from None


def read_json_model(path: str | Path, model: type[M], *, remedy: str = "", field: str | None = None) -> M:
    """`path` read through `model`: one line naming the file and the field for any damage."""
    return check_json(path, read_json(path, remedy=remedy, field=field), model, remedy=remedy, field=field)


def validate_lines(path: str | Path, lines: list[tuple[int, Any]], adapter: TypeAdapter[Any], *,
                   remedy: str = "", field: str | None = None) -> list[Any]:
    """JSON lines (line number, value) of `path` through `adapter`: BadInput naming the file, the line and the
    field of the first one refused."""
    p = Path(path)
    out = []
    for n, value in lines:
        try:
            out.append(adapter.validate_python(value))
        except ValidationError as exc:
            name, msg = field_of(exc)
            raise _refuse(p, f"line {n}: field {name!r}: {msg.lower()}", remedy, field, name) from None
    return out


__all__ = ["check_json", "field_of", "read_json", "read_json_model", "validate_lines"]
