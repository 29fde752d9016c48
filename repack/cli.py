"""`python3 -m repack build|probe` and the shared argparse plumbing of the article's three scripts."""

from __future__ import annotations

import argparse
import json
import sys
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


def run_build(src: str, out: str, options_kwargs: dict, as_json: bool = False) -> int:
    """Runs a build and prints its report; every failure is one line on stderr and status 2 (130 if stopped)."""
    from .build import BuildOptions, build_checkpoint

    update, close = progress_bar()
    try:
        report = build_checkpoint(src, out, BuildOptions(**options_kwargs), progress=update)
    except RepackError as e:
        close()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        close()
        print(f"error: interrupted; {out} was not written", file=sys.stderr)
        return 130
    close()
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.format_table())
    print(f"wrote {out} (report in {out}/repack-report.json)", file=sys.stderr)
    return 0


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
    b.add_argument("--max-shard-size", type=float, default=2.0, metavar="GB", help="output shard size (GiB)")
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
            max_shard_bytes=int(args.max_shard_size * (1 << 30))), args.json)
    from .probe import probe_checkpoint

    try:
        rep = probe_checkpoint(args.src, rows_per_tensor=max(1, args.rows))
    except RepackError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(rep.to_dict(), indent=2) if args.json else rep.format_table(args.verbose))
    return 0
