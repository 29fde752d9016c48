"""`python -m repack.tiny_model OUT [--force] [--shape e2b|e4b|moe] ...`: the tiny stand-in source from the command
line. Its out, force and shape are repack.params.TinyModelParams, the model the MCP tool make_tiny_model's
signature derives from."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.core.errors import BadInput

from .params import TinyModelParams
from .stand_ins import tiny_marker, tiny_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m repack.tiny_model",
                                 description="Write a tiny Gemma-4-shaped QAT-like multimodal checkpoint.")
    TinyModelParams.add_cli_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--off-grid", action="store_true", help="skip the 4-bit projection (a base-model stand-in)")
    ap.add_argument("--drafter-of", metavar="TARGET", default=None,
                    help="write instead the tiny gemma4_assistant drafter for the tiny target in TARGET")
    ap.add_argument("--no-cache", action="store_true",
                    help=f"train even if the same model is cached (cache: ${tiny_model.CACHE_ENV}, default "
                         "~/.cache/gemma4-t4)")
    args = ap.parse_args(argv)
    try:
        p = TinyModelParams.from_cli_args(args)
    except BadInput as exc:
        print(f"python -m repack.tiny_model: {exc}", file=sys.stderr)
        return 2
    refused = tiny_marker.refusal(Path(p.out), p.force)
    if refused:
        print(f"python -m repack.tiny_model: {refused}", file=sys.stderr)
        return 2
    if args.drafter_of:
        d = tiny_model.build_tiny_drafter(p.out, args.drafter_of, seed=args.seed)
        print(f"{d.path}: drafter for {args.drafter_of}, first-draft accuracy on the pattern {d.accuracy:.3f}")
        return 0
    info = tiny_model.cached_tiny_qat_checkpoint(p.out, cache_dir=not args.no_cache, seed=args.seed,
                                      train_steps=args.train_steps, on_grid=not args.off_grid, shape=p.shape)
    print(f"{info.path}: {len(info.grid_tensors)} tensors on the 4-bit grid, pattern accuracy {info.accuracy:.3f}")
    return 0


__all__ = ["main"]


if __name__ == "__main__":
    raise SystemExit(main())
