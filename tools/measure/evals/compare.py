"""Eval runs side by side: per task and metric, each later run against the first, the difference paired over the
documents both scored (lm-eval's per-sample records, matched by doc_id and checked by doc_hash), with the standard
error of that paired difference and a within-noise verdict (|diff| < 2 stderr)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, TypeAdapter, ValidationError

from tools.core.errors import BadInput, ToolFailure, op
from tools.core.json_files import validate_lines
from tools.core.text import clip
from tools.measure.evals.results import EvalCompareParams, EvalComparison, EvalDiff, EvalResult, RunInfo, fmt
from tools.measure.uncertainty import WITHIN_NOISE, verdict


class _Run:
    """An eval run folder as a comparison reads it. A samples entry of summary.json must name a file inside the
    run folder; with `roots` (the MCP server's) every file read must resolve inside the evidence roots too, so a
    link in a confined folder cannot read a file outside them."""

    def __init__(self, folder: str, roots: Any = None) -> None:
        self.name = folder
        self.dir = Path(folder).expanduser()
        self.roots = roots
        summary = self._file(self.dir / "summary.json")
        if not summary.is_file():
            raise BadInput(f"{folder} is not an eval run folder (no summary.json): give folders written by "
                           f"{op('eval')}", {"run": folder})
        try:
            self.result = EvalResult.model_validate(json.loads(summary.read_text()))
        except (ValueError, ValidationError) as exc:
            raise BadInput(f"{summary} cannot be read as an eval summary: {str(exc).splitlines()[0]}",
                           {"run": folder}) from exc
        prov = self._file(self.dir / "provenance.json")
        try:
            self.config_sha = json.loads(prov.read_text()).get("checkpoint_config_sha256") if prov.is_file() else None
        except ValueError:
            self.config_sha = None
        self._samples: dict[str, list[dict[str, Any]] | None] = {}

    def _file(self, path: Path) -> Path:
        if self.roots is None:
            return path

        try:
            return self.roots.confine(path, "evidence", what=f"run {clip(self.name)}")
        except ValueError as exc:
            raise ToolFailure(str(exc), {"run": self.name}) from None

    def samples(self, task: str) -> list[dict[str, Any]] | None:
        if task not in self._samples:
            path = self.result.files.get(f"samples:{task}")
            p = self._file(self.dir / self._inside(path, task)) if path else None
            if p is None or not p.is_file():
                self._samples[task] = None
            else:
                self._samples[task] = read_samples(p)
        return self._samples[task]

    def _inside(self, path: str, task: str) -> Path:
        """The samples entry relative to the run folder; refused when it leads out of it ('..', another folder)."""
        try:
            rel = Path(path).relative_to(self.result.run_dir)
        except ValueError:
            rel = None
        if rel is None or ".." in rel.parts:
            raise BadInput(f"run {clip(self.name)}: summary.json's samples:{clip(task)} entry {clip(path)} "
                           f"is not a file inside the run folder; compare the run folder {op('eval')} wrote, "
                           f"with its summary.json unchanged", {"run": self.name, "task": task})
        return rel


class Sample(BaseModel):
    """One line of lm-eval's samples JSONL as the comparison reads it; the metrics are the extra fields."""

    model_config = ConfigDict(extra="allow")

    doc_id: StrictInt
    doc_hash: str | None = None
    filter: str = "none"


_SAMPLES = TypeAdapter(Sample)


def read_samples(path: Path) -> list[dict[str, Any]]:
    """A samples JSONL, every line through Sample: one line naming the file, the line and the field otherwise."""
    remedy = f"compare the run folder {op('eval')} wrote, with its samples unchanged"
    lines: list[tuple[int, Any]] = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        lines.append((n, json.loads(line)))
                    except ValueError:
                        raise BadInput(f"{path}: line {n} is not JSON; {remedy}", detail={"path": str(path),
                                       "line": n}, field="runs") from None
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not UTF-8 text (byte {exc.start}); {remedy}", detail={"path": str(path)},
                       field="runs") from None
    return [s.model_dump() for s in validate_lines(path, lines, _SAMPLES, remedy=remedy, field="runs")]


def _per_doc(samples: list[dict[str, Any]] | None, metric: str, filt: str) -> dict[int, tuple[float, str | None]]:
    out: dict[int, tuple[float, str | None]] = {}
    for s in samples or []:
        v = s.get(metric)
        if s.get("filter", "none") != filt or not isinstance(v, (int, float)):
            continue
        out[int(s["doc_id"])] = (float(v), s.get("doc_hash"))
    return out


def paired_difference(ref: dict[int, tuple[float, str | None]], cand: dict[int, tuple[float, str | None]]
                      ) -> tuple[float, float, int, int]:
    """(mean of cand - ref, its standard error, documents paired, documents whose doc_hash differs)."""
    common = sorted(set(ref) & set(cand))
    mismatched = [d for d in common if ref[d][1] and cand[d][1] and ref[d][1] != cand[d][1]]
    ds = [cand[d][0] - ref[d][0] for d in common if d not in mismatched]
    n = len(ds)
    if n == 0:
        return math.nan, math.nan, 0, len(mismatched)
    mean = sum(ds) / n
    if n < 2:
        return mean, math.nan, n, len(mismatched)
    var = sum((d - mean) ** 2 for d in ds) / (n - 1)
    return mean, math.sqrt(var / n), n, len(mismatched)


