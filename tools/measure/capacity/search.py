"""The capacity search: the largest load at which every SLO term holds, in few measured points.

Pure: it sees the server only through `measure(load) -> Sample` (one round of repeats at that load), so it is
tested on synthetic callables. The search doubles the load from `start` until a point fails (or the ceiling,
`max_load` or the engine's max_num_seqs, still passes), then bisects between the last passing and the first
failing load: to one step for concurrencies, to `rel_tol` for request rates. Never a fixed grid.

A point's verdict per term: with two or more repeats, pass where the term's 95% interval (tools/measure/
uncertainty.py) lies wholly within its limit, fail where wholly beyond, and within noise where the interval
holds the limit; with one repeat, its value decides. A point within noise is measured again (`noise_rounds`
more rounds, their repeats pooled); if it still is, its geometric mean decides and the point says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal

from pydantic import BaseModel, Field

from tools.measure.capacity.slo import Term
from tools.measure.uncertainty import estimate

PASS, FAIL, NOISE = "pass", "fail", "within noise"
Status = Literal["found", "none", "lower_bound", "bounded_by_max_num_seqs", "error"]


@dataclass
class Sample:
    """One round at a load: each metric's per-repeat values (vLLM result keys: p99_ttft_ms, ...), or why
    there is no measurement."""

    values: dict[str, list[float]] = field(default_factory=dict)
    failed: str | None = None


class TermCheck(BaseModel):
    name: str
    limit_ms: float
    value: float | None = Field(description="Geometric mean of the repeats' percentile")
    low: float | None = None
    high: float | None = None
    verdict: str = Field(description="pass, fail or within noise")

    def text(self) -> str:
        v = "—" if self.value is None else f"{self.value:,.1f}"
        ci = f" ({self.low:,.1f}–{self.high:,.1f})" if self.low is not None and self.high is not None else ""
        return f"{self.name} {v}{ci} vs {self.limit_ms:g}: {self.verdict}"


class Point(BaseModel):
    load: float
    passed: bool
    within_noise: bool = Field(False, description="The verdict was decided by the mean: the interval held "
                                                  "the limit after the extra rounds")
    rounds: int = 1
    repeats: int = 0
    terms: list[TermCheck] = Field(default_factory=list)
    failed: str | None = None


class Search(BaseModel):
    status: Status
    capacity: float | None = Field(description="The largest load that passed (none where the first failed)")
    last_pass: float | None = None
    first_fail: float | None = None
    ceiling: float
    bounded_by: str | None = Field(None, description="What capped the search: max or max_num_seqs")
    points: list[Point] = Field(default_factory=list, description="In the order measured")
    reason: str | None = None

    def point(self, load: float | None) -> Point | None:
        return next((p for p in self.points if load is not None and p.load == load), None)


def check_terms(terms: list[Term], values: dict[str, list[float]]) -> list[TermCheck]:
    out = []
    for t in terms:
        e = estimate(values.get(t.key, []))
        if e.mean is None:
            verdict = FAIL  # not measured: it cannot be said to hold
        elif e.low is not None and e.high is not None:
            verdict = PASS if e.high <= t.limit_ms else FAIL if e.low > t.limit_ms else NOISE
        else:
            verdict = PASS if e.mean <= t.limit_ms else FAIL
        out.append(TermCheck(name=t.name, limit_ms=t.limit_ms, value=e.mean, low=e.low, high=e.high,
                             verdict=verdict))
    return out


def _probe(measure: Callable[[float], Sample], terms: list[Term], load: float, noise_rounds: int) -> Point:
    pooled: dict[str, list[float]] = {}
    rounds = 0
    while True:
        s = measure(load)
        rounds += 1
        if s.failed:
            return Point(load=load, passed=False, rounds=rounds, failed=s.failed)
        for k, v in s.values.items():
            pooled.setdefault(k, []).extend(v)
        checks = check_terms(terms, pooled)
        n = max((len(v) for v in pooled.values()), default=0)
        if any(c.verdict == FAIL for c in checks):
            return Point(load=load, passed=False, rounds=rounds, repeats=n, terms=checks)
        if all(c.verdict == PASS for c in checks):
            return Point(load=load, passed=True, rounds=rounds, repeats=n, terms=checks)
        if rounds > noise_rounds:  # still within noise: the means decide
            ok = all(c.value is not None and c.value <= c.limit_ms for c in checks)
            return Point(load=load, passed=ok, within_noise=True, rounds=rounds, repeats=n, terms=checks)


def search_capacity(measure: Callable[[float], Sample], terms: list[Term], *, max_load: float,
                    start: float = 1, integer: bool = True, max_num_seqs: int | None = None,
                    rel_tol: float = 0.1, noise_rounds: int = 1) -> Search:
    """Bracket by doubling from `start`, then bisect; see the module's docstring. `integer` loads are
    concurrencies (bisected to one step; capped by `max_num_seqs`, beyond which requests queue), others
    request rates (bisected geometrically until first_fail / last_pass <= 1 + rel_tol)."""
    ceiling, bounded_by = float(max_load), "max"
    if integer and max_num_seqs is not None and max_num_seqs < ceiling:
        ceiling, bounded_by = float(max_num_seqs), "max_num_seqs"
    start = min(float(start), ceiling)
    points: list[Point] = []

    def probe(load: float) -> Point:
        p = _probe(measure, terms, load, noise_rounds)
        points.append(p)
        return p

    lo: float | None = None
    hi: float | None = None
    load = start
    while True:
        p = probe(load)
        if p.failed:
            return Search(status="error", capacity=lo, last_pass=lo, ceiling=ceiling, points=points,
                          reason=f"load {load:g}: {p.failed}")
        if not p.passed:
            hi = load
            break
        lo = load
        if load >= ceiling:
            break
        load = min(load * 2, ceiling)
    if lo is None:
        return Search(status="none", capacity=None, first_fail=hi, ceiling=ceiling, points=points)
    if hi is None:
        status: Status = "bounded_by_max_num_seqs" if bounded_by == "max_num_seqs" else "lower_bound"
        return Search(status=status, capacity=lo, last_pass=lo, ceiling=ceiling, bounded_by=bounded_by,
                      points=points)
    while (hi - lo > 1) if integer else (hi / lo > 1 + rel_tol):
        mid = float((int(lo) + int(hi)) // 2) if integer else float(f"{math.sqrt(lo * hi):.3g}")
        if not lo < mid < hi:  # a rate bracket narrower than three significant digits
            break
        p = probe(mid)
        if p.failed:
            return Search(status="error", capacity=lo, last_pass=lo, first_fail=hi, ceiling=ceiling,
                          points=points, reason=f"load {mid:g}: {p.failed}")
        lo, hi = (mid, hi) if p.passed else (lo, mid)
    return Search(status="found", capacity=lo, last_pass=lo, first_fail=hi, ceiling=ceiling, points=points)
