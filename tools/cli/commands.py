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
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from tools.core.errors import BadInput, Renderer, ToolFailure
from tools.core.params import OpParams
from tools.core.jsonout import dumps

# Operations as the command line spells them (tools.core.errors.op): the library names an operation by meaning.
OPERATIONS: dict[str, str] = {
    "start": "./vllm-t4 start",
    "stop": "./vllm-t4 stop",
    "status": "./vllm-t4 status",
    "log": "./vllm-t4 log",
    "query": "./vllm-t4 query",
    "swap": "./vllm-t4 swap",
    "router.start": "./vllm-t4 router start",
    "router.stop": "./vllm-t4 router stop",
    "router.status": "./vllm-t4 router status",
    "router.switch": "./vllm-t4 router switch",
    "probe": "python3 -m repack probe",
    "repack": "python3 -m repack build",
    "tiny_model": "python3 -m repack.tiny_model",
    "fetch": "./vllm-t4 fetch",
    "doctor": "./vllm-t4 doctor",
    "patch_turing": "./patch_triton_turing.py",
    "demo": "./vllm-t4 demo",
    "sweep": "./vllm-t4 sweep",
    "sweep_compare": "./vllm-t4 sweep-compare",
    "compare_tokens": "./vllm-t4 compare",
    "compare_tokens.record": "./vllm-t4 compare record",
    "decode": "./vllm-t4 decode",
    "decode_sweep": "./vllm-t4 decode-sweep",
    "decode_compare": "./vllm-t4 decode-compare",
    "eval": "./vllm-t4 eval",
    "eval_compare": "./vllm-t4 eval-compare",
    "fidelity.record": "./vllm-t4 fidelity record",
    "fidelity.check": "./vllm-t4 fidelity check",
    "vram": "nvidia-smi",
    "capacity": "./vllm-t4 capacity",
    "capacity_compare": "./vllm-t4 capacity-compare",
    "pareto": "./vllm-t4 pareto",
}
# Arguments that are positional on the command line (written bare, in this order).
POSITIONAL_ARGS: dict[str, tuple[str, ...]] = {
    "fetch": ("repo_id",), "probe": ("source",), "repack": ("source", "output"), "tiny_model": ("out",)}


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
    base = OPERATIONS.get(name, name)
    words = [base]
    for key in POSITIONAL_ARGS.get(name, ()):
        if key in args:
            words.append(str(args[key]))
    words += [flag(k, v) for k, v in args.items() if k not in POSITIONAL_ARGS.get(name, ())]
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


__all__ = ["CLI", "Command", "Failure", "OPERATIONS", "add_command", "add_commands", "emit", "exit_status", "fail",
           "flag", "vllm_t4_failure"]
