"""Small by default, whole on request: every result an assistant gets by default stays within RESULT_BUDGET
characters, and says where the whole is; a resource that grows with use answers in pages (`pages`), each naming
the next.

One guard for every tool result (`fit`, called by the app's result wrapper) and every resource (`fit_text`, called
by the resource wrapper), so a tool that grows a field cannot flood a client's context. The tools shape their own
results first (a table once, a prompt as a short line); the guard only catches what is still too large, shortening
long texts and lists and naming the file or resource that holds the whole. A call that asks for more
(`detail=true`, as probe_checkpoint takes) gets it in pages, each within the budget and naming the next.
"""

from __future__ import annotations

import json
from typing import Any

RESULT_BUDGET = 4_000    # characters of a default result: the summary line plus its JSON, or a resource's text
# Fields whose value is where the whole of a result lies: named when the guard shortens one.
WHOLE_FIELDS = ("path", "report_path", "comparison_path", "record_path", "run_dir", "out", "log_path", "files")
_STEPS = ((800, 16), (400, 8), (200, 5), (100, 3), (60, 2))  # (longest text, longest list) tried in turn
SUMMARY_MAX = 1_000  # the summary line an assistant repeats: whole up to this, whatever else is shortened


def size(data: dict[str, Any]) -> int:
    """What a client receives as text for a tool result: the summary line and the JSON (app._result)."""
    return len(str(data.get("summary", ""))) + len(json.dumps(data, separators=(",", ":")))


def _shrink(value: Any, text_max: int, list_max: int) -> Any:
    if isinstance(value, str):
        return value if len(value) <= text_max else f"{value[:text_max - 40]} [... {len(value):,} characters]"
    if isinstance(value, list):  # the first items, of the same kind (`clipped` says lists were shortened)
        return [_shrink(v, text_max, list_max) for v in value[:list_max]]
    if isinstance(value, dict):
        return {k: _shrink(v, text_max, list_max) for k, v in value.items()}
    return value


def _where(data: dict[str, Any]) -> str:
    """The first field saying where the whole result is, as one phrase (the fields themselves are kept: the note
    points to them, it does not repeat them)."""
    for k in WHOLE_FIELDS:
        v = data.get(k)
        if isinstance(v, dict):
            v = next((x for x in v.values() if x), None)
        if v:
            return f"; the whole: {k} {str(v)[:300]}"
    return ""


def fit(data: dict[str, Any], budget: int = RESULT_BUDGET) -> dict[str, Any]:
    """`data` if it fits; else its long texts and lists shortened step by step (the summary and the fields saying
    where the whole is kept), with `clipped` saying so; at the last, the top-level scalars only."""
    if size(data) <= budget:
        return data
    note = {"clipped": f"result over {budget:,} characters: long texts and lists shortened to their first "
                       f"part{_where(data)}"}
    keep = {k: data[k] for k in ("summary", "error", *WHOLE_FIELDS) if k in data}
    line = {k: _shrink(data[k], SUMMARY_MAX, 0) for k in ("summary", "error") if k in data}
    for text_max, list_max in _STEPS:
        small = {**_shrink(data, text_max, list_max), **_shrink(keep, 600, 8), **line, **note}
        if size(small) <= budget:
            return small
    # Many fields, none long: leave out the largest ones (named) until it fits, the summary and paths kept.
    small = {**_shrink(data, 200, 5), **_shrink(keep, 300, 4), **line}
    dropped = []
    for k in sorted((k for k in small if k not in keep), key=lambda k: -len(json.dumps(small[k], default=str))):
        if size({**small, **note}) <= budget - 200:
            break
        dropped.append(k)
        del small[k]
    return {**small, "clipped": note["clipped"] + (f"; left out: {', '.join(dropped)[:150]}" if dropped else "")}


def fit_text(text: str, *, whole: str, budget: int = RESULT_BUDGET, keep: str = "tail") -> str:
    """A resource's text within `budget`: its tail (a log) or head, after a line saying how much was left out and
    where the whole is (`whole`: a resource or file)."""
    if len(text) <= budget:
        return text
    head = f"[{len(text):,} characters, shortened to the {'last' if keep == 'tail' else 'first'} part: {whole}]\n"
    room = max(0, budget - len(head))
    body = text[-room:] if keep == "tail" else text[:room]
    if "\n" in body:  # whole lines only
        body = body.split("\n", 1)[1] if keep == "tail" else body.rsplit("\n", 1)[0]
    return head + body


def pages(pieces: list[str], room: int) -> list[list[str]]:
    """`pieces` in order, in pages of at most `room` characters each (a separator counted between two); a piece
    longer than a page is a page of its own (callers shorten such pieces first). At least one page, maybe empty."""
    out: list[list[str]] = [[]]
    used = 0
    for p in pieces:
        if out[-1] and used + 1 + len(p) > room:
            out.append([])
            used = 0
        used += len(p) + (1 if out[-1] else 0)
        out[-1].append(p)
    return out


__all__ = ["RESULT_BUDGET", "fit", "fit_text", "pages", "size"]
