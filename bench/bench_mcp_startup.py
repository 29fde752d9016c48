#!/usr/bin/env python3
"""Start-up time of the MCP server over stdio: process launch -> `tools/list` answered.

Measured side by side, in one run, with a hello-world FastMCP server (the floor any FastMCP server pays), each
launched the way MCP clients launch them (`python server.py`, stdio), alternating so both see the same machine
load. Prints a markdown table and, with --record, appends it to evidence/mcp-startup.md.

    .venv/bin/python bench/bench_mcp_startup.py --runs 15 --record
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.core import clock  # noqa: E402

HELLO = '''
from fastmcp import FastMCP

mcp = FastMCP("hello")


@mcp.tool
def hello(name: str) -> str:
    return f"hello {name}"


if __name__ == "__main__":
    mcp.run("stdio", show_banner=False)
'''


async def launch_to_list(script: Path) -> tuple[float, int]:
    from fastmcp import Client
    from fastmcp.client.transports import StdioTransport

    transport = StdioTransport(command=sys.executable, args=[str(script)], cwd=str(ROOT), keep_alive=False)
    t0 = time.perf_counter()
    async with Client(transport) as client:
        tools = await client.list_tools()
        elapsed = time.perf_counter() - t0
    return elapsed, len(tools)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15, help="launches of each server (default 15)")
    ap.add_argument("--record", action="store_true", help="append the result to evidence/mcp-startup.md")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        hello = Path(tmp) / "hello_server.py"
        hello.write_text(HELLO)
        servers = {"hello-world FastMCP": hello, "gemma4-t4 server.py": ROOT / "server.py"}
        times: dict[str, list[float]] = {k: [] for k in servers}
        counts: dict[str, int] = {}
        for name, script in servers.items():  # warm the OS file cache once, unmeasured
            asyncio.run(launch_to_list(script))
        for i in range(args.runs):
            for name, script in servers.items():
                elapsed, n = asyncio.run(launch_to_list(script))
                times[name].append(elapsed)
                counts[name] = n
            print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items()),
                  file=sys.stderr, flush=True)

    floor = statistics.median(times["hello-world FastMCP"])
    lines = [
        f"### {clock.minute()}, {platform.node()}, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "",
        f"Command: `.venv/bin/python bench/bench_mcp_startup.py --runs {args.runs}` "
        "(launch over stdio -> `tools/list` answered, through fastmcp's Client; servers alternate)",
        "",
        "| Server | Tools | Median s | Min s | Max s | vs hello-world |",
        "|---|---|---|---|---|---|",
    ]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {counts[name]} | {med:.3f} | {min(ts):.3f} | {max(ts):.3f} | "
                     f"{med - floor:+.3f} s |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.record:
        out = ROOT / "evidence" / "mcp-startup.md"
        if not out.exists():
            out.write_text("# MCP server start-up: launch -> tools/list\n\n"
                           "The server imports neither vllm nor torch; library modules load inside the tools that "
                           "need them. The floor is a hello-world FastMCP server measured in the same run.\n\n")
        with out.open("a") as fh:
            fh.write(table + "\n")
        print(f"recorded in {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
