"""`python3 -m repack build|probe` and the shared argparse plumbing of the article's three scripts."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Callable

from .errors import RepackError

EXIT_BAD_INPUT = 2


def progress_bar(enabled: bool | None = None) -> tuple[Callable[[int, int, str], None] | None, Callable[[], None]]:
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


def add_scale_dtype(p: argparse.ArgumentParser) -> None:
    from .grid import DEFAULT_OBJECTIVE, OBJECTIVES, TARGETS

    p.add_argument("--target-dtype", choices=list(TARGETS), default=None,
                   help="the dtype the model is served in, whose arithmetic the scales are chosen for; the scales "
                        "are stored in it (default float16: the T4 computes fp16(level*scale))")
    p.add_argument("--objective", choices=list(OBJECTIVES), default=DEFAULT_OBJECTIVE,
                   help="runtime-exact: most values exact in the target's arithmetic, ties by squared error; "
                        f"min-error: least squared error (default {DEFAULT_OBJECTIVE})")
    p.add_argument("--scale-dtype", choices=["fp16", "bf16"], default=None,
                   help="older spelling of --target-dtype: fp16 = float16, bf16 = bfloat16")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")


def add_scheme(p: argparse.ArgumentParser) -> None:
    from . import schemes

    p.add_argument("--scheme", choices=schemes.names(), default=schemes.DEFAULT,
                   help="how the linear layers are quantized: " + "; ".join(
                       f"{n}: {schemes.get(n).summary}" for n in schemes.names()) +
                   f" (default {schemes.DEFAULT})")


def protected_folders() -> list[Path]:
    """What a command-line build may never replace or wrap: the working folder and the home folder (and, as for
    every build, the file system root)."""
    folders = [Path.cwd()]
    try:
        folders.append(Path.home())
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        pass
    return folders


def run_build(src: str, out: str, options_kwargs: dict, as_json: bool = False) -> int:
    """Runs a build and prints its report; every failure is one line on stderr and status 2; a signal exits
    128 + its number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP)."""
    from .atomic import signals_as_exceptions
    from .build import BuildOptions, build_checkpoint

    refused = _preflight(src, out)
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        return EXIT_BAD_INPUT
    update, close = progress_bar()
    try:
        with signals_as_exceptions():
            report = build_checkpoint(src, out, BuildOptions(**options_kwargs), progress=update,
                                      protected_roots=protected_folders(),
                                      notice=lambda line: print(f"repack: {line}", file=sys.stderr))
    except RepackError as e:
        close()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt as e:
        close()
        signum = getattr(e, "signum", signal.SIGINT)
        how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        if getattr(e, "written", None):
            print(f"error: {how} after {out} was written: it is complete (report in {out}/repack-report.json)",
                  file=sys.stderr)
        else:
            print(f"error: {how}; {out} was not written", file=sys.stderr)
        return 128 + signum
    close()
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.format_table())
    print(f"wrote {out} (report in {out}/repack-report.json)", file=sys.stderr)
    return 0


def _preflight(src: str, out: str) -> str | None:
    """The deployment preflight's repack checks (the source's config.json, free disk for what the build writes
    plus headroom): the first failing check's line, or None. Skipped where the tools package is not installed
    beside the library."""
    if not Path(src).is_dir():  # the library's own error says what is wrong with it (missing, a file, a loop)
        return None
    try:
        from tools.errors import ToolFailure
        from tools.serving.preflight import ensure
    except ImportError:
        return None
    try:
        ensure("repack", source=Path(os.path.abspath(src)), out=Path(os.path.abspath(out)))
    except ToolFailure as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m repack", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="SRC to the final build in one pass (no intermediate checkpoint)")
    b.add_argument("src", metavar="SRC")
    b.add_argument("out", metavar="OUT")
    b.add_argument("--text-only", action="store_true", help="drop the vision/audio towers; Gemma4ForCausalLM")
    b.add_argument("--embed-int4", action="store_true", help="pack the per-layer embedding table (PLE) as int4")
    b.add_argument("--embed-tokens", action="store_true",
                   help="with --embed-int4: also pack embed_tokens and write it again as an untied int4 lm_head")
    b.add_argument("--keep-linears", action="store_true", help="leave the linear layers bf16")
    b.add_argument("--max-shard-size", type=_positive_gib, default=2.0, metavar="GB", help="output shard size (GiB)")
    add_scheme(b)
    add_scale_dtype(b)
    p = sub.add_parser("probe", help="tell whether a checkpoint's tensors sit on the 4-bit grid")
    p.add_argument("src", metavar="SRC")
    p.add_argument("--rows", type=int, default=16, help="rows sampled per tensor (default 16)")
    p.add_argument("--verbose", action="store_true", help="list every tensor")
    p.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        if args.embed_tokens and not args.embed_int4:
            ap.error("--embed-tokens needs --embed-int4")
        return run_build(args.src, args.out, dict(
            quantize_linears=not args.keep_linears, text_only=args.text_only, embed_int4=args.embed_int4,
            embed_tokens=args.embed_tokens, scale_dtype=args.scale_dtype, target_dtype=args.target_dtype,
            objective=args.objective, force=args.force,
            max_shard_bytes=int(args.max_shard_size * (1 << 30)), scheme=args.scheme), args.json)
    from .atomic import check_no_symlink_loop, find_stale_partials
    from .probe import probe_checkpoint

    try:
        check_no_symlink_loop(args.src, "source folder")
        rep = probe_checkpoint(args.src, rows_per_tensor=max(1, args.rows))
    except RepackError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # read-only: leftovers of dead builds beside SRC are only reported; the next build there removes them
    stale = [lo.describe() for lo in find_stale_partials(Path(os.path.abspath(args.src)).parent)]
    if args.json:
        print(json.dumps({**rep.to_dict(), "stale_partials": stale}, indent=2))
    else:
        print(rep.format_table(args.verbose))
        for line in stale:
            print(f"stale partial build: {line}; the next build in that folder removes it")
    return 0


def _positive_gib(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0 or v * (1 << 30) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size in GiB (e.g. 2 or 0.5)")
    return v
