"""Which tensors of a checkpoint sit on the symmetric 4-bit grid (a QAT export) and which do not (a base model).

Samples rows spread over every 2-D bf16 tensor whose last dimension is a multiple of 32 (and over the experts of a
mixture of experts' fused 3-D weights) and runs the same grid recovery as the build on them; reads only the sampled
rows. What blocks a build is a text tensor off the grid: the towers are never packed (a text-only build drops them,
a multimodal one copies them as they are), so towers off the grid are counted, not listed, unless every tensor is
asked for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import choices
from ..family import drafter, members
from ..family.config import TOWER_PREFIXES
from ..grid import grid
from ..source.checkpoint import open_checkpoint
from ..source.safetensors_io import MappedFile
from . import preview


MEANING = {"qat": "every sampled text tensor sits on the 4-bit grid: a QAT q4_0 export, ready to repack",
           "base": "no sampled text tensor sits on the 4-bit grid: a base (non-QAT) model, not repackable",
           "mixed": "some text tensors are on the grid and some are not: repack would abort",
           "no-candidates": "no 2-D bf16 tensor with a last dimension divisible by 32",
           "packed": "already packed: it holds int4 weight_packed tensors, so it is a build, not a QAT source; serve "
                     "it, or give the bf16 QAT checkpoint it was built from to build again"}


@dataclass
class ProbeTensor:
    name: str
    shape: list[int]
    dtype: str
    tower: bool
    sampled_groups: int = 0
    offgrid_groups: int = 0
    worst_ulps: float | None = None
    on_grid: bool | None = None  # None: not a 4-bit candidate (1-D, not bf16, or last dim not a multiple of 32)


@dataclass
class ProbeReport:
    source: str
    verdict: str  # "qat" (every text tensor on the grid), "base" (none), "mixed", "no-candidates", or "packed"
    text_on_grid: int
    text_off_grid: int
    towers_on_grid: int
    towers_off_grid: int
    sampled_groups: int
    tensors: list[ProbeTensor] = field(default_factory=list)
    drafter: dict[str, Any] | None = None  # a gemma4_assistant drafter: whether its linears are on the grid
    # the member its config.json names and what each build will hold, per table (repack/build/preview.py)
    build_preview: dict[str, Any] | None = None
    packed_tensors: int = 0  # tensors an earlier build stored as int4 (weight_packed): then the verdict is "packed"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def blockers(self) -> list[ProbeTensor]:
        """The text tensors off the grid: the ones the all-4-bit build refuses (towers are never packed)."""
        return [t for t in self.tensors if t.on_grid is False and not t.tower]

    @property
    def meaning(self) -> str:
        return MEANING[self.verdict]

    def summary_dict(self, shown: int = 10) -> dict[str, Any]:
        """The counts and the first `shown` blockers (name, shape, off-grid of sampled groups, worst error):
        what an agent acts on, without the per-tensor listing."""
        d = {k: v for k, v in self.to_dict().items() if k != "tensors"}
        d["meaning"] = self.meaning
        d["tensor_count"] = len(self.tensors)
        d["blockers"] = [{"name": t.name, "shape": t.shape, "offgrid_groups": t.offgrid_groups,
                          "sampled_groups": t.sampled_groups, "worst_ulps": t.worst_ulps}
                         for t in self.blockers()[:shown]]
        return d

    def format_table(self, verbose: bool = False) -> str:
        lines = []
        shown = [t for t in self.tensors if t.on_grid is not None] if verbose else self.blockers()
        for t in shown[: None if verbose else 20]:
            state = "on grid" if t.on_grid else f"OFF grid ({t.offgrid_groups}/{t.sampled_groups} groups)"
            lines.append(f"  {t.name:<72} {state}")
        if len(shown) > len(lines):
            lines.append(f"  ... and {len(shown) - len(lines)} more (--verbose lists all)")
        lines.append(f"text tensors: {self.text_on_grid} on grid, {self.text_off_grid} off grid; towers: "
                     f"{self.towers_on_grid} on grid, {self.towers_off_grid} off grid; "
                     f"{self.sampled_groups:,} groups sampled")
        if self.packed_tensors:
            lines.append(f"{self.packed_tensors} tensors already packed as int4 (weight_packed)")
        lines.append(f"verdict: {self.verdict} - {self.meaning}")
        if self.drafter:
            lines.append(self.drafter["line"])
        if self.build_preview:
            lines += preview.format_preview(self.build_preview)
        return "\n".join(lines)


def probe_checkpoint(src: str | Path, rows_per_tensor: int = 16, scale_dtype: choices.ScaleDtype = "fp16",
                     roots: list[Path] | None = None) -> ProbeReport:
    """roots: when given, every file read must resolve inside one of them (as for a build)."""
    ck = open_checkpoint(src, roots)
    out: list[ProbeTensor] = []
    maps: dict[Path, MappedFile] = {}
    try:
        for name, info in sorted(ck.tensors.items()):
            pt = ProbeTensor(name, list(info.shape), info.dtype, name.startswith(TOWER_PREFIXES))
            out.append(pt)
            # a mixture of experts' fused weights [experts, out, in] are sampled as their experts' rows
            matrix = len(info.shape) == 2 or (len(info.shape) == 3 and members.FUSED_EXPERTS.search(name))
            if info.dtype != "BF16" or not matrix or info.shape[-1] % grid.GROUP or info.numel == 0:
                continue
            cols = info.shape[-1]
            rows = info.numel // cols
            mf = maps.get(info.file) or maps.setdefault(info.file, MappedFile(info.file, info.ident))
            picks = np.unique(np.linspace(0, rows - 1, min(rows, rows_per_tensor)).astype(np.int64))
            block = np.stack([mf.view(info, int(r) * cols * 2, cols * 2).view("<u2") for r in picks])
            _, _, stats = grid.quantize(block, scale_dtype)
            s = grid.GridStats.from_vector(stats)
            pt.sampled_groups, pt.offgrid_groups, pt.worst_ulps = s.groups, s.offgrid, round(s.worst_ulps, 4)
            pt.on_grid = s.offgrid == 0
    finally:
        for m in maps.values():
            m.close()
    text = [t for t in out if t.on_grid is not None and not t.tower]
    towers = [t for t in out if t.on_grid is not None and t.tower]
    on = sum(t.on_grid for t in text)  # type: ignore[misc]
    # a build's bf16 tables left unpacked (the embeddings of a linears-only build) sit on the grid too: what
    # makes it a build is what it already packed
    packed = sum(t.name.endswith(".weight_packed") for t in out)
    verdict = ("packed" if packed else "no-candidates" if not text else "qat" if on == len(text)
               else "base" if on == 0 else "mixed")
    return ProbeReport(str(src), verdict, on, len(text) - on, sum(t.on_grid for t in towers),  # type: ignore[misc]
                       len(towers) - sum(t.on_grid for t in towers), sum(t.sampled_groups for t in out), out,
                       drafter.probe_summary(out, ck.config) if drafter.is_drafter(ck.config) else None,
                       preview.preview(ck), packed)
