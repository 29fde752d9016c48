"""`./vllm-t4`: one command line over the tools library. Each capability module adds its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from tools.core.commands import BROKEN_PIPE_STATUS, PROG_VARIABLE, parse_command_line, run_program
from tools.core.root import PROJECT_ROOT

# The module that declares each `./vllm-t4` command (its COMMANDS list): main() imports only the one its command
# line names (all of them cost a quarter of a second of every start, more than a `status` itself). Its keys are
# COMMAND_LINES' `./vllm-t4` commands, and each module registers exactly its own (tests/cli/test_cli.py): a
# string the import check cannot see, held so by the test, naming only this package's modules.
MODULES: dict[str, str] = {
    **dict.fromkeys(("start", "stop", "status", "query", "log", "router", "swap"), "tools.cli.serve_cli"),
    **dict.fromkeys(("sweep", "sweep-compare", "compare", "decode", "decode-sweep", "decode-compare"),
                    "tools.cli.measure_cli"),
    "demo": "tools.cli",  # register() below
    "eval": "tools.cli.evals_cli",
    "eval-compare": "tools.cli.evals_cli",
    "fidelity": "tools.cli.fidelity_cli",
    "doctor": "tools.cli.doctor_cli",
    "fetch": "tools.cli.doctor_cli",
    **dict.fromkeys(("capacity", "capacity-compare", "pareto"), "tools.cli.measure_cli"),
}
# `./vllm-t4 demo ARGS` is the demo's own front end, `python3 -m tools.demo ARGS`, run in this process's place
# (its arguments, help, failures and exit status), named `vllm-t4 demo` in its lines (PROG_VARIABLE).
DEMO = "demo"
DEMO_HELP = "run the whole pipeline here (tiny model on a CPU, the real one on a T4)"

__all__ = ["BROKEN_PIPE_STATUS", "DEMO", "MODULES", "build_parser", "main", "register", "run_demo"]


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command, or only the module that registers `command` (MODULES) when it
    names one."""
    parser = argparse.ArgumentParser(
        prog="vllm-t4",
        description="Serve and measure all-4-bit Gemma 4 builds with vLLM (Tesla T4, or vLLM's CPU backend).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in MODULES:
        importlib.import_module(MODULES[command]).register(sub)
        return parser
    for module in dict.fromkeys(MODULES.values()):  # every registering module once, in the table's order
        importlib.import_module(module).register(sub)
    return parser


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`./vllm-t4 demo`, listed; main() hands its arguments to the demo (run_demo), which parses them."""
    sub.add_parser(DEMO, help=DEMO_HELP, add_help=False)


def run_demo(argv: list[str]) -> int:
    """`./vllm-t4 demo ARGV`: this process becomes `python3 -m tools.demo ARGV`."""
    sys.stdout.flush()
    sys.stderr.flush()
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=str(PROJECT_ROOT) + (os.pathsep + path if path else ""),
               **{PROG_VARIABLE: "vllm-t4 " + DEMO})
    os.execve(sys.executable, [sys.executable, "-m", "tools.demo", *argv], env)


def _env_file_first(argv: list[str]) -> list[str]:
    """`--env-file FILE COMMAND ...` as `COMMAND --env-file FILE ...`: the option each command takes, given before
    the command (where argparse would read FILE as the command's name)."""
    if argv[:1] == ["--env-file"] and len(argv) >= 3:
        return [argv[2], *argv[:2], *argv[3:]]
    if argv and argv[0].startswith("--env-file=") and len(argv) >= 2:
        return [argv[1], argv[0], *argv[2:]]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = _env_file_first(sys.argv[1:] if argv is None else list(argv))
    if argv[:1] == [DEMO]:
        return run_demo(argv[1:])
    return run_program("vllm-t4", lambda: parse_command_line(build_parser(argv[0] if argv else None), argv))


if __name__ == "__main__":
    raise SystemExit(main())
