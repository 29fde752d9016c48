"""The repack report: per table bytes, groups, and what the GPU will compute; printed and saved as JSON.

Every fidelity figure is about the runtime: T(level * scale), the value the GPU computes in the model's dtype T
(`fp16(q*s)` on a T4 serving float16, `bf16(q*s)` serving bfloat16), against the source value:
- exact: equal in value (-0 equals +0, as the article counts); a -0 source value comes back as +0 (a 4-bit level
  carries no sign of zero), counted on its own as zero_sign_changes;
- mean and max error in bf16 ulps of the source value; relative L2 = ||runtime - source|| / ||source||.
The figures are given for the build's target dtype and for the other dtype, the latter with the scales a build
for that dtype would store (`--target-dtype` of the other dtype, same objective), over the groups of its sample
(`--other-dtype-sample N`: one run of 64 groups in N; `values_runtime_X` says how many values they hold): its
exact share and mean error estimate the whole table's, its max error is the sample's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..grid.grid import DEFAULT_OBJECTIVE, GridStats

TABLES = ["PLE", "embed_tokens", "lm_head", "linears", "experts", "rest", "towers"]
SHORT = {"float16": "fp16", "bfloat16": "bf16"}


@dataclass
class RuntimeFigures:
    exact: int
    exact_pct: float | None
    mean_err_ulp: float | None
    max_err_ulp: float | None
    rel_l2: float | None


@dataclass
class TableReport:
    name: str
    tensors: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    processed: GridStats = field(default_factory=GridStats)  # groups recovered in this run
    target_dtype: str = "float16"

    def runtime(self, dtype: str) -> RuntimeFigures:
        """The figures in the runtime of `dtype` (float16 or bfloat16)."""
        p = self.processed
        own = dtype == self.target_dtype
        n = p.exact if own else p.exact_other
        values, src = self.values_in(dtype), p.sq_src if own else p.sq_src_other
        if not values:
            return RuntimeFigures(n, None, None, None, None)
        sq = p.sq_err if own else p.sq_err_other
        return RuntimeFigures(
            exact=n, exact_pct=100.0 * n / values,
            mean_err_ulp=(p.err_ulps_sum if own else p.err_ulps_sum_other) / values,
            max_err_ulp=p.worst_ulps if own else p.worst_ulps_other,
            rel_l2=math.sqrt(sq / src) if src > 0 else (0.0 if sq == 0 else math.inf))

    def values_in(self, dtype: str) -> int:
        """How many values the figures of `dtype` are over: all for the target, the sample's for the other."""
        return self.processed.values if dtype == self.target_dtype else self.processed.values_other

    def to_dict(self) -> dict[str, Any]:
        p = self.processed
        d: dict[str, Any] = {"name": self.name, "tensors": self.tensors, "bytes_before": self.bytes_before,
                             "bytes_after": self.bytes_after, "groups": p.groups, "offgrid_groups": p.offgrid,
                             "values": p.values, "nonfinite_values": p.nonfinite, "zero_sign_changes": p.negzero}
        for dtype in ("float16", "bfloat16"):
            f = self.runtime(dtype)
            k = SHORT[dtype]
            d[f"values_runtime_{k}"] = self.values_in(dtype)
            d[f"exact_runtime_{k}"] = f.exact
            d[f"exact_runtime_{k}_pct"] = _r(f.exact_pct)
            d[f"mean_err_ulp_bf16_runtime_{k}"] = _r(f.mean_err_ulp, 6)
            d[f"max_err_ulp_bf16_runtime_{k}"] = _r(f.max_err_ulp)
            d[f"rel_l2_runtime_{k}"] = None if f.rel_l2 is None else float(f"{f.rel_l2:.6g}")
        return d


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


