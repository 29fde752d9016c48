"""How every command line's subcommands (`./vllm-t4`, `python -m repack`, `python -m tools.demo`) are declared,
how each operation is typed (COMMAND_LINES) and how a command's failures are written: the vocabulary the front
ends share, below all of them.

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
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from tools.core.atomic_files import path_failure
from tools.core.errors import BadInput, Renderer, ToolFailure
from tools.core.params import OpParams
from tools.core.jsonout import dumps
from tools.core.process import stdout_gone

# How each operation (tools.core.errors.op) is typed: its command line and the arguments written bare, in order.
# The one declaration both front ends read: MCP spells an operation no tool does with it (tools.mcp.wording),
# and `add_commands` refuses a Command whose line is not the one declared here for its operation, so the command
# lines' subcommands and this table cannot drift apart. Operations done by a program with no subcommands are here
# too (`tiny_model`, `patch_turing`, `vram`).
COMMAND_LINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "tiny_model": ("python3 -m repack.tiny_model", ("out",)),
    "patch_turing": ("./patch_triton_turing.py", ()),
    "vram": ("nvidia-smi", ()),
    "start": ("./vllm-t4 start", ()),
    "stop": ("./vllm-t4 stop", ()),
    "status": ("./vllm-t4 status", ()),
    "query": ("./vllm-t4 query", ("prompt",)),
    "log": ("./vllm-t4 log", ()),
    "router": ("./vllm-t4 router", ()),
    "router.start": ("./vllm-t4 router start", ()),
    "router.switch": ("./vllm-t4 router switch", ()),
    "router.status": ("./vllm-t4 router status", ()),
    "router.stop": ("./vllm-t4 router stop", ()),
    "swap": ("./vllm-t4 swap", ()),
    "sweep": ("./vllm-t4 sweep", ()),
    "sweep_compare": ("./vllm-t4 sweep-compare", ()),
    "capacity": ("./vllm-t4 capacity", ()),
    "capacity_compare": ("./vllm-t4 capacity-compare", ()),
    "pareto": ("./vllm-t4 pareto", ()),
    "compare_tokens": ("./vllm-t4 compare", ()),
    "compare_tokens.record": ("./vllm-t4 compare record", ()),
    "compare_tokens.check": ("./vllm-t4 compare check", ()),
    "compare_tokens.live": ("./vllm-t4 compare live", ()),
    "decode": ("./vllm-t4 decode", ()),
    "decode_sweep": ("./vllm-t4 decode-sweep", ()),
    "decode_compare": ("./vllm-t4 decode-compare", ()),
    "demo": ("./vllm-t4 demo", ()),
    "eval": ("./vllm-t4 eval", ()),
    "eval_compare": ("./vllm-t4 eval-compare", ("runs",)),
    "fidelity": ("./vllm-t4 fidelity", ()),
    "fidelity.record": ("./vllm-t4 fidelity record", ()),
    "fidelity.check": ("./vllm-t4 fidelity check", ("reference",)),
    "doctor": ("./vllm-t4 doctor", ()),
    "fetch": ("./vllm-t4 fetch", ("repo_id",)),
    "repack": ("python3 -m repack build", ("source", "output")),
    "probe": ("python3 -m repack probe", ("path",)),
    "plan": ("python3 -m repack plan", ()),
}
# The programs whose subcommands the table declares: the name in their messages -> the program as typed.
PROGRAMS = {"vllm-t4": "./vllm-t4", "python3 -m repack": "python3 -m repack"}


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
    """An operation (tools.core.errors.op) as the command that does it (COMMAND_LINES): `./vllm-t4 stop`,
    `./vllm-t4 fetch REPO --out DIR`; an operation no command does keeps its name."""
    base, positional = COMMAND_LINES.get(name, (name, ()))
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
    p.set_defaults(func=_handler(prog, cmd, failure), _command_parser=p)


def parse_command_line(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser.parse_args(argv), but an argument no command takes is refused by the subcommand it was given to (its
    usage and `PROG COMMAND: error: unrecognized arguments: ...`, status 2), not by the program's top parser, whose
    line names no command and whose usage lists them all."""
    args, extra = parser.parse_known_args(argv)
    command_parser = vars(args).pop("_command_parser", parser)
    if extra:
        command_parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def check_declared(commands: list[Command], program: str) -> None:
    """Refuses commands of `program` (as typed) whose line or bare arguments are not COMMAND_LINES' for their
    operation: a declaration out of step with the table is the programmer's error, caught at the first start."""
    wrong = {op: spelled for op, spelled in spellings(commands, program).items() if COMMAND_LINES.get(op) != spelled}
    if wrong:
        raise LookupError(f"commands not as tools.core.commands.COMMAND_LINES types their operations: {wrong}")


def add_commands(sub: "argparse._SubParsersAction[argparse.ArgumentParser]", commands: list[Command],
                 prefix: str = "vllm-t4", *, failure: Failure = vllm_t4_failure) -> None:
    if prefix in PROGRAMS:
        check_declared(commands, PROGRAMS[prefix])
    for cmd in commands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help)
        add_command(p, cmd, f"{prefix} {cmd.name}", failure=failure)


def emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    """Prints `obj` as one JSON object under --json, else the human-readable `text`."""
    if getattr(args, "json", False):
        print(dumps(obj.to_dict() if hasattr(obj, "to_dict") else obj))
    else:
        print(text)


# A program run in another's place (`./vllm-t4 demo` becomes `python3 -m tools.demo`) is named in its lines as
# this environment variable says.
PROG_VARIABLE = "VLLM_T4_PROG"

# A reader that stops reading (`./vllm-t4 status | head -1`) is not a failure of the command: stdout goes to
# /dev/null (so the interpreter's last flush cannot raise again) and the status is the shell's for SIGPIPE.
BROKEN_PIPE_STATUS = 128 + signal.SIGPIPE


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C: every clean-up that Ctrl-C runs (the sweep's benchmark
    worker, a server being started or a decode-sweep's server, lm-eval, the demo's servers) runs for SIGTERM too."""


_terminating = False


def _on_sigterm(signum: int, frame: object) -> None:
    global _terminating
    if _terminating:  # a second SIGTERM must not cut the clean-up short (SIG_IGN would pass to children)
        return
    _terminating = True
    raise Terminated


def run_program(name: str, parse: Callable[[], argparse.Namespace]) -> int:
    """Runs a command line program: `parse()` gives the namespace whose `func` does the command; `name` is the
    program in the lines about signals (`vllm-t4: terminated`, status 143; `interrupted`, 130)."""
    try:
        args = parse()
    except BrokenPipeError:  # --help into a closed pipe
        return _stdout_gone()
    global _terminating
    _terminating = False
    # The program may run in-process (tests, an embedding program): the caller's handler comes back on return. A
    # SIGTERM the command was started with ignored stays ignored, as SIGINT does (Python then installs no
    # KeyboardInterrupt handler): the POSIX convention for signals a parent chose to ignore.
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_IGN:
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        status = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return status
    except BrokenPipeError:
        return _stdout_gone()
    except Terminated:
        print(f"{name}: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:  # None: a handler not set from Python, left as it is
            signal.signal(signal.SIGTERM, previous)


def _stdout_gone() -> int:
    stdout_gone()
    return BROKEN_PIPE_STATUS


__all__ = ["BROKEN_PIPE_STATUS", "PROG_VARIABLE", "Terminated", "run_program", "CLI", "COMMAND_LINES", "PROGRAMS", "Command", "Failure", "add_command", "add_commands", "check_declared",
           "command_line", "emit", "exit_status", "fail", "flag", "spellings", "vllm_t4_failure"]
