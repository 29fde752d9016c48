"""The resources that grow with use, bounded and paged: the evidence index and the vLLM server log.

Every answer is what fits in RESULT_BUDGET and names the URI of the next page, when there is one: the index's
`evidence/runs` (its first page) and `evidence/runs/page/{page}`, newest first; the log's tail `server/log`, and
`server/log/{lines}`, which reads the log's last `lines` lines from their first, as many as fit, and names
`server/log/{the lines after them}`. Importing this module declares them in the resource registry
(tools/mcp/resources.py), after the others.
"""

from __future__ import annotations

import json
from typing import Any

from tools.core.errors import ToolFailure
from tools.mcp.bounded import RESULT_BUDGET, fit_text, pages
from tools.mcp.errors import MCP
from tools.mcp.resources import SCHEME, ResourceFailure, evidence_run_list, resource
from tools.serving import log_path, read_log

LOG_LINES = 200          # lines the log resource reads before keeping the tail that fits
MORE_LOG = f"{SCHEME}://server/log/{{lines}}"
RUNS_PAGE = f"{SCHEME}://evidence/runs/page/{{page}}"
_HEAD_ROOM = 250         # a page's own line (the log's) or fields (the index's) besides what it pages


def _whole_number(value: str, what: str, most: int, example: str) -> int:
    # "²" is a digit to isdigit; and a number longer than `most` is out of range before int() (which refuses past
    # 4300 digits with a message of its own)
    if not (value.isascii() and value.isdigit()) or len(value.lstrip("0")) > len(str(most)) or \
            not 1 <= int(value) <= most:
        raise ResourceFailure(f"{what} {value[:20]!r}: give a whole number, 1-{most}, e.g. {example}")
    return int(value)


def _index_page(app, page: int) -> str:
    runs = [json.dumps({"run": r["run"], "uris": r["uris"]}, separators=(",", ":")) for r in evidence_run_list(app)]
    roots = [str(r) for r in app.roots.evidence]
    room = RESULT_BUDGET - _HEAD_ROOM - len(json.dumps(roots))
    split = pages(runs, room)
    if page > len(split):
        raise ResourceFailure(f"page {page}: the evidence index has {len(split)} page(s) now; read "
                              f"{SCHEME}://evidence/runs for the first")
    data: dict[str, Any] = {"roots": roots, "runs": [json.loads(r) for r in split[page - 1]], "total": len(runs),
                            "page": page, "pages": len(split)}
    if page < len(split):
        data["next"] = RUNS_PAGE.format(page=page + 1)
    return json.dumps(data, separators=(",", ":"))


@resource(f"{SCHEME}://evidence/runs", title="Evidence runs", mime_type="application/json")
def evidence_runs(app) -> str:
    """The newest evidence runs (folders under an evidence root with summary.md or summary.json: sweep, eval and
    comparison runs) that fit in a short answer, with the URIs that read their summaries; `next` names the page of
    older ones (evidence/runs/page/2) when there are others."""
    return _index_page(app, 1)


@resource(RUNS_PAGE, title="Evidence runs, one page", mime_type="application/json")
def evidence_runs_page(app, page: str) -> str:
    """Page `page` of the evidence runs, newest first, as many as fit in a short answer; `next` names the page
    after it."""
    return _index_page(app, _whole_number(page, "page", 100_000, RUNS_PAGE.format(page=2)))


def _log(app, lines: int) -> str:
    try:
        return read_log(app.config(), lines)
    except ToolFailure as exc:
        raise ResourceFailure(exc.render(MCP)) from None


@resource(f"{SCHEME}://server/log", title="vLLM server log tail", mime_type="text/plain")
def server_log(app) -> str:
    """The last lines (as many as fit in a short answer) of the log of the vLLM server start_vllm_server started
    (the last start's, after a failed start or a stop); server/log/{lines} pages through more."""
    text = _log(app, LOG_LINES)
    return fit_text(text, whole=f"more with {MORE_LOG} (e.g. 1000: from the 1,000th line from the end on), or the "
                                f"file {log_path(app.config())}")  # the one read: a front door's build's own


@resource(MORE_LOG, title="vLLM server log, from a line on", mime_type="text/plain")
def server_log_lines(app, lines: str) -> str:
    """The log from its `lines`-th last line (1-100000) on, as many lines as fit in a short answer, after a line
    naming the URI that reads on from where this one stops."""
    want = _whole_number(lines, "lines", 100_000, f"{SCHEME}://server/log/1000")
    room = RESULT_BUDGET - _HEAD_ROOM
    rows = [r if len(r) <= room else f"{r[:room - 40]} [... {len(r):,} characters]"
            for r in _log(app, want).rstrip("\n").split("\n")]
    here = pages(rows, room)[0]
    rest = len(rows) - len(here)
    head = (f"[the log's last {len(rows):,} lines from the first: {len(here):,} here; the {rest:,} after them: "
            f"{MORE_LOG.format(lines=rest)}]" if rest else f"[the log's last {len(rows):,} lines, to its end]")
    return head + "\n" + "\n".join(here)
