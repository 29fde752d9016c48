"""The README's MCP tool table, rendered from the tool registry: `python -m tools.mcp.readme` rewrites it
(between the `tools:start` / `tools:end` markers); a test keeps the two equal."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tools.mcp.registry import DEFAULT_TOOLSETS, TOOLSETS, ToolSpec, load_all

README = Path(__file__).resolve().parents[2] / "README.md"
START, END = "<!-- tools:start (python -m tools.mcp.readme) -->", "<!-- tools:end -->"


def _hints(s: ToolSpec) -> str:
    out = ["read-only" if s.read_only else ("destructive" if s.destructive else "writes")]
    if s.long:
        out.append("long (progress, start_job)")
    if s.open_world:
        out.append("open world")
    return ", ".join(out)


def tool_table(specs: dict[str, ToolSpec]) -> str:
    lines = ["| Toolset | Tool | When to use it | Hints |", "|---|---|---|---|"]
    for toolset in TOOLSETS:
        for s in (x for x in specs.values() if x.toolset == toolset):
            first = re.split(r"(?<=[.;])\s", " ".join(s.description.split()), maxsplit=1)[0].rstrip(";.")
            lines.append(f"| `{toolset}`{' (default)' if toolset in DEFAULT_TOOLSETS else ''} | `{s.name}` "
                         f"| {first} | {_hints(s)} |")
    return "\n".join(lines)


def main() -> int:
    text = README.read_text()
    if START not in text or END not in text:
        print(f"{README}: no {START} ... {END} markers", file=sys.stderr)
        return 2
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    README.write_text(f"{head}{START}\n{tool_table(load_all())}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
