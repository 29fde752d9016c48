"""`python3 -m repack build|probe` and the shared plumbing of the article's three scripts (repack/repack_q4_0.py,
text_only.py, embed_int4.py), each a Command: every failure is `error: reason` on stderr and status 2; a signal
exits 128 + its number."""

from __future__ import annotations

import argparse
import os
import signal
import stat
import sys
from pathlib import Path
from typing import Callable

from repack.build.build import build_checkpoint
from repack.source.checks import check_disk, check_source, protected_folders
from repack.errors import RepackError
from repack.build.fit import PlanParams, plan_fit
from repack.params import BuildOptions, BuildParams, ProbeParams
from repack.build.probe import probe_checkpoint
from tools.core.commands import CLI, Command, add_command, add_commands, parse_command_line
from tools.core.atomic import resolve_output, signals_as_exceptions
from tools.core.atomic_leftovers import find_stale_partials
from tools.core.errors import ToolFailure
from tools.core.paths import check_no_symlink_loop
from tools.core.progress import Progress
from tools.core.jsonout import dumps

EXIT_BAD_INPUT = 2


def progress_bar(enabled: bool | None = None) -> tuple[Progress | None, Callable[[], None]]:
    """A tqdm progress callback when stderr is a terminal (else none), and a function that closes it."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None, lambda: None
    try:
        from tqdm import tqdm
    except ImportError:
        return None, lambda: None
    bar = None

    def update(done: int, total: int, message: str) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="repack", leave=False)
        bar.n = done
        bar.set_postfix_str(message[-60:], refresh=False)
        bar.refresh()

    def close() -> None:
        if bar is not None:
            bar.close()

    return update, close


# The flags each of the article's step scripts takes; the rest of BuildParams is fixed by the step.
STEP_FLAGS = frozenset({"source", "output", "target_dtype", "objective", "scale_dtype", "force"})


def build_flags(p: argparse.ArgumentParser, *, only: frozenset[str] | None = None) -> None:
    """BuildParams' flags (only those named in `only`, if given)."""
    skip = frozenset() if only is None else frozenset(BuildParams.model_fields) - only
    BuildParams.add_cli_args(p, exclude=skip)
    if only is None or "quantize_linears" in only:  # the older spelling of --no-quantize-linears
        p.add_argument("--keep-linears", dest="quantize_linears", action="store_false",
                       help="leave the linear layers bf16 (same as --no-quantize-linears)")


def build_command(name: str, summary: str, *, only: frozenset[str] | None = None, op: str | None = None,
                  **fixed) -> Command:
    """A build as a Command: BuildParams' flags (those in `only`), the rest of the options `fixed` by the step;
    `op`: the operation it does, where that is not its name."""
    def run(_: None, args: argparse.Namespace) -> int:
        params = BuildParams.from_cli_args(args, **fixed)
        return run_build(params.source, params.output, params.options(), args.json)

    return Command(name, summary, run=run, extra=lambda p: build_flags(p, only=only), op=op,
                   positional=BuildParams.CLI_POSITIONAL)


def failed(prog: str, e: ToolFailure, as_json: bool) -> int:
    """A failure as this command line prints it: one line, parameters as flags, operations as commands; the
    status is 2 whatever its kind (the caller changes something and runs it again)."""
    print(f"error: {e.render(CLI)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def step_main(argv: list[str] | None, prog: str, doc: str | None, cmd: Command, *, subcommand: bool = False
              ) -> int:
    """The main() of a step script that is one command: the script itself, or (subcommand) its one subcommand
    (`repack_q4_0.py repack SRC OUT`, as the article writes it)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if subcommand:
        add_commands(ap.add_subparsers(dest="cmd", required=True), [cmd], prog, failure=failed)
    else:
        add_command(ap, cmd, prog, failure=failed)
    args = parse_command_line(ap, argv)
    return args.func(args)


def run_build(src: str, out: str, options: BuildOptions, as_json: bool = False) -> int:
    """Runs a build and prints its report; a failure raises (the command writes it); a signal exits 128 + its
    number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    _preflight(src, out)
    update, close = progress_bar()
    try:
        try:
            with signals_as_exceptions():
                report = build_checkpoint(src, out, options, progress=update,
                                          protected_roots=protected_folders(),
                                          notice=lambda line: print(f"repack: {line}", file=sys.stderr))
        finally:
            close()  # before any line about the failure
    except KeyboardInterrupt as e:
        return _stopped(e, str(resolve_output(out)))
    print(dumps(report.to_dict(), indent=2) if as_json else report.format_table())
    print(f"wrote {report.output} (report in {report.output}/repack-report.json)", file=sys.stderr)
    return 0