@dataclass
class RepackReport:
    source: str
    output: str
    options: dict[str, Any]
    scale_dtype: str   # the stored scales' dtype: fp16 for a float16 target, bf16 for bfloat16
    other_dtype: str   # the other target dtype, whose figures are given for comparison
    implementation: str  # "numba" or "numpy"
    tables: dict[str, TableReport]
    target_dtype: str = "float16"
    objective: str = DEFAULT_OBJECTIVE
    output_shards: int = 0
    hardlinked_shards: int = 0
    source_bytes: int = 0      # every tensor of the source checkpoint
    bytes_read: int = 0        # the tensors this run read (dropped towers are never read)
    bytes_written: int = 0
    wall_s: float = 0.0
    peak_rss_bytes: int = 0
    files: list[str] = field(default_factory=list)             # every file of the output folder
    removed_partials: list[str] = field(default_factory=list)  # dead builds' leftovers removed beside it

    @property
    def mb_per_s(self) -> float:
        return self.bytes_read / 1e6 / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        before = sum(t.bytes_before for t in self.tables.values())
        after = sum(t.bytes_after for t in self.tables.values())
        return {"source": self.source, "output": self.output, "options": self.options,
                "target_dtype": self.target_dtype, "objective": self.objective,
                "scale_dtype": self.scale_dtype, "other_dtype": self.other_dtype,
                "runtime_figures": "exact_runtime_X: values whose X(level*scale) equals the source in value "
                                   "(-0 == +0), of values_runtime_X; errors in bf16 ulps of the source; the "
                                   "target's figures use the stored scales over every value, the other dtype's "
                                   "the scales a build for it would store, over its sample (other_dtype_sample)",
                "other_dtype_sample": self.options.get("other_dtype_sample", 1),  # reports before it: every group
                "implementation": self.implementation,
                "tables": [t.to_dict() for t in self.tables.values()],
                "total_bytes_before": before, "total_bytes_after": after,
                "output_shards": self.output_shards, "hardlinked_shards": self.hardlinked_shards,
                "source_bytes": self.source_bytes, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "wall_s": round(self.wall_s, 3),
                "mb_per_s": round(self.mb_per_s, 1), "peak_rss_bytes": self.peak_rss_bytes,
                "files": self.files, "removed_partials": self.removed_partials}

    def format_table(self) -> str:
        order = [self.target_dtype] + [d for d in ("float16", "bfloat16") if d != self.target_dtype]
        block = f"{'exact':>9}{'mean ulp':>9}{'max ulp':>8}{'rel L2':>10}"
        every = self.options.get("other_dtype_sample", 1)
        sample = "" if every == 1 else " (none)" if not every else f" (sample 1 in {every})"
        titles = [f" runtime {SHORT[d]}{' (target)' if d == self.target_dtype else sample} " for d in order]
        left = f"{'table':<13}{'before':>11}{'after':>11}{'groups':>12}{'off-grid':>9}"
        top = " " * len(left) + "".join(f"  {t:-^{len(block) - 2}}" for t in titles)
        head = left + "".join(block for _ in order) + f"{'-0 -> +0':>10}"
        lines = [f"target {self.target_dtype} ({self.scale_dtype} scales), objective {self.objective}; "
                 f"runtime X: what the GPU computes in X, exact = equal in value; errors in bf16 ulps",
                 top, head, "-" * len(head)]
        for t in self.tables.values():
            if not t.tensors and not t.bytes_before:
                continue
            p = t.processed
            row = f"{t.name:<13}{_size(t.bytes_before):>11}{_size(t.bytes_after):>11}{p.groups:>12,}{p.offgrid:>9,}"
            for d in order:
                f = t.runtime(d)
                if f.exact_pct is None:
                    row += f"{'-':>9}{'-':>9}{'-':>8}{'-':>10}"
                else:
                    row += f"{f.exact_pct:>8.2f}%{f.mean_err_ulp:>9.3f}{f.max_err_ulp:>8.2f}{f.rel_l2:>10.2e}"
            row += f"{p.negzero:>10,}" if p.values else f"{'-':>10}"
            lines.append(row)
        d = self.to_dict()
        lines.append("-" * len(head))
        lines.append(f"{'total':<13}{_size(d['total_bytes_before']):>11}{_size(d['total_bytes_after']):>11}")
        other = SHORT[order[1]]
        lines.append(f"runtime {other}: with the scales a --target-dtype {order[1]} build would store"
                     + ("" if every == 1 else f", over one run of 64 groups in {every} (--other-dtype-sample)"
                        if every else " (not computed: --other-dtype-sample 0)")
                     + "; -0 -> +0: source -0 values that come back +0 (counted exact)")
        lines.append(f"{self.output_shards} shards ({self.hardlinked_shards} hard-linked), "
                     f"read {_size(self.bytes_read)} in {self.wall_s:.2f} s = {self.mb_per_s:.0f} MB/s, "
                     f"peak RSS {_size(self.peak_rss_bytes)}, grid kernel {self.implementation}")
        return "\n".join(lines)


def _size(n: int) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.3f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"
