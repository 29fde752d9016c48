"""The resources that grow with use, bounded: the evidence index and the vLLM server log.

By default each is what fits in RESULT_BUDGET (the newest runs, the log's last lines) and says how to read the
rest: `evidence/runs/all`, `server/log/{lines}` (or the file itself). Importing this module declares them in the
resource registry (tools/mcp/resources.py), after the others.
"""

from __future__ import annotations

import json
from typing import Any

from tools.core.errors import ToolFailure
from tools.mcp.bounded import RESULT_BUDGET, fit_text
from tools.mcp.errors import MCP
from tools.mcp.resources import SCHEME, ResourceFailure, evidence_run_list, resource
from tools.serving.vllm_server import read_log

LOG_LINES = 200          # lines the log resource reads before keeping the tail that fits
MORE_LOG = f"{SCHEME}://server/log/{{lines}}"
ALL_RUNS = f"{SCHEME}://evidence/runs/all"


def _index(app, limit: int | None) -> str:
    runs = [{"run": r["run"], "uris": r["uris"]} for r in evidence_run_list(app)]
    roots = [str(r) for r in app.roots.evidence]
    if limit is None:
        return json.dumps({"roots": roots, "runs": runs}, separators=(",", ":"))
    shown: list[dict[str, Any]] = []
    for r in runs:  # the newest runs that fit, the count of the rest and where they are listed
        trial = json.dumps({"roots": roots, "runs": [*shown, r], "total": len(runs), "more": ALL_RUNS},
                           separators=(",", ":"))
        if len(trial) > limit:
            break
        shown.append(r)
    data: dict[str, Any] = {"roots": roots, "runs": shown, "total": len(runs)}
    if len(shown) < len(runs):
        data["more"] = f"{len(runs) - len(shown)} older runs: {ALL_RUNS}"
    return json.dumps(data, separators=(",", ":"))


@resource(f"{SCHEME}://evidence/runs", title="Evidence runs", mime_type="application/json")
def evidence_runs(app) -> str:
    """The newest evidence runs (folders under an evidence root with summary.md or summary.json: sweep, eval and
    comparison runs) that fit in a short answer, with the URIs that read their summaries; `more` names
    evidence/runs/all when there are others."""
    return _index(app, RESULT_BUDGET - 100)


@resource(ALL_RUNS, title="Every evidence run", mime_type="application/json", whole=True)
def evidence_runs_all(app) -> str:
    """Every evidence run, newest first, with the URIs that read its summaries (unbounded)."""
    return _index(app, None)


def _log(app, lines: int) -> str:
    try:
        return read_log(app.config(), lines)
    except ToolFailure as exc:
        raise ResourceFailure(exc.render(MCP)) from None


@resource(f"{SCHEME}://server/log", title="vLLM server log tail", mime_type="text/plain")
def server_log(app) -> str:
    """The last lines (as many as fit in a short answer) of the log of the vLLM server start_vllm_server started
    (the last start's, after a failed start or a stop); server/log/{lines} reads more."""
    cfg = app.config()
    return fit_text(_log(app, LOG_LINES), whole=f"more with {MORE_LOG} (e.g. 1000), or the file {cfg.log_file}")


@resource(MORE_LOG, title="vLLM server log, more lines", mime_type="text/plain", whole=True)
def server_log_lines(app, lines: str) -> str:
    """The log's last `lines` lines (1-100000), as long as asked."""
    if not lines.isdigit() or not 1 <= int(lines) <= 100_000:
        raise ResourceFailure(f"lines {lines[:20]!r}: give a whole number of lines, 1-100000, e.g. {SCHEME}://"
                              "server/log/1000")
    return _log(app, int(lines))