def _stopped(e: KeyboardInterrupt, out: str | None = None) -> int:
    """Prints the line for a command stopped by a signal (out: the build's output, None for the probe, which
    writes nothing) and returns its status, 128 + the signal number."""
    signum = getattr(e, "signum", signal.SIGINT)
    how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    if out is None:
        print(f"error: {how}", file=sys.stderr)
    elif getattr(e, "written", None):
        print(f"error: {how} after {out} was written: it is complete (report in {out}/repack-report.json)",
              file=sys.stderr)
    else:
        print(f"error: {how}; {out} was not written", file=sys.stderr)
    return 128 + signum


def _preflight(src: str, out: str) -> None:
    """The repack's own checks before the build (repack.source.checks: the source's config.json, free disk for what the
    build writes plus headroom); raises the first failing one, named by its check as the deployment preflight
    names it (`source: ...`, `disk: ...`)."""
    try:
        is_dir = stat.S_ISDIR(os.stat(src).st_mode)
    except (OSError, ValueError):
        is_dir = False
    if not is_dir:  # the library's own error says what is wrong with it (missing, a file, a loop, a long name)
        return
    source = Path(os.path.abspath(src))
    for name, check in (("source", lambda: check_source(source)), ("disk", lambda: check_disk(source, out))):
        try:
            check()
        except RepackError as e:
            raise RepackError(f"{name}: {e.message}", e.detail, field=e.field) from None


def cmd_probe(params: ProbeParams, args: argparse.Namespace) -> int:
    try:
        with signals_as_exceptions():
            check_no_symlink_loop(params.path, "source folder")
            rep = probe_checkpoint(params.path, rows_per_tensor=params.rows)
    except KeyboardInterrupt as e:
        return _stopped(e)
    # read-only: leftovers of dead builds beside SRC are only reported; the next build there removes them
    stale = [lo.describe() for lo in find_stale_partials(Path(os.path.abspath(params.path)).parent,
                                                         keep=[params.path])]
    if args.json:
        print(dumps({**rep.to_dict(), "stale_partials": stale}, indent=2))
    else:
        print(rep.format_table(args.verbose))
        for line in stale:
            print(f"stale partial build: {line}; the next build in that folder removes it")
    return 0


def cmd_plan(_: None, args: argparse.Namespace) -> int:
    plan = plan_fit(PlanParams.from_cli_args(args, path=args.path))
    print(dumps(plan.to_dict(), indent=2) if args.json else plan.format_table())
    return 0


def _plan_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", default=None, help=PlanParams.model_fields["path"].description)
    PlanParams.add_cli_args(p)


def _verbose_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="list every tensor")


COMMANDS = [
    build_command("build", "SRC to the final build in one pass (no intermediate checkpoint)", op="repack"),
    Command("probe", "tell whether a checkpoint's tensors sit on the 4-bit grid", params=ProbeParams,
            extra=_verbose_flag, run=cmd_probe),
    Command("plan", "which Gemma 4 member fits one T4: each build's tables, load and KV cache tokens (no download)",
            run=cmd_plan, extra=_plan_flags),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m repack", description=__doc__)
    add_commands(ap.add_subparsers(dest="cmd", required=True), COMMANDS, "python3 -m repack", failure=failed)
    args = parse_command_line(ap, argv)
    return args.func(args)
