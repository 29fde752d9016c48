"""Every option of every operation, through both front ends' checks: each parameter model (tools.core.params.OpParams
and its subclasses, found by importing every module of tools/ and repack/) gets, field by field, the values that
reached code paths without bounds before: NaN, infinities, negatives and 1e308 for a number; an empty string, a
newline and 100,000 characters for a string. Each must be refused by the command line's parser (argparse, or the
model behind it: a BadInput naming the flag, exit 2) and by the MCP arguments' validation (`from_mcp_args`), with
the field named. The baseline of each model (its required fields filled with plain values) must pass both, so that
a refusal is the fed value's and not the filler's."""

from __future__ import annotations

import argparse
import importlib
import math
import pkgutil
import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import pytest
from pydantic import ValidationError

import repack
import tools
from tools.core.errors import BadInput, ToolFailure
from tools.core.params import MULTILINE_MAX, OpParams

SKIP_MODULES = ("__main__",)


def _all_models() -> list[type[OpParams]]:
    for pkg in (tools, repack):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not m.name.endswith(SKIP_MODULES):
                importlib.import_module(m.name)
    seen: list[type[OpParams]] = []

    def walk(c: type) -> None:
        for s in c.__subclasses__():
            if s not in seen and s.__module__.startswith(("tools.", "repack.")):
                seen.append(s)
            walk(s)

    walk(OpParams)
    return seen


MODELS = _all_models()


