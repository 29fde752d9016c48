"""Command-line flags derived from a pydantic params model, so the CLI and the MCP tool take the same options.

Each field becomes `--field-name` (underscores to dashes), its description the help text, a Literal its choices,
a bool a switch; `positional` names the fields taken as positional arguments. Values not given on the command
line are left out, so the model's defaults apply exactly as they do for an MCP call.
"""

from __future__ import annotations

import argparse
import typing
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError

from tools.errors import ToolFailure


class BadInput(ToolFailure):
    """Input the caller must change (an option, an id, a path): the command line exits with status 2."""


def _plain(annotation: Any) -> tuple[Any, bool]:
    """(the type without Optional, whether None is allowed)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType", None)) and \
            type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else annotation), True
    return annotation, False


def add_model_arguments(parser: argparse.ArgumentParser, model: type[BaseModel], *,
                        positional: Iterable[str] = (), skip: Iterable[str] = ()) -> None:
    positional, skip = list(positional), set(skip)
    for name, info in model.model_fields.items():
        if name in skip:
            continue
        kind, _ = _plain(info.annotation)
        kw: dict[str, Any] = {"help": info.description or ""}
        if typing.get_origin(kind) is typing.Literal:
            kw["choices"] = list(typing.get_args(kind))
        elif kind is bool:
            kw["action"] = "store_true"
        elif kind in (int, float):
            kw["type"] = kind
        elif typing.get_origin(kind) is list:
            kw["nargs"] = "+"
        if name in positional:
            parser.add_argument(name, **kw)
        else:
            parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, **kw)


def params_from_args(model: type[BaseModel], args: argparse.Namespace) -> BaseModel:
    """The params model from parsed arguments; a value the model refuses is BadInput naming the option."""
    values = {name: getattr(args, name) for name in model.model_fields
              if getattr(args, name, None) not in (None, False)}
    try:
        return model(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = "--" + "-".join(str(p) for p in err.get("loc", ()) if isinstance(p, str)).replace("_", "-")
        raise BadInput(f"{where}: {err.get('msg', 'invalid value')}") from None
