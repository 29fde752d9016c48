"""`./vllm-t4 fidelity record | check`: logprob fidelity between builds, flags derived from the params models.

Failures are one line on stderr (and the JSON error under --json): exit 2 for bad input, 1 when the server fails.
"""

from __future__ import annotations

import argparse
import sys

from tools.core.jsonout import dumps
from tools.core.commands import Command, add_commands
from tools.measure.fidelity.run import (CheckLogprobsParams, CheckLogprobsResult, RecordLogprobsParams,
                                    RecordLogprobsResult, check_logprobs, record_logprobs)


def _progress(done: int, total: int, msg: str) -> None:
    print(f"[{done}/{total}] {msg}", file=sys.stderr, flush=True)


def _print(args: argparse.Namespace, res: RecordLogprobsResult | CheckLogprobsResult) -> int:
    print(dumps(res.to_dict()) if args.json else res.text())
    return 0


def cmd_record(params: RecordLogprobsParams, args: argparse.Namespace) -> int:
    return _print(args, record_logprobs(params, progress=_progress))


def cmd_check(params: CheckLogprobsParams, args: argparse.Namespace) -> int:
    return _print(args, check_logprobs(params, progress=_progress))


COMMANDS = [
    Command("fidelity", "logprob fidelity between builds: KLD, top-1 agreement, perplexity",
            description="Score a text corpus with prompt_logprobs on the reference build (record), then on another "
                        "build (check): mean/p99/max KLD, top-1 agreement, PPL ratio. Exit 2 on bad input, 1 when "
                        "the server fails.",
            children=[
                Command("record", "score the corpus on the serving build into REF.json",
                        params=RecordLogprobsParams, run=cmd_record),
                Command("check", "compare the serving build with REF.json", params=CheckLogprobsParams,
                        run=cmd_check),
            ]),
]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    add_commands(sub, COMMANDS)
