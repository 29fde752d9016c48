"""One parameter model per operation: the command line and the MCP tool signature are both derived from it.

Like vLLM's benchmark arguments, the model owns `add_cli_args` / `from_cli_args`: each field becomes
`--field-name` (a flag name of its own where `CLI_FLAGS` says so), its description is the help text, a
`bool` defaulting to true gets `--no-...`, a `list[int]` is written comma separated and a `Literal` gives the
choices; a `list[str]` named in `CLI_COMMA` is written comma separated and may be repeated. Fields in
`CLI_EXCLUDE` are set by the caller, fields in `MCP_EXCLUDE` are not offered to MCP clients (machine-local knobs
such as timeouts). A value the model refuses raises BadInput naming the flag (the command line exits 2 with that
line, and prints the error object under --json).

Every model also keeps the rules that hold for any option (`OpParams._bounded`, before a field's own checks): a
number is finite, not negative and at most 2**53 (a field that means a signed quantity is named in `SIGNED`); a
string is not empty, at most TEXT_MAX characters on one line without control characters (a field that holds text
a person wrote, a prompt, is named in `MULTILINE`: up to MULTILINE_MAX characters, newlines and tabs allowed, no
other control characters); a list holds at most LIST_MAX items. A field's own range comes on top, from the shared
types below (`Seconds`, `Name`, `Price`, `Seed`) or its Field.
"""

from __future__ import annotations

import argparse
import inspect
import math
import types
from pathlib import PurePath
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError, to_json

from tools.core.errors import BadInput
from tools.core.text import clip


TEXT_MAX = 4096            # a path (Linux's PATH_MAX), a URL, a name
MULTILINE_MAX = 1_000_000  # a prompt a person wrote
LIST_MAX = 1000
NUMBER_MAX = 2 ** 53       # the integers a JSON number holds exactly
NAME_MAX = 100             # a name that goes into file names and tables (with a time and a hash: one file name)
WEEK_S = 7 * 24 * 3600.0

# Shared field types: a field's own range, on top of the rules every option keeps.
Seconds = Annotated[float, Field(gt=0, le=WEEK_S, allow_inf_nan=False)]  # a timeout: more than 0, at most a week
Price = Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)]       # money per hour
Seed = Annotated[int, Field(ge=0, le=2 ** 32 - 1)]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]*$"
Name = Annotated[str, Field(min_length=1, max_length=NAME_MAX, pattern=NAME_PATTERN)]
NAME_RULE = "letters, digits and . _ : @ + / - (starting with a letter or digit)"


def _refused(kind: str, text: str) -> PydanticCustomError:
    return PydanticCustomError(kind, text)


def check_bounded(value: Any, *, multiline: bool = False, signed: bool = False) -> Any:
    """The rules every option keeps (see the module's docstring); PydanticCustomError naming what is wrong."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise _refused("not_finite", f"must be a finite number, got {value}")
        if value < 0 and not signed:
            raise _refused("negative", f"must not be negative, got {value:g}")
        if abs(value) > NUMBER_MAX:
            raise _refused("too_large", f"must be at most {NUMBER_MAX} (2**53), got {value:g}")
    elif isinstance(value, (str, PurePath)):
        text = str(value)
        if not text:
            raise _refused("empty", "must not be empty (leave the option out for its default)")
        limit = MULTILINE_MAX if multiline else TEXT_MAX
        if len(text) > limit:
            raise _refused("too_long", f"must be at most {limit} characters, got {len(text)}")
        allowed = "\n\r\t" if multiline else ""
        bad = next((c for c in text if (ord(c) < 32 or 127 <= ord(c) < 160) and c not in allowed), None)
        if bad is not None:
            where = "" if multiline else "one line of "
            raise _refused("control_character", f"must be {where}text without control characters, got "
                                                f"{bad!r} at {text.index(bad)}")
    elif isinstance(value, (list, tuple)):
        if len(value) > LIST_MAX:
            raise _refused("too_many", f"must have at most {LIST_MAX} items, got {len(value)}")
        for item in value:
            check_bounded(item, multiline=multiline, signed=signed)
    return value


def cli_value(flag: str, value: Any, *, multiline: bool = False) -> Any:
    """A command's own flag (one no parameter model holds) under the same rules; BadInput naming the flag."""
    try:
        return check_bounded(value, multiline=multiline)
    except PydanticCustomError as exc:
        raise BadInput(f"{flag}: {exc.message()}", {"input": clip(repr(value))}) from None


def _strip_optional(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _bare(tp: Any) -> Any:
    """A list's item type without Optional or Annotated (`list[Annotated[int, Field(ge=1)]]` is a list of int)."""
    tp = _strip_optional(tp)
    return get_args(tp)[0] if get_origin(tp) is Annotated else tp


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
    MULTILINE: ClassVar[frozenset[str]] = frozenset()  # text fields that may hold newlines (a prompt)
    SIGNED: ClassVar[frozenset[str]] = frozenset()     # numeric fields that may be negative

    @field_validator("*", mode="before")
    @classmethod
    def _bounded(cls, value: Any, info: ValidationInfo) -> Any:
        """The rules every option keeps, whatever the model (the module's docstring); before the field's own
        checks, so that NaN is named as not finite rather than as out of a range."""
        name = info.field_name or ""
        return check_bounded(value, multiline=name in cls.MULTILINE, signed=name in cls.SIGNED)

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
            elif get_origin(tp) is list and _bare(get_args(tp)[0]) is int:
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
        return cls.from_cli_values({**values, **fixed})

    @classmethod
    def from_cli_values(cls, values: dict[str, Any], flags: dict[str, str] | None = None) -> "OpParams":
        """The model of values a command line gave (a command that spells its own flags names them in `flags`,
        field -> flag); a value the model refuses is a usage error: BadInput naming the flag."""
        try:
            return cls(**values)
        except ValidationError as exc:  # a value argparse let through but the model refuses: a usage error
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "?"
            flag = (flags or {}).get(name) or cls.CLI_FLAGS.get(name, "--" + name.replace("_", "-"))
            flag = flag if isinstance(flag, str) else flag[-1]
            if name in cls.CLI_POSITIONAL and name not in (flags or {}):
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


__all__ = ["LIST_MAX", "cli_value", "MULTILINE_MAX", "NAME_MAX", "NAME_RULE", "NUMBER_MAX", "TEXT_MAX", "Name", "OpParams", "Price",
           "Seconds", "Seed", "check_bounded"]
