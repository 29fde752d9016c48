"""The MCP tool table, resources, prompts and walk-through of docs/mcp.md, rendered from the registries:
`python -m tools.mcp.readme` rewrites them (between the `tools:` and `resources:` start / end markers); tests keep
them equal."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from tools.mcp.catalog import load_all
from tools.mcp.registry import ALWAYS_LISTED, DEFAULT_TOOLSETS, TOOLSETS, ToolSpec
from tools.mcp import index_resources  # noqa: F401  (declares the bounded resources)
from tools.mcp.resources import PROMPTS, RESOURCES

DOC = Path(__file__).resolve().parents[2] / "docs" / "mcp.md"
START, END = "<!-- tools:start (python -m tools.mcp.readme) -->", "<!-- tools:end -->"
RES_START, RES_END = "<!-- resources:start (python -m tools.mcp.readme) -->", "<!-- resources:end -->"


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
            mark = " (default)" if toolset in DEFAULT_TOOLSETS else (" (always)" if toolset == ALWAYS_LISTED else "")
            lines.append(f"| `{toolset}`{mark} | `{s.name}` "
                         f"| {first} | {_hints(s)} |")
    return "\n".join(lines)


def resources_section() -> str:
    """Resources and templates, prompts, and the fresh-VM walk-through (deploy_t4 then compare_builds)."""
    lines = ["| Resource | What it holds |", "|---|---|"]
    for r in RESOURCES.values():
        first = re.split(r"(?<=[.;])\s", " ".join(r.description.split()), maxsplit=1)[0].rstrip(";.")
        lines.append(f"| `{r.uri}` ({r.mime_type}) | {first} |")
    lines += ["", "| Prompt | Arguments (defaults) | What it walks through |", "|---|---|---|"]
    for p in PROMPTS.values():
        args = ", ".join(f"`{k}` (`{d}`)" if d else f"`{k}` (none)" for k, (d, _) in p.arguments.items())
        lines.append(f"| `{p.name}` | {args} | {p.description} |")
    for p in PROMPTS.values():
        lines += ["", f"`{p.name}` with its defaults (toolsets {', '.join(p.toolsets)}):", "", p.steps_text()]
    return "\n".join(lines)


def _replace(text: str, start: str, end: str, body: str) -> str:
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def main() -> int:
    text = DOC.read_text()
    for start, end in ((START, END), (RES_START, RES_END)):
        if start not in text or end not in text:
            print(f"{DOC}: no {start} ... {end} markers", file=sys.stderr)
            return 2
    text = _replace(text, START, END, tool_table(load_all()))
    DOC.write_text(_replace(text, RES_START, RES_END, resources_section()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
