"""What every `./vllm-t4` subcommand shares: one JSON object or text on stdout, one-line failures."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from tools.errors import ToolFailure


def emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    """Prints `obj` as one JSON object under --json, else the human-readable `text`."""
    if getattr(args, "json", False):
        print(json.dumps(obj.to_dict() if hasattr(obj, "to_dict") else obj, default=str))
    else:
        print(text)


def guard(name: str, func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turns a ToolFailure into `vllm-t4 NAME: reason` on stderr (and the JSON error under --json), exit 1."""
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except ToolFailure as exc:
            if getattr(args, "json", False):
                print(json.dumps(exc.to_dict(), default=str))
            print(f"vllm-t4 {name}: {exc}", file=sys.stderr)
            return 1
    return run
