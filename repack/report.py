"""The repack report: per table bytes, groups, bit-identity and errors; printed and saved as JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .grid import GridStats

TABLES = ["PLE", "embed_tokens", "lm_head", "linears", "rest", "towers"]


@dataclass
class TableReport:
    name: str
    tensors: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    processed: GridStats = field(default_factory=GridStats)  # groups recovered in this run

    @property
    def identical_pct(self) -> float | None:
        v = self.processed.values
        return 100.0 * self.processed.identical / v if v else None

    @property
    def identical_pct_other(self) -> float | None:
        v = self.processed.values
        return 100.0 * self.processed.identical_other / v if v else None

    def to_dict(self) -> dict[str, Any]:
        p = self.processed
        return {"name": self.name, "tensors": self.tensors, "bytes_before": self.bytes_before,
                "bytes_after": self.bytes_after, "groups": p.groups, "offgrid_groups": p.offgrid,
                "values": p.values, "nonfinite_values": p.nonfinite, "identical_pct": _r(self.identical_pct),
                "identical_pct_other_dtype": _r(self.identical_pct_other),
                "worst_error_ulps": round(p.worst_ulps, 4) if p.groups else None,
                "worst_error_ulps_other_dtype": round(p.worst_ulps_other, 4) if p.groups else None}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


@dataclass
class RepackReport:
    source: str
    output: str
    options: dict[str, Any]
    scale_dtype: str
    other_dtype: str
    implementation: str  # "numba" or "numpy"
    tables: dict[str, TableReport]
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
                "scale_dtype": self.scale_dtype, "other_dtype": self.other_dtype,
                "implementation": self.implementation,
                "tables": [t.to_dict() for t in self.tables.values()],
                "total_bytes_before": before, "total_bytes_after": after,
                "output_shards": self.output_shards, "hardlinked_shards": self.hardlinked_shards,
                "source_bytes": self.source_bytes, "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "wall_s": round(self.wall_s, 3),
                "mb_per_s": round(self.mb_per_s, 1), "peak_rss_bytes": self.peak_rss_bytes,
                "files": self.files, "removed_partials": self.removed_partials}

    def format_table(self) -> str:
        sd, od = self.scale_dtype, self.other_dtype
        head = (f"{'table':<13}{'before':>11}{'after':>11}{'groups':>12}{'off-grid':>9}"
                f"{'identical ' + sd:>16}{'identical ' + od:>16}{'worst ulps':>11}")
        lines = [head, "-" * len(head)]
        for t in self.tables.values():
            if not t.tensors and not t.bytes_before:
                continue
            p = t.processed
            ident = f"{t.identical_pct:.2f}%" if p.values else "-"
            ident_o = f"{t.identical_pct_other:.2f}%" if p.values else "-"
            worst = f"{p.worst_ulps:.2f}" if p.groups else "-"
            lines.append(f"{t.name:<13}{_size(t.bytes_before):>11}{_size(t.bytes_after):>11}{p.groups:>12,}"
                         f"{p.offgrid:>9,}{ident:>16}{ident_o:>16}{worst:>11}")
        d = self.to_dict()
        lines.append("-" * len(head))
        lines.append(f"{'total':<13}{_size(d['total_bytes_before']):>11}{_size(d['total_bytes_after']):>11}")
        for t in self.tables.values():
            if t.processed.nonfinite:
                lines.append(f"warning: {t.name}: {t.processed.nonfinite:,} NaN/inf source values stored as 0")
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

