"""A capacity run's result, its table, and capacity runs side by side (`capacity-compare`).

A capacity run folder is also a sweep run folder (summary.json holds the measured points as cells), so
`sweep-compare` and `pareto` read it too; `capacity.json` and `capacity.md` add the search and its answer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from tools.core.errors import BadInput, op
from tools.core.json_files import field_of
from tools.measure.capacity.search import Search, TermCheck
from tools.measure.capacity.slo import Term
from tools.measure.evidence import write_text
from tools.measure.uncertainty import METHOD, Estimate

SEARCH_METHOD = ("Search: the load doubles from the start until a point fails, then bisects between the last "
                 "passing and the first failing load. A term passes where its 95% interval over the point's "
                 "repeats (Student t on the log repeats) lies within its limit and fails where it lies beyond; "
                 "a point whose interval holds a limit is measured again, and if it still does its geometric mean "
                 "decides (marked within noise). Goodput: vLLM's request_goodput, the requests per second that met "
                 "every per-request limit on ttft, tpot and e2el.")


class CapacityResult(BaseModel):
    run_id: str
    run_dir: str
    label: str
    slo: str = Field(description="The SLO as given, normalised: ttft_p99_ms=1000,tpot_p99_ms=100")
    terms: list[Term]
    load: Literal["concurrency", "rate"]
    input_len: int
    output_len: int
    status: str = Field(description="found, none (the first load fails), lower_bound (the ceiling passes), "
                                    "bounded_by_max_num_seqs, or error")
    capacity: float | None = Field(description="The largest load that met the SLO: concurrent users, or "
                                               "requests per second")
    last_pass: float | None = None
    first_fail: float | None = None
    max_num_seqs: int | None = Field(None, description="The engine's cap on concurrent sequences")
    search: Search
    goodput: Estimate | None = Field(None, description="Requests per second meeting every per-request limit "
                                                       "at the capacity (vLLM's request_goodput)")
    out_tok_s: Estimate | None = Field(None, description="Output tok/s at the capacity")
    terms_at_capacity: list[TermCheck] = Field(default_factory=list)
    price_per_hour: float
    usd_per_million: float | None = Field(None, description="$ per million output tokens at the capacity")
    platform: str | None = Field(None, description="cuda or cpu: where the figures were measured")
    measured_on: str | None = Field(None, description="The GPU or the CPU stand-in, and the build served")
    cost_basis: str | None = Field(None, description="How the cost was priced (on a CPU by default: the T4 VM's "
                                                     "price applied to CPU throughput)")
    statement: str = ""
    wall_s: float | None = None
    files: dict[str, str] = Field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _load(v: float | None, kind: str) -> str:
    if v is None:
        return "—"
    return f"{v:g}" if kind == "concurrency" else f"{v:g} req/s"


def statement(r: CapacityResult) -> str:
    """The answer in one line."""
    unit = "concurrent users" if r.load == "concurrency" else "requests/s"
    at = ""
    if r.capacity is not None:
        at = (f"; there: goodput {r.goodput.text(3) if r.goodput else '—'} req/s, "
              f"{r.out_tok_s.text() if r.out_tok_s else '—'} out tok/s, "
              + ("$—" if r.usd_per_million is None else f"${r.usd_per_million:.2f}")
              + f" per million output tokens at {r.cost_basis or f'${r.price_per_hour}/h'}")
    pts = f" ({len(r.search.points)} points measured{f' on {r.measured_on}' if r.measured_on else ''})"
    if r.status == "none":
        first = r.search.points[0] if r.search.points else None
        why = "; ".join(t.text() for t in first.terms if t.verdict != "pass") if first else ""
        return f"capacity: none: even {_load(r.search.first_fail, r.load)} fails {r.slo} ({why}){pts}"
    if r.status == "error":
        return f"capacity: not determined: {r.search.reason}{pts}"
    head = f"capacity: {_load(r.capacity, r.load)} {unit} within {r.slo}"
    if r.status == "found":
        head += f" (bracket: {_load(r.last_pass, r.load)} passes, {_load(r.first_fail, r.load)} fails)"
    elif r.status == "lower_bound":
        head = (f"capacity: at least {_load(r.capacity, r.load)} {unit} within {r.slo} (a lower bound: the "
                f"search's maximum still passes)")
    else:  # the engine's cap, not the SLO, ended the search: a bound, and how to measure past it
        more = 2 * (r.max_num_seqs or int(r.capacity or 1))
        head = (f"capacity: at least {_load(r.capacity, r.load)} {unit} within {r.slo}, a bound set by the "
                f"engine's max_num_seqs {r.max_num_seqs}, not by the SLO (beyond it requests queue); to measure "
                f"further, restart the server with max_num_seqs {more} (the start's argument, MAX_NUM_SEQS in "
                f"tpu.env) and search again with max_load {more}")
    return head + at + pts


def markdown(r: CapacityResult) -> str:
    lines = [f"# Capacity {r.run_id}: {r.label}", "", r.statement, "",
             f"Prompts of {r.input_len} tokens, {r.output_len} output tokens, load by {r.load}.", "",
             "| load | verdict | rounds | repeats | " + " | ".join(t.name for t in r.terms) + " |",
             "|---|---|---|---|" + "---|" * len(r.terms)]
    for p in r.search.points:
        v = "failed: " + p.failed if p.failed else ("pass" if p.passed else "fail") + (
            " (within noise)" if p.within_noise else "")
        cells = [f"{t.value:,.1f}" + (f" ({t.low:,.1f}–{t.high:,.1f})" if t.low is not None else "")
                 if t.value is not None else "—" for t in p.terms] or ["—"] * len(r.terms)
        lines.append(f"| {_load(p.load, r.load)} | {v} | {p.rounds} | {p.repeats} | " + " | ".join(cells) + " |")
    lines += ["", "Limits: " + ", ".join(f"{t.name} <= {t.limit_ms:g}" for t in r.terms) + ". In order measured; "
              "values are geometric means of the point's repeats with their 95% interval.", "", SEARCH_METHOD, ""]
    return "\n".join(lines)


def write_capacity(r: CapacityResult, run_dir: Path, *, final_dir: Path | None = None) -> None:
    """capacity.md and capacity.json into run_dir (their paths as they will be under final_dir)."""
    shown = final_dir or run_dir
    r.files.update({"capacity_json": str(shown / "capacity.json"), "capacity_md": str(shown / "capacity.md")})
    write_text(run_dir / "capacity.md", markdown(r))
    write_text(run_dir / "capacity.json", json.dumps(r.to_dict(), indent=2) + "\n")


def is_capacity_run(path: str | Path) -> bool:
    return (Path(path) / "capacity.json").is_file()


def load_capacity(path: str | Path) -> CapacityResult:
    p = Path(path)
    f = p / "capacity.json" if p.is_dir() else p
    if not f.is_file():
        raise BadInput(f"{p}: no capacity.json; pass a folder written by {op('capacity')}",
                       detail={"path": str(p)})
    try:
        res = CapacityResult.model_validate_json(f.read_text())
    except ValidationError as exc:
        name, msg = field_of(exc)
        raise BadInput(f"{f}: not a capacity result (field {name!r}: {msg.lower()}); pass a folder written by "
                       f"{op('capacity')}", detail={"path": str(f), "field": name}) from None
    except (ValueError, OSError) as exc:  # UnicodeDecodeError is a ValueError
        raise BadInput(f"{f}: not a capacity result ({str(exc).splitlines()[0]}); pass a folder written by "
                       f"{op('capacity')}") from exc
    _check_sound(res, f)
    return res


LOAD_MAX = 100_000  # the highest load a search may be asked for (CapacityParams.max_load)


def _check_sound(r: CapacityResult, f: Path) -> None:
    """A capacity.json that parses but cannot be a search's answer (NaN, Infinity, a bracket upside down) would
    give a confident verdict from nothing: refuse it as damaged, naming the field."""
    numbers = {"capacity": r.capacity, "last_pass": r.last_pass, "first_fail": r.first_fail,
               "usd_per_million": r.usd_per_million, "price_per_hour": r.price_per_hour,
               "goodput": r.goodput.mean if r.goodput else None,
               "out_tok_s": r.out_tok_s.mean if r.out_tok_s else None}
    limits = {"capacity": LOAD_MAX, "last_pass": LOAD_MAX, "first_fail": LOAD_MAX, "price_per_hour": 1e6}
    for name, v in numbers.items():
        if v is None:
            continue
        top = limits.get(name, 1e15)
        if not math.isfinite(v) or not 0 <= v <= top:
            raise BadInput(f"{f}: damaged capacity result: {name} is {v:g}, not a number from 0 to {top:g}; "
                           f"measure it again with {op('capacity')}", detail={"path": str(f), "field": name})
    if r.last_pass is not None and r.first_fail is not None and r.last_pass >= r.first_fail:
        raise BadInput(f"{f}: damaged capacity result: last_pass {r.last_pass:g} is not below first_fail "
                       f"{r.first_fail:g}; measure it again with {op('capacity')}",
                       detail={"path": str(f), "field": "last_pass"})


# ----------------------------------------------------------------------------------------------------------
# Side by side


def bracket(r: CapacityResult) -> tuple[float, float]:
    """Where the true capacity lies: [last passing, first failing) — from 0 where even the first load fails,
    open above where the ceiling still passed."""
    lo = r.last_pass if r.last_pass is not None else 0.0
    hi = r.first_fail if r.first_fail is not None else math.inf
    return lo, hi


class CapacityRow(BaseModel):
    label: str
    run_dir: str
    status: str
    capacity: float | None
    bracket: tuple[float, float | None]
    goodput: float | None
    out_tok_s: float | None
    usd_per_million: float | None


class CapacityComparison(BaseModel):
    slo: str
    load: str
    rows: list[CapacityRow]
    verdicts: list[str] = Field(description="The last run against each earlier one")
    markdown: str = ""

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def summary(self) -> str:
        return "; ".join(self.verdicts)


def _verdict(cand: CapacityResult, ref: CapacityResult, cl: str, rl: str) -> str:
    unit = "users" if cand.load == "concurrency" else "requests/s"
    (a_lo, a_hi), (b_lo, b_hi) = bracket(cand), bracket(ref)
    said = (f"the {cl} build serves {_load(cand.capacity, cand.load) if cand.capacity is not None else 'none'} "
            f"{unit} within the SLO against {_load(ref.capacity, ref.load) if ref.capacity is not None else 'none'}"
            f" for {rl}")
    if a_lo >= b_hi:
        return f"{said}: more (the brackets do not overlap)"
    if a_hi <= b_lo:
        return f"{said}: fewer (the brackets do not overlap)"
    return f"{said}: no verdict (the brackets overlap)"


def compare_capacity(paths: list[str | Path]) -> CapacityComparison:
    """Capacity runs side by side, the last against each earlier one; they must share the SLO, the load kind
    and the prompt shape, or the capacities answer different questions."""
    if len(paths) < 2:
        raise BadInput(f"{op('capacity_compare')} needs two or more capacity run folders (earlier builds first, "
                          f"the candidate last)")
    runs = [load_capacity(p) for p in paths]
    shape = {(r.slo, r.load, r.input_len, r.output_len) for r in runs}
    if len(shape) > 1:
        raise BadInput("these capacity runs answer different questions (SLO, load, prompt shape): "
                          + "; ".join(f"{p}: {r.slo}, {r.load}, {r.input_len}/{r.output_len}"
                                      for p, r in zip(paths, runs)))
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        labels = [f"{r.label} ({r.run_id})" for r in runs]
    rows = [CapacityRow(label=lab, run_dir=str(p), status=r.status, capacity=r.capacity,
                        bracket=(bracket(r)[0], None if math.isinf(bracket(r)[1]) else bracket(r)[1]),
                        goodput=r.goodput.mean if r.goodput else None,
                        out_tok_s=r.out_tok_s.mean if r.out_tok_s else None, usd_per_million=r.usd_per_million)
            for lab, p, r in zip(labels, paths, runs)]
    verdicts = [_verdict(runs[-1], r, labels[-1], lab) for lab, r in reversed(list(zip(labels[:-1], runs[:-1])))]
    cmp = CapacityComparison(slo=runs[0].slo, load=runs[0].load, rows=rows, verdicts=verdicts)
    cmp.markdown = _compare_markdown(cmp, runs)
    return cmp


def _compare_markdown(cmp: CapacityComparison, runs: list[CapacityResult]) -> str:
    lines = [f"## Capacity within {cmp.slo} (load by {cmp.load}, {runs[0].input_len}-token prompts, "
             f"{runs[0].output_len} output tokens)", "",
             "| Build | capacity | bracket | status | goodput req/s | out tok/s | $/M out tok |",
             "|---|---|---|---|---|---|---|"]
    for row, r in zip(cmp.rows, runs):
        hi = "open" if row.bracket[1] is None else f"{row.bracket[1]:g}"
        lines.append(f"| {row.label} | {_load(row.capacity, r.load) if row.capacity is not None else 'none'} "
                     f"| [{row.bracket[0]:g}, {hi}) | {row.status} "
                     f"| {r.goodput.text(3) if r.goodput else '—'} | {r.out_tok_s.text() if r.out_tok_s else '—'} "
                     f"| {'—' if row.usd_per_million is None else f'${row.usd_per_million:.2f}'} |")
    lines += ["", *(f"- {v}" for v in cmp.verdicts), "",
              "A bracket is [last passing load, first failing load): the capacity lies inside it. A verdict is given "
              "only where the brackets do not overlap. " + METHOD, ""]
    return "\n".join(lines)
