"""The one uncertainty method of every measured comparison: sweep cells, sweep comparisons, drafter speedups.

A figure measured in n repeats is summarised on the log scale, since throughputs and times are positive and
vary by factors: its value is the geometric mean of the repeats and its 95% confidence interval is Student's
t on the logs of the repeats (n - 1 degrees of freedom), mapped back. With fewer than two repeats the interval
is unknown. A figure without repeats (a published one) keeps its recorded value.

A ratio of two such figures is the ratio of their geometric means; its 95% interval is Welch's t on the
difference of the two log means (standard errors added in quadrature, Welch-Satterthwaite degrees of freedom),
which stays correct for small and unequal repeat counts and unequal spreads. Paired figures (the same prompt
measured twice) use the one-sample t on the logs of the per-pair ratios instead. The verdict: "faster" where
the interval lies wholly above 1, "slower" wholly below, "within noise" where it holds 1, and "no repeats"
where either side has fewer than two repeats (the ratio is then printed without an interval). A ratio with a run
that other work on the machine loaded gets no verdict ("other work"): its interval holds the spread of
the repeats, not the load's.

Ratios are written in one format everywhere, two decimals and an x: `1.37x` (what an article writes as +37%)
and `2.30x`.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Iterable, Literal

from pydantic import BaseModel, Field

CONFIDENCE = 0.95
FASTER, SLOWER, WITHIN_NOISE, NO_REPEATS = "faster", "slower", "within noise", "no repeats"
OTHER_WORK = "other work"  # no verdict: the machine was loaded
Verdict = Literal["faster", "slower", "within noise", "no repeats", "other work"]

METHOD = ("Values are geometric means of a cell's repeats with their 95% confidence interval (Student t on the "
          "log repeats); a ratio is candidate / baseline written as 1.37x (= +37%), its 95% interval from Welch's "
          "t on the difference of log means; faster / slower only where that interval excludes 1.00x, else "
          "within noise; no repeats where a side has fewer than two repeats.")


@lru_cache(maxsize=256)
def _t_quantile(df: float, p: float = 0.5 + CONFIDENCE / 2) -> float:
    """Student t quantile (two-sided 95% by default) for real df >= 1: bisection on the CDF, integrated
    numerically (Simpson on x = tan(u), which keeps the heavy tail of df ~ 1 on a finite interval)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf_above_half(x: float) -> float:
        hi, n = math.atan(x), 400
        h = hi / n

        def f(u: float) -> float:
            t = math.tan(u)
            return c * (1 + t * t / df) ** (-(df + 1) / 2) * (1 + t * t)

        s = f(0) + f(hi) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
        return 0.5 + s * h / 3

    lo, hi = 0.0, 1000.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf_above_half(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_quantile(df: float) -> float:
    """The 97.5% quantile of Student's t with df degrees of freedom (df rounded to 0.01, at least 1)."""
    return _t_quantile(max(1.0, round(df, 2)))


class Estimate(BaseModel):
    """A figure from repeats: geometric mean and its 95% interval (none with fewer than two repeats)."""

    n: int = Field(description="Repeats the figure is from (0: a recorded figure without its repeats)")
    mean: float | None = Field(description="Geometric mean of the repeats, or the recorded figure")
    low: float | None = Field(None, description="95% confidence interval, lower end")
    high: float | None = Field(None, description="95% confidence interval, upper end")
    log_mean: float | None = Field(None, description="Mean of the log repeats")
    log_se: float | None = Field(None, description="Standard error of the mean log")

    def text(self, digits: int = 2) -> str:
        """`239.64 (231.20–248.40)`, or the value alone without an interval, `—` without a value."""
        if self.mean is None:
            return "—"
        if self.low is None or self.high is None:
            return f"{self.mean:,.{digits}f}"
        return f"{self.mean:,.{digits}f} ({self.low:,.{digits}f}–{self.high:,.{digits}f})"


def estimate(values: Iterable[float | None], recorded: float | None = None) -> Estimate:
    """The figure of a cell from its repeats' values (non-positive and missing ones left out); `recorded` (a
    published median) stands in when there are none."""
    xs = [float(v) for v in values if v is not None and v > 0]
    if not xs:
        return Estimate(n=0, mean=recorded)
    logs = [math.log(x) for x in xs]
    m = sum(logs) / len(logs)
    if len(xs) < 2:
        return Estimate(n=1, mean=xs[0], log_mean=m)
    se = math.sqrt(sum((v - m) ** 2 for v in logs) / (len(logs) - 1) / len(logs))
    h = t_quantile(len(xs) - 1) * se
    return Estimate(n=len(xs), mean=math.exp(m), low=math.exp(m - h), high=math.exp(m + h), log_mean=m, log_se=se)


class Ratio(BaseModel):
    """A ratio of two figures with its 95% interval and verdict."""

    value: float | None = Field(description="Candidate / baseline (higher is better: throughput, speedup)")
    low: float | None = Field(None, description="95% confidence interval, lower end")
    high: float | None = Field(None, description="95% confidence interval, upper end")
    verdict: Verdict | None = Field(None, description="faster, slower, within noise, no repeats, or other work "
                                                      "(no verdict: other work loaded the machine around a run of "
                                                      "the pair); none without a value")

    def text(self) -> str:
        """The ratio alone: `1.37x`."""
        return ratio_text(self.value)

    def cell(self) -> str:
        """`1.37x (1.20–1.56) faster`, `0.98x (0.80–1.21) within noise`, `2.30x (no repeats)`, `—`."""
        if self.value is None:
            return "—"
        if self.low is None or self.high is None:
            return f"{ratio_text(self.value)} ({self.verdict})"
        return f"{ratio_text(self.value)} ({self.low:.2f}–{self.high:.2f}) {self.verdict}"


def ratio_text(r: float | None) -> str:
    """THE ratio format: two decimals and an x (`1.37x`), `—` without one."""
    return "—" if r is None else f"{r:.2f}x"


def verdict(low: float, high: float, null: float = 1.0) -> Verdict:
    """faster / slower where the interval lies wholly above / below `null` (1 for a ratio, 0 for a
    difference), else within noise."""
    return FASTER if low > null else SLOWER if high < null else WITHIN_NOISE


def _interval(log_ratio: float, se: float, df: float) -> Ratio:
    h = t_quantile(df) * se if se > 0 else 0.0
    low, high = math.exp(log_ratio - h), math.exp(log_ratio + h)
    return Ratio(value=math.exp(log_ratio), low=low, high=high, verdict=verdict(low, high))


def ratio(num: Estimate | None, den: Estimate | None) -> Ratio:
    """num / den with Welch's interval on the log scale; "no repeats" where a side has fewer than two."""
    if num is None or den is None or not num.mean or not den.mean:
        return Ratio(value=None)
    if num.log_se is None or den.log_se is None:
        return Ratio(value=num.mean / den.mean, verdict=NO_REPEATS)
    se2 = num.log_se ** 2 + den.log_se ** 2
    if se2 == 0:  # identical repeats on both sides: the ratio is exact
        return _interval(num.log_mean - den.log_mean, 0.0, 1.0)
    df = se2 ** 2 / (num.log_se ** 4 / (num.n - 1) + den.log_se ** 4 / (den.n - 1))
    return _interval(num.log_mean - den.log_mean, math.sqrt(se2), df)


def without_verdict_under_load(r: Ratio, loaded: bool) -> Ratio:
    """`r`, with no verdict where a run of the pair was measured beside other work (provenance.other_load)."""
    if not loaded or r.verdict not in (FASTER, SLOWER, WITHIN_NOISE):
        return r
    return r.model_copy(update={"verdict": OTHER_WORK})


def paired_ratio(pairs: Iterable[tuple[float | None, float | None]], recorded: float | None = None) -> Ratio:
    """Geometric mean of per-pair ratios num / den (the same prompt measured twice), with the one-sample t
    interval on their logs; `recorded` stands in, as "no repeats", with fewer than two usable pairs."""
    rs = [a / b for a, b in pairs if a and b and a > 0 and b > 0]
    if len(rs) < 2:
        value = recorded if recorded is not None else (rs[0] if rs else None)
        return Ratio(value=value, verdict=None if value is None else NO_REPEATS)
    e = estimate(rs)
    return _interval(e.log_mean, e.log_se, len(rs) - 1)
