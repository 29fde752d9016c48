"""How every `./vllm-t4` subcommand (and `python -m repack`) is declared and how its failures are written.

A command is one `Command`: its name, help, the parameter model its flags are derived from (the same model the
MCP tool's signature is derived from), and a handler that takes the validated model and the parsed namespace.
`add_commands` turns a module's list of them into argparse subcommands with `--json` and `--env-file` where the
command asks for them, and wraps the handler so that a ToolFailure becomes one line on stderr (and the error
object on stdout under --json), rendered for the command line: parameters as flags, operations as commands.
A command line that writes its failures otherwise (`python -m repack`: `error: reason`, status 2) passes its own
`failure`.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from tools.core.atomic_files import path_failure
from tools.core.errors import BadInput, Renderer, ToolFailure
from tools.core.params import OpParams
from tools.core.jsonout import dumps

# The module that declares each `./vllm-t4` command (its COMMANDS list): main() imports only the one its command
# line names (all of them cost a quarter of a second of every start, more than a `status` itself).
# tests/cli/test_cli.py keeps it equal to what the modules register.
MODULES: dict[str, str] = {
    **dict.fromkeys(("start", "stop", "status", "query", "log", "router", "swap"), "tools.cli.serve_cli"),
    **dict.fromkeys(("sweep", "sweep-compare", "compare", "decode", "decode-sweep", "decode-compare"),
                    "tools.cli.measure_cli"),
    "demo": "tools.demo.demo",
    "eval": "tools.cli.evals_cli",
    "eval-compare": "tools.cli.evals_cli",
    "fidelity": "tools.cli.fidelity_cli",
    "doctor": "tools.cli.doctor_cli",
    "fetch": "tools.cli.doctor_cli",
    **dict.fromkeys(("capacity", "capacity-compare", "pareto"), "tools.cli.measure_cli"),
}
# Every program whose commands are operations, and the module that declares them (a COMMANDS list).
PROGRAMS: dict[str, tuple[str, ...]] = {"./vllm-t4": tuple(dict.fromkeys(MODULES.values())),
                                        "python3 -m repack": ("tools.cli.repack_cli",)}
# Operations done by a program with no subcommands, outside the Command declarations: (its command line, the
# arguments written bare, in order).
SCRIPTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tiny_model": ("python3 -m repack.tiny_model", ("out",)),
    "patch_turing": ("./patch_triton_turing.py", ()),
    "vram": ("nvidia-smi", ()),
}


def flag(name: str, *value: Any) -> str:
    """A parameter as a flag: `--out`, `--force` for true, `--no-text-only` for false, `--port 8001`."""
    dashed = name.replace("_", "-")
    if not value:
        return f"--{dashed}"
    v = value[0]
    if v is True:
        return f"--{dashed}"
    if v is False:
        return f"--no-{dashed}"
    return f"--{dashed} {','.join(map(str, v)) if isinstance(v, list) else v}"


def command_line(name: str, args: dict[str, Any]) -> str:
    """An operation (tools.core.errors.op) as the command that does it: `./vllm-t4 stop`,
    `./vllm-t4 fetch REPO --out DIR`; an operation no command does keeps its name."""
    base, positional = operations().get(name, (name, ()))
    words = [base] + [str(args[key]) for key in positional if key in args]
    words += [flag(k, v) for k, v in args.items() if k not in positional]
    return "`" + " ".join(words) + "`"


CLI = Renderer(param=flag, op=command_line)


def fail(prog: str, exc: ToolFailure, as_json: bool) -> None:
    """Writes a failure as the command line does: the error object on stdout under --json, one line on stderr."""
    if as_json:
        print(dumps(exc.to_dict(CLI)))
    print(f"{prog}: {exc.render(CLI)}", file=sys.stderr)


def exit_status(exc: ToolFailure) -> int:
    """2 for input the caller must change, 1 for a failure of the work itself."""
    return 2 if isinstance(exc, BadInput) else 1


@dataclass
class Command:
    name: str
    help: str
    run: Callable[[Any, argparse.Namespace], int] | None = None  # (validated params or None, namespace) -> status
    params: type[OpParams] | None = None
    json: bool = True             # offers --json
    env_file: bool = False        # offers --env-file (serving commands read tpu.env)
    extra: Callable[[argparse.ArgumentParser], None] | None = None  # flags outside the model (e.g. --any)
    description: str | None = None
    children: list["Command"] = field(default_factory=list)  # `router start|status|stop`
    # The operation it does (tools.core.errors.op): by default its name with `_` for `-`, a child's prefixed with
    # its parent's and a dot (`router.start`).
    op: str | None = None
    positional: tuple[str, ...] | None = None  # arguments written bare; default: its parameter model's

    def op_name(self, parent: str | None = None) -> str:
        own = self.op or self.name.replace("-", "_")
        return own if parent is None or self.op else f"{parent}.{own}"

    def positional_args(self) -> tuple[str, ...]:
        if self.positional is not None:
            return self.positional
        return self.params.CLI_POSITIONAL if self.params is not None else ()


def spellings(commands: list[Command], prog: str, parent: str | None = None
              ) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Each command's operation name -> (its command line, its positional arguments), children included."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for cmd in commands:
        name = cmd.op_name(parent)
        out[name] = (f"{prog} {cmd.name}", cmd.positional_args())
        out.update(spellings(cmd.children, f"{prog} {cmd.name}", name))
    return out


@functools.cache
def operations() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every operation a command line does -> (how it is typed, its positional arguments): derived from the
    Command declarations of every program (PROGRAMS) and the scripts of their own (SCRIPTS). Imports every
    command module, which only a failure that names an operation needs."""
    out = dict(SCRIPTS)
    for prog, modules in PROGRAMS.items():
        for module in modules:
            out.update(spellings(importlib.import_module(module).COMMANDS, prog))
    return out


