"""`./vllm-t4`: one command line over the tools library. Each capability module adds its own subcommands."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from tools.cli.commands import MODULES, PROGRAMS
from tools.core.process import stdout_gone

# A reader that stops reading (`./vllm-t4 status | head -1`) is not a failure of the command: stdout goes to
# /dev/null (so the interpreter's last flush cannot raise again) and the status is the shell's for SIGPIPE.
BROKEN_PIPE_STATUS = 128 + signal.SIGPIPE


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like Ctrl-C: every clean-up that Ctrl-C runs (the sweep's benchmark
    worker, a server being started or a decode-sweep's server, lm-eval) runs for SIGTERM too."""


_terminating = False


def _on_sigterm(signum: int, frame: object) -> None:
    global _terminating
    if _terminating:  # a second SIGTERM must not cut the clean-up short (SIG_IGN would pass to children)
        return
    _terminating = True
    raise Terminated


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
    for module in PROGRAMS["./vllm-t4"]:  # every registering module once, in the table's order
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
    except BrokenPipeError:  # --help into a closed pipe
        return _stdout_gone()
    global _terminating
    _terminating = False
    # main() may run in-process (tests, an embedding program): the caller's handler comes back on return. A
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
        print("vllm-t4: terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("vllm-t4: interrupted", file=sys.stderr)
        return 130
    finally:
        if previous is not None:  # None: a handler not set from Python, left as it is
            signal.signal(signal.SIGTERM, previous)


def _stdout_gone() -> int:
    stdout_gone()
    return BROKEN_PIPE_STATUS


if __name__ == "__main__":
    raise SystemExit(main())