def _bare(tp: Any) -> Any:
    while True:
        if get_origin(tp) in (Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        elif get_origin(tp) is Annotated:
            tp = get_args(tp)[0]
        else:
            return tp


def _kind(tp: Any) -> tuple[str, bool] | None:
    """('int' | 'float' | 'str', is a list) of a field, or None for the rest (bool, Literal, dict)."""
    tp = _bare(tp)
    listed = get_origin(tp) is list
    if listed:
        tp = _bare(get_args(tp)[0])
    if tp is bool or get_origin(tp) is Literal:
        return None
    if tp in (int, float):
        return tp.__name__, listed
    if tp is str or (isinstance(tp, type) and issubclass(tp, Path)):
        return "str", listed
    return None


# plain values for the required fields, so that only the fed value can be refused
FILLERS: dict[str, Any] = {"repo_id": "org/name", "tasks": ["arc_easy"], "out": "o", "reference": "r.json",
                           "runs": ["a", "b"], "run_dirs": ["a", "b"], "source": "s", "output": "o", "path": "p",
                           "prompt": "hi", "instances": ["a"], "job_id": "j1", "tool": "run_sweep", "arguments": {},
                           "mode": "record", "instance": "b", "model": "m", "toolset": "capacity"}
# what a model needs beyond its required fields to be a valid baseline (one of two optional fields)
BASELINES: dict[str, dict[str, Any]] = {"PlanParams": {"member": "E2B"}}


def _required(model: type[OpParams]) -> dict[str, Any]:
    return {**{n: FILLERS[n] for n, f in model.model_fields.items() if f.is_required()},
            **BASELINES.get(model.__name__, {})}


def _flag(model: type[OpParams], name: str) -> str | None:
    if name in model.CLI_POSITIONAL:
        return None
    given = model.CLI_FLAGS.get(name, "--" + name.replace("_", "-"))
    return given if isinstance(given, str) else given[-1]


def _tokens(model: type[OpParams], name: str, value: Any) -> list[str]:
    """How the command line spells `name` given `value` (a list as the field's flag takes it)."""
    flag = _flag(model, name)
    if isinstance(value, list):
        kind = _kind(model.model_fields[name].annotation)
        if (kind and kind[0] == "int") or name in model.CLI_COMMA:
            vals = [",".join(map(str, value))]
        else:
            vals = [str(v) for v in value]
    else:
        vals = [str(value)]
    return vals if flag is None else [flag, *vals]


def _cli(model: type[OpParams], name: str | None = None, value: Any = None) -> OpParams:
    parser = argparse.ArgumentParser(exit_on_error=False)
    model.add_cli_args(parser)
    argv: list[str] = []
    fixed = {}  # what the command itself sets (CLI_EXCLUDE)
    for n, v in _required(model).items():
        if n in model.CLI_EXCLUDE:
            fixed[n] = v
        else:
            argv += _tokens(model, n, value if n == name else v)
    if name is not None and name not in _required(model):
        argv += _tokens(model, name, value)
    args = parser.parse_args(argv)
    return model.from_cli_args(args, **fixed)


def _mcp(model: type[OpParams], name: str | None = None, value: Any = None) -> OpParams:
    return model.from_mcp_args({**_required(model), **({} if name is None else {name: value})})


def _cases() -> list[tuple[type[OpParams], str, str, bool]]:
    out = []
    for m in MODELS:
        for name, f in m.model_fields.items():
            kind = _kind(f.annotation)
            if kind is not None:
                out.append((m, name, *kind))
    return out


CASES = _cases()
IDS = [f"{m.__name__}.{n}" for m, n, _, _ in CASES]
NUMBERS = [math.nan, math.inf, -math.inf, -5, 1e308]


def _refused_cli(model: type[OpParams], name: str, value: Any) -> None:
    """argparse refuses it (a usage error: exit 2), or the model does with a BadInput naming the flag."""
    try:
        _cli(model, name, value)
    except (argparse.ArgumentError, SystemExit):
        return
    except BadInput as exc:
        flag = _flag(model, name) or name
        assert flag in str(exc) or exc.field == name, exc
        return
    pytest.fail(f"{model.__name__}.{name}: the command line took {str(value)[:40]!r}")


def _refused_mcp(model: type[OpParams], name: str, value: Any) -> None:
    try:
        _mcp(model, name, value)
    except ValidationError as exc:
        assert exc.errors()[0]["loc"][:1] == (name,), exc
        return
    except ToolFailure as exc:
        assert exc.field == name or name in str(exc), exc
        return
    pytest.fail(f"{model.__name__}.{name}: MCP took {str(value)[:40]!r}")


def test_every_operation_has_a_parameter_model_here():
    names = {m.__name__ for m in MODELS}
    assert {"SweepParams", "CapacityParams", "DecodeParams", "StartParams", "TokenCompareParams", "BuildParams",
            "RecordLogprobsParams", "EvalParams", "TinyParams", "JobStatusParams"} <= names


@pytest.mark.parametrize("model", MODELS, ids=[m.__name__ for m in MODELS])
def test_each_models_baseline_passes_both_front_ends(model):
    _cli(model)
    _mcp(model)


@pytest.mark.parametrize("model, name, kind, listed", [c for c in CASES if c[2] != "str"],
                         ids=[i for i, c in zip(IDS, CASES) if c[2] != "str"])
def test_a_number_that_is_not_finite_negative_or_huge_is_refused_by_both_front_ends(model, name, kind, listed):
    for v in NUMBERS:
        value = [v] if listed else v
        if name not in model.CLI_EXCLUDE:
            _refused_cli(model, name, [str(v)] if listed else str(v))
        if name not in model.MCP_EXCLUDE:
            _refused_mcp(model, name, value)


@pytest.mark.parametrize("model, name, kind, listed", [c for c in CASES if c[2] == "str"],
                         ids=[i for i, c in zip(IDS, CASES) if c[2] == "str"])
def test_a_string_that_is_empty_unbounded_or_not_one_line_is_refused_by_both_front_ends(model, name, kind, listed):
    multiline = name in model.MULTILINE
    bad = ["", "x" * (MULTILINE_MAX + 1 if multiline else 100_000), "a\x00b"]
    if not multiline:
        bad.append("first line\nsecond line")
    for v in bad:
        value = [v] if listed else v
        if name not in model.CLI_EXCLUDE:
            _refused_cli(model, name, value)
        if name not in model.MCP_EXCLUDE:
            _refused_mcp(model, name, value)