# How a command line writes a failure and which status it exits with: (prog, failure, --json given) -> status.
Failure = Callable[[str, ToolFailure, bool], int]


def vllm_t4_failure(prog: str, exc: ToolFailure, as_json: bool) -> int:
    """`PROG: reason` on stderr (the error object on stdout under --json); 2 for bad input, else 1."""
    fail(prog, exc, as_json)
    return exit_status(exc)


def _handler(prog: str, cmd: Command, failure: Failure) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            params = cmd.params.from_cli_args(args) if cmd.params is not None else None
            assert cmd.run is not None
            return int(cmd.run(params, args) or 0)
        except ToolFailure as exc:
            return failure(prog, exc, bool(getattr(args, "json", False)))
        except OSError as exc:  # on a path no call site foresaw (a name over 255 bytes): one line all the same
            if exc.filename is None:
                raise
            return failure(prog, path_failure(exc), bool(getattr(args, "json", False)))
    return run


def add_command(p: argparse.ArgumentParser, cmd: Command, prog: str, *, failure: Failure = vllm_t4_failure) -> None:
    """Makes `p` the command `cmd` (its children as subcommands): its flags, and `func` the handler that runs it
    and writes a ToolFailure with `failure` (a script that is one command declares it on its own parser)."""
    if cmd.children:
        add_commands(p.add_subparsers(dest="action", required=True, metavar="ACTION"), cmd.children, prog,
                     failure=failure)
        return
    if cmd.env_file:
        p.add_argument("--env-file", default=None, help="configuration file (default: the project's tpu.env)")
    if cmd.json:
        p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    if cmd.params is not None:
        cmd.params.add_cli_args(p)
    if cmd.extra is not None:
        cmd.extra(p)
    p.set_defaults(func=_handler(prog, cmd, failure))


def add_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", commands: list[Command],
                 prefix: str = "vllm-t4", *, failure: Failure = vllm_t4_failure) -> None:
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help)
        add_command(p, cmd, f"{prefix} {cmd.name}", failure=failure)


def emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    """Prints `obj` as one JSON object under --json, else the human-readable `text`."""
    if getattr(args, "json", False):
        print(dumps(obj.to_dict() if hasattr(obj, "to_dict") else obj))
    else:
        print(text)


__all__ = ["CLI", "MODULES", "PROGRAMS", "SCRIPTS", "Command", "Failure", "add_command", "add_commands", "command_line",
           "emit", "exit_status", "fail", "flag", "operations", "spellings", "vllm_t4_failure"]
