"""One parameter model per operation: the command line and the MCP tool signature are both derived from it.

Like vLLM's benchmark arguments, the model owns `add_cli_args` / `from_cli_args`: each field becomes
`--field-name` (a flag name of its own where `CLI_FLAGS` says so), its description is the help text, a
`bool` defaulting to true gets `--no-...`, a `list[int]` is written comma separated and a `Literal` gives the
choices; a `list[str]` named in `CLI_COMMA` is written comma separated and may be repeated. Fields in
`CLI_EXCLUDE` are set by the caller, fields in `MCP_EXCLUDE` are not offered to MCP clients (machine-local knobs
such as timeouts). A value the model refuses raises BadInput naming the flag (the command line exits 2 with that
line, and prints the error object under --json).
"""

from __future__ import annotations

import argparse
import inspect
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import to_json

from tools.core.errors import BadInput
from tools.core.text import clip


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:200]!r} is not a comma-separated list of integers") from None
    if not vals:
        raise argparse.ArgumentTypeError(f"{text[:200]!r}: give integers, comma separated")
    return vals


def _str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


class OpParams(BaseModel):
    """Base of every operation's parameter model."""

    model_config = ConfigDict(extra="forbid")

    CLI_FLAGS: ClassVar[dict[str, str | tuple[str, ...]]] = {}  # field -> flag(s) where the CLI keeps older names
    CLI_EXCLUDE: ClassVar[frozenset[str]] = frozenset()
    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ()
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset()
    MCP_DEFAULTS: ClassVar[dict[str, Any]] = {}     # where the MCP server's default differs (e.g. a root, not cwd)
    CLI_DEFAULTS: ClassVar[dict[str, Any]] = {}     # where the command line's default differs
    CLI_COMMA: ClassVar[frozenset[str]] = frozenset()  # list[str] fields written `--x a,b --x c`

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, exclude: frozenset[str] | set[str] = frozenset()
                     ) -> None:
        for name, f in cls.model_fields.items():
            if name in cls.CLI_EXCLUDE or name in exclude:
                continue
            tp = _strip_optional(f.annotation)
            help_ = f.description or ""
            default = None if f.is_required() else f.get_default(call_default_factory=True)
            default = cls.CLI_DEFAULTS.get(name, default)
            kwargs: dict[str, Any] = {"help": help_}
            if name in cls.CLI_POSITIONAL:
                flag: list[str] = [name]
            else:
                given = cls.CLI_FLAGS.get(name, "--" + name.replace("_", "-"))
                flag = [given] if isinstance(given, str) else list(given)
                kwargs["dest"] = name
                if f.is_required():
                    kwargs["required"] = True
                else:
                    kwargs["default"] = default
            if tp is bool:
                kwargs["action"] = argparse.BooleanOptionalAction if default else "store_true"
            elif get_origin(tp) is Literal:
                kwargs["choices"] = list(get_args(tp))
            elif get_origin(tp) is list and _strip_optional(get_args(tp)[0]) is int:
                kwargs["type"] = _int_list
            elif name in cls.CLI_COMMA and name not in cls.CLI_POSITIONAL:
                kwargs["type"] = _str_list
                kwargs["action"] = "extend"
                if default:  # argparse would extend the default list: leave it to the model (from_cli_args)
                    kwargs["default"] = None
                    help_ = f"{help_}, comma separated"
                    kwargs["help"] = f"{help_} (default {','.join(map(str, default))})"
                    default = None
            elif get_origin(tp) is list:
                kwargs["nargs"] = "+"
            elif tp in (int, float):
                kwargs["type"] = tp
            if default not in (None, False, "") and kwargs.get("action") in (None, "extend"):
                shown = ",".join(map(str, default)) if isinstance(default, list) else default
                kwargs["help"] = f"{help_} (default {shown})"
            parser.add_argument(*flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **fixed: Any) -> "OpParams":
        values = {name: getattr(args, name) for name in cls.model_fields
                  if name not in cls.CLI_EXCLUDE and hasattr(args, name)
                  and not (name in cls.CLI_COMMA and getattr(args, name) is None)}  # not given: the default
        try:
            return cls(**{**values, **fixed})
        except ValidationError as exc:  # a value argparse let through but the model refuses: a usage error
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "?"
            flag = cls.CLI_FLAGS.get(name, "--" + name.replace("_", "-"))
            flag = flag if isinstance(flag, str) else flag[-1]
            if name in cls.CLI_POSITIONAL:
                flag = name
            raise BadInput(f"{flag}: {first['msg']}", {"field": name, "input": clip(repr(first.get("input")))},
                           field=name) from None

    @classmethod
    def from_mcp_args(cls, arguments: dict[str, Any]) -> "OpParams":
        """MCP arguments (JSON) validated strictly, as the server validates a direct call's (start_job passes
        them here unchecked): no string for a boolean or a number."""
        return cls.model_validate_json(to_json({**cls.MCP_DEFAULTS, **arguments}), strict=True)

    @classmethod
    def mcp_signature(cls) -> list[inspect.Parameter]:
        """The MCP tool's keyword parameters: one per field, with its type, constraints and description."""
        out = []
        for name, f in cls.model_fields.items():
            if name in cls.MCP_EXCLUDE:
                continue
            default = inspect.Parameter.empty if f.is_required() else f.get_default(call_default_factory=True)
            default = cls.MCP_DEFAULTS.get(name, default)
            ann = Annotated[f.annotation, Field(description=f.description), *f.metadata]  # type: ignore[valid-type]
            out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann))
        return out


__all__ = ["OpParams"]
