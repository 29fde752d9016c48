"""`./vllm-t4 eval | eval-compare`: lm-evaluation-harness accuracy against a live server, and runs side by side.

`eval` prints lm-eval's progress on stderr, then the summary table, the wall time and the evidence folder last;
`eval-compare` prints the side-by-side table. `--json` prints one JSON object instead. Every failure is one line
on stderr and exit 2: bad input and a run that could not be made are both the caller's to change and rerun.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from tools.core.commands import Command, add_commands, fail
from tools.core.errors import ToolFailure
from tools.measure.evals.results import EvalCompareParams, EvalParams, summary_markdown
from tools.measure.evals.compare import compare_evals
from tools.measure.evals.run import run_eval
from tools.core.jsonout import dumps


def _progress_printer(done: int, total: int, msg: str) -> None:
    print(f"[{done}/{total}] {msg}" if total else f"... {msg}", file=sys.stderr, flush=True)


def _exit_2(name: str, func: Callable[[Any, argparse.Namespace], int]) -> Callable[[Any, argparse.Namespace], int]:
    """A run that fails: `vllm-t4 NAME: reason` on stderr (the JSON error under --json), exit 2 whatever its kind
    (flags the model refuses are BadInput, exit 2, before the run)."""
    def run(params, args: argparse.Namespace) -> int:
        try:
            return func(params, args)
        except ToolFailure as exc:
            fail(f"vllm-t4 {name}", exc, bool(getattr(args, "json", False)))
            return 2
    return run


def cmd_eval(params: EvalParams, args: argparse.Namespace) -> int:
    res = run_eval(params, progress=_progress_printer)
    if args.json:
        print(dumps(res.to_dict()))
    else:
        print(summary_markdown(res) + f"\n{res.wall_s:.0f} s\n{res.run_dir}")
    return 0


def cmd_eval_compare(params: EvalCompareParams, args: argparse.Namespace) -> int:
    cmp = compare_evals(params)
    print(dumps(cmp.to_dict()) if args.json else cmp.markdown)
    return 0


COMMANDS = [
    Command("eval", "accuracy with lm-evaluation-harness against the server; prints the evidence folder last",
            description="lm-eval's local-completions model against a live server, greedy; writes <out>/<run-id>/ "
                        "(lm-eval's results and samples, summary.json/.md, provenance.json). Exit 2 with one line "
                        "when it cannot run.",
            params=EvalParams, run=_exit_2("eval", cmd_eval)),
    Command("eval-compare", "eval runs side by side, paired differences with stderr",
            description="Per task and metric: each run's value ± stderr, and each later run minus the first, "
                        "paired over the documents both scored, with its stderr and whether it is within noise "
                        "(|diff| < 2 stderr).",
            params=EvalCompareParams, run=_exit_2("eval-compare", cmd_eval_compare)),
]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    add_commands(sub, COMMANDS)
