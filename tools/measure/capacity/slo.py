"""A latency target (SLO) as `ttft_p99_ms=1000,tpot_p99_ms=100`: terms over vLLM bench's percentile metrics.

A term names one of `vllm bench serve`'s percentile metrics (ttft, tpot, itl, e2el at p50, p90 or p99, in ms)
and its limit; the SLO holds at a load when every term's measured percentile is within its limit. vLLM's
`--goodput` counts the requests that meet per-request limits on ttft, tpot and e2el (not itl, which is per
token): each of those metrics' limit is its term's (the tightest where a metric has several).
"""

from __future__ import annotations

import math
import re

from pydantic import BaseModel, Field

from tools.core.errors import BadInput, param
from tools.core.text import clip

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # what vllm bench serve --goodput accepts
_TERM = re.compile(r"^(?P<metric>[a-z0-9]+)_p(?P<pct>[0-9]+)_ms$")


class Term(BaseModel):
    metric: str = Field(description="ttft, tpot, itl or e2el")
    percentile: int = Field(description="50, 90 or 99")
    limit_ms: float = Field(description="The most the percentile may be, in ms")

    @property
    def name(self) -> str:
        """The term as written: `ttft_p99_ms`."""
        return f"{self.metric}_p{self.percentile}_ms"

    @property
    def key(self) -> str:
        """The metric's key in vLLM's result JSON: `p99_ttft_ms`."""
        return f"p{self.percentile}_{self.metric}_ms"

    def text(self) -> str:
        return f"{self.name}={self.limit_ms:g}"


def _bad(term: str, why: str) -> BadInput:
    return BadInput(f"{param('slo')} term {clip(repr(term), 60)}: {why}; write terms as METRIC_pPCT_ms=LIMIT, "
                    f"e.g. ttft_p99_ms=1000,tpot_p99_ms=100 (metrics {', '.join(METRIC_NAMES)}; percentiles "
                    f"{', '.join(map(str, PERCENTILES))})", field="slo")


def parse_slo(text: str) -> list[Term]:
    """`ttft_p99_ms=1000,tpot_p99_ms=100` -> terms; BadInput (field `slo`) naming the first bad term."""
    if not text or not text.strip():
        raise BadInput(f"{param('slo')} is empty: give terms such as ttft_p99_ms=1000,tpot_p99_ms=100",
                       field="slo")
    terms: list[Term] = []
    seen: set[str] = set()
    for raw in text.split(","):
        t = raw.strip()
        name, eq, value = t.partition("=")
        name = name.strip().lower()
        if not eq:
            raise _bad(t, "no =LIMIT")
        m = _TERM.match(name)
        if m is None or m["metric"] not in METRIC_NAMES:
            raise _bad(t, f"unknown metric {clip(repr(name), 40)}")
        if int(m["pct"]) not in PERCENTILES:
            raise _bad(t, f"percentile p{m['pct']} is not measured")
        try:
            limit = float(value)
        except ValueError:
            raise _bad(t, f"limit {clip(repr(value.strip()), 30)} is not a number of ms") from None
        if not math.isfinite(limit) or limit <= 0:
            raise _bad(t, f"limit {value.strip()} must be a positive number of ms")
        if name in seen:
            raise _bad(t, f"{name} is given twice")
        seen.add(name)
        terms.append(Term(metric=m["metric"], percentile=int(m["pct"]), limit_ms=limit))
    return terms


def slo_text(terms: list[Term]) -> str:
    return ",".join(t.text() for t in terms)


def goodput_limits(terms: list[Term]) -> dict[str, float]:
    """Per-request limits for vLLM's --goodput: ttft, tpot, e2el each at its tightest term's limit."""
    out: dict[str, float] = {}
    for t in terms:
        if t.metric in GOODPUT_METRICS:
            out[t.metric] = min(out.get(t.metric, t.limit_ms), t.limit_ms)
    return out
