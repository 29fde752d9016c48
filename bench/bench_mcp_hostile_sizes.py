#!/usr/bin/env python3
"""The answers issue 45's attacker found over 4,000 characters, measured as a client receives them, in-process
(no vLLM): stop_vllm_server(all=true) over 40 damaged instance records, the evidence index with 300 runs read to
its end, and the server log read from its 100,000th last line (a 70,000-character log).

    .venv/bin/python bench/bench_mcp_hostile_sizes.py [--out evidence/mcp-hostile-sizes.md]

Run with PYTHONPATH at a checkout to measure that checkout (the figures before a change: its parent's tree). The
index and the log are followed page by page where the checkout pages them (`next`, the first line's URI), else
read whole (evidence/runs/all, server/log/100000): the figure is the largest single answer and how many were read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from fastmcp import Client

from tools.core import clock
from tools.core.paths import Roots
from tools.mcp.app import Settings, create_server
from tools.mcp.resources import RESOURCES, SCHEME


def _answer_size(r) -> int:
    """Characters a client receives: the text content and the structured content, the larger of the two ways."""
    text = sum(len(t.text) for t in r.content)
    structured = len(json.dumps(r.structured_content, separators=(",", ":"))) if r.structured_content else 0
    return max(text, structured)


async def _walk(c: Client, first: str, whole: str | None) -> tuple[int, int, int]:
    """(largest answer, answers read, items read) following `next`; or the whole resource where there is one."""
    if whole is not None:
        text = (await c.read_resource(whole))[0].text
        items = len(json.loads(text)["runs"]) if text.startswith("{") else text.count("\n") + 1
        return len(text), 1, items
    uri, sizes, items = first, [], 0
    while uri and len(sizes) < 10_000:
        text = (await c.read_resource(uri))[0].text
        sizes.append(len(text))
        if text.startswith("{"):
            data = json.loads(text)
            items += len(data["runs"])
            uri = data.get("next")
        else:
            head, _, body = text.partition("\n")
            items += len([ln for ln in body.split("\n") if ln])
            m = re.search(rf"{SCHEME}://server/log/\d+", head)
            uri = m.group(0) if m else None
    return max(sizes), len(sizes), items


def measure(tmp: Path) -> list[tuple[str, int, int, int]]:
    state, models, ev = tmp / "run", tmp / "models", tmp / "evidence"
    models.mkdir()
    for i in range(40):
        d = state / f"instance-{i:02d}-with-a-longer-name"
        d.mkdir(parents=True)
        (d / "vllm.json").write_text('{"pid": "abc", "port": ')
    for i in range(300):
        run = ev / "sweeps" / f"2026-12-07-run-{i:03d}-tiny-bf16-emb"
        run.mkdir(parents=True)
        (run / "summary.json").write_text("{}")
        (run / "summary.md").write_text("# run\n")
    roots = Roots.from_env([str(models)], [str(ev)], environ={})
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(state)}))
    log = mcp.gemma.config().log_file
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"INFO 12-07 02:00:{i % 60:02d} [engine.py:{i}] line {i} " + "x" * 180 + "\n"
                           for i in range(300)))
    pages = f"{SCHEME}://evidence/runs/page/{{page}}" in RESOURCES

    async def go():
        async with Client(mcp) as c:
            stop = await c.call_tool("stop_vllm_server", {"all": True}, raise_on_error=False)
            runs = await _walk(c, f"{SCHEME}://evidence/runs", None if pages else f"{SCHEME}://evidence/runs/all")
            lines = await _walk(c, f"{SCHEME}://server/log/100000",
                                None if pages else f"{SCHEME}://server/log/100000")
            return [("stop_vllm_server(all=true), 40 damaged records", _answer_size(stop), 1, 40),
                    ("evidence index, 300 runs, to its end", *runs),
                    (f"server/log/100000, a {log.stat().st_size:,}-character log", *lines)]

    return asyncio.run(go())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None, help="markdown to write (default: print only)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = measure(Path(d))
    import tools

    tree = Path(tools.__file__).resolve().parents[1]  # the checkout measured (PYTHONPATH), not this file's
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=tree).stdout.strip()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    lines = [f"Measured {clock.minute()} at {commit} ({tree}) on {cpu}, "
             f"`{' '.join(sys.argv)}`:", "",
             "| Answer | Largest answer (characters) | Answers read | Items read |", "|---|---|---|---|"]
    lines += [f"| {name} | {size:,} | {n} | {items:,} |" for name, size, n, items in rows]
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