def compare_evals(params: EvalCompareParams, roots: Any = None) -> EvalComparison:
    """Runs side by side per task and metric; each later run against the first, paired over shared documents.

    roots: the MCP server's (a tools Roots); every file read must then resolve inside its evidence roots."""
    runs = [_Run(r, roots) for r in params.runs]
    ref = runs[0]
    infos = [RunInfo(label=r.result.label, run_dir=str(r.dir), model=r.result.model,
                     checkpoint_config_sha256=r.config_sha) for r in runs]
    keys: list[tuple[str, str, str]] = []
    for r in runs:
        for s in r.result.scores:
            if (s.task, s.metric, s.filter) not in keys:
                keys.append((s.task, s.metric, s.filter))
    rows: list[EvalDiff] = []
    for task, metric, filt in keys:
        scored = [next((s for s in r.result.scores if (s.task, s.metric, s.filter) == (task, metric, filt)), None)
                  for r in runs]
        values = [s.value if s else None for s in scored]
        stderrs = [s.stderr if s else None for s in scored]
        ns = [s.n if s else None for s in scored]
        for i, cand in enumerate(runs[1:], start=1):
            row = EvalDiff(task=task, metric=metric, filter=filt, values=values, stderrs=stderrs, n=ns,
                           candidate=cand.result.label)
            rows.append(row)
            if values[0] is None or values[i] is None:
                row.note = "not scored by both runs"
                continue
            row.diff = values[i] - values[0]
            a = _per_doc(ref.samples(task), metric, filt)
            b = _per_doc(cand.samples(task), metric, filt)
            # Paired only where the per-document values average to the reported metric (mean-aggregated).
            mean_ok = (a and b and abs(sum(v for v, _ in a.values()) / len(a) - values[0]) < 1e-6
                       and abs(sum(v for v, _ in b.values()) / len(b) - values[i]) < 1e-6)
            if mean_ok:
                diff, se, n, bad = paired_difference(a, b)
                row.paired, row.n_paired, row.diff = True, n, diff
                row.diff_stderr = None if math.isnan(se) else se
                if bad:
                    row.note = f"{bad} documents differ between the runs (doc_hash) and were left out"
                if n == 0:
                    row.paired, row.diff, row.note = False, None, "no document scored by both runs"
                    continue
                if n < max(len(a), len(b)):
                    row.note = (row.note + "; " if row.note else "") + f"paired over {n} shared documents"
            else:
                se = [x for x in (stderrs[0], stderrs[i]) if x is not None]
                row.diff_stderr = math.sqrt(sum(x * x for x in se)) if len(se) == 2 else None
                row.note = "per-document values not available: unpaired stderr"
            if row.diff is not None and row.diff_stderr is not None:  # the shared verdict on diff +- 2 stderr
                low, high = row.diff - 2 * row.diff_stderr, row.diff + 2 * row.diff_stderr
                row.within_noise = verdict(low, high, null=0.0) == WITHIN_NOISE
    cmp = EvalComparison(runs=infos, rows=rows)
    cmp.markdown = comparison_markdown(cmp)
    return cmp


def comparison_markdown(cmp: EvalComparison) -> str:
    labels = [r.label for r in cmp.runs]
    ref = labels[0]
    lines = ["# lm-eval comparison", "",
             "Runs: " + ", ".join(f"{r.label} ({r.model}, {r.run_dir})" for r in cmp.runs), "",
             "| task | metric | " + " | ".join(labels) + " | candidate | diff vs " + ref + " | stderr | n paired | "
             "within noise |",
             "|---|---|" + "---:|" * len(labels) + "---|---:|---:|---:|---|"]
    for r in cmp.rows:
        cells = [f"{fmt(v)} ± {fmt(s)}" if v is not None else "—" for v, s in zip(r.values, r.stderrs)]
        verdict = {True: "yes", False: "**no**", None: "—"}[r.within_noise]
        metric = r.metric + (f" ({r.filter})" if r.filter != "none" else "")
        lines.append(f"| {r.task} | {metric} | " + " | ".join(cells) + f" | {r.candidate} | "
                     f"{'—' if r.diff is None else f'{r.diff:+.4f}'} | {fmt(r.diff_stderr)} | "
                     f"{r.n_paired if r.n_paired is not None else '—'} | {verdict} |")
    notes = [f"- {r.task} {r.metric} ({r.candidate}): {r.note}" for r in cmp.rows if r.note]
    lines += ["", "diff: candidate minus the first run, paired over the documents both scored (matched by "
              "doc_id, checked by doc_hash); within noise: |diff| < 2 stderr of the paired difference."]
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"
