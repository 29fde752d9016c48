"""`./vllm-t4 doctor` and `./vllm-t4 fetch`: the deployment's preflight report and the checkpoint download.

doctor exits 0 when no check fails (warnings allowed), 1 when one fails, 2 for bad input; fetch 0 fetched, 1 the
fetch failed, 2 bad input. The report's remedies name operations, spelled here as commands.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tools.core.commands import CLI, Command, add_commands
from tools.core.errors import render, render_all
from tools.serving import MANIFEST, FetchParams, PreflightParams, fetch_checkpoint, run_preflight
from tools.core.jsonout import dumps


def doctor(params: PreflightParams, args: argparse.Namespace) -> int:
    report = run_preflight(params)
    if args.json:
        print(dumps(render_all(report.model_dump(mode="json"), CLI)))
    else:
        print(render(report.text(), CLI))
    return 0 if report.ready else 1


def fetch(params: FetchParams, args: argparse.Namespace) -> int:
    last = [0.0]

    def show(done: int, total: int, message: str) -> None:
        now = time.monotonic()
        if now - last[0] >= 2.0 or done >= total:
            last[0] = now
            print(f"  {done / 2**20:,.1f} / {total / 2**20:,.1f} MiB  {message}", file=sys.stderr, flush=True)

    result = fetch_checkpoint(params, progress=show)
    if args.json:
        print(result.model_dump_json())
    else:
        state = "already there" if result.already_present else ("from the cache" if result.offline else "fetched")
        print(f"{result.repo_id}@{result.commit[:12]} {state}: {result.out} ({len(result.files)} files, "
              f"{result.total_bytes / 2**30:.2f} GiB; manifest {MANIFEST})")
    return 0


COMMANDS = [
    Command("doctor", "check this machine and configuration for a deployment (preflight)", doctor, PreflightParams,
            description="Every check a deployment needs, each ok|warn|fail|n/a with the measured value and one line "
                        "on how to fix it. Exit status: 0 no check fails (warnings allowed), 1 a check fails, 2 bad "
                        "input."),
    Command("fetch", "download a checkpoint's build files from the Hugging Face hub into models/", fetch, FetchParams,
            description="Download only what a build reads, through huggingface_hub's cache, and publish the folder "
                        "atomically with fetch-manifest.json. Exit status: 0 fetched, 1 the fetch failed, 2 bad "
                        "input."),
]


def register(sub: Any) -> None:
    add_commands(sub, COMMANDS)
