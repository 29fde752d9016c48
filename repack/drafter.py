"""Google's speculative-decoding drafter (`gemma4_assistant`, served by vLLM as `gemma4_mtp`) as a repack source.

A drafter is a small text model beside the target: a `text_config` like a multimodal checkpoint's, but its
tensors are named `model.*`, `pre_projection.*` and `post_projection.*`, it has no towers and its head is tied to
its own (draft-width) embedding. The build packs its linear layers exactly as the target's (compressed-tensors
`pack-quantized` int4, groups of 32: repack.schemes' w4a16), recovering the QAT grid; it never quantizes, so a
drafter whose linears are off the grid is refused before anything is written. Its embedding (which is also its
head, and which vLLM replaces with the target's for the input side) stays bf16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from tools.core.errors import param

from .errors import RepackError, clip

MODEL_TYPE = "gemma4_assistant"
ARCHITECTURE = "Gemma4AssistantForCausalLM"
SCHEME = "w4a16"  # the target's scheme: the only one that recovers the grid rather than quantizing
EMBEDDING = "model.embed_tokens.weight"


def is_drafter(config: dict[str, Any]) -> bool:
    """Whether a config.json is a gemma4_assistant drafter's."""
    archs = config.get("architectures")
    return config.get("model_type") == MODEL_TYPE or (isinstance(archs, list) and ARCHITECTURE in archs)


def table(name: str, shape: Sequence[int]) -> tuple[str, bool]:
    """A drafter tensor's report table, and whether the build packs it: every 2-D weight but the embedding is a
    linear layer's (pre/post projection, attention, MLP); norms and layer scalars are 1-D."""
    if name == EMBEDDING:
        return "embed_tokens", False
    if name.endswith(".weight") and len(shape) >= 2:
        return "linears", True
    return "rest", False


class _Probed(Protocol):  # repack.probe.ProbeTensor, as far as the drafter's verdict reads it
    name: str
    shape: list[int]
    on_grid: bool | None
    offgrid_groups: int
    sampled_groups: int


@dataclass
class DrafterGrid:
    """Whether a drafter's linear layers (what the build packs) sit on the 4-bit grid."""

    linears_on_grid: int
    linears_off_grid: int
    not_candidates: int  # linears the probe could not test (not bf16, or not groups of 32): the build refuses them
    first_off: str | None

    @property
    def packable(self) -> bool:
        return self.linears_on_grid > 0 and not self.linears_off_grid and not self.not_candidates

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, "linears_on_grid": self.linears_on_grid,
                "linears_off_grid": self.linears_off_grid, "packable": self.packable}

    def line(self) -> str:
        what = (f"{MODEL_TYPE} drafter: {self.linears_on_grid} linear layers on the 4-bit grid, "
                f"{self.linears_off_grid} off")
        if self.packable:
            return what + "; repack packs them int4 (its embedding, which is its head, stays bf16)"
        return what + "; not a QAT drafter: repack refuses it (it does not quantize)"


def grid_verdict(tensors: Sequence[_Probed]) -> DrafterGrid:
    linears = [t for t in tensors if table(t.name, t.shape) == ("linears", True)]
    off = [t for t in linears if t.on_grid is False]
    return DrafterGrid(sum(t.on_grid is True for t in linears), len(off),
                       sum(t.on_grid is None for t in linears), off[0].name if off else None)


def probe_summary(tensors: Sequence[_Probed]) -> dict[str, Any]:
    """The probe report's drafter entry: the linears' verdict and its line."""
    g = grid_verdict(tensors)
    return {**g.to_dict(), "line": g.line()}


def check_buildable(src: Path, grid: DrafterGrid, scheme: str) -> None:
    """Refuses, in one line, a drafter build that would quantize: another scheme than the target's, or linear
    layers off the grid (found by the probe's sample; the build itself stops at any other off-grid group)."""
    if scheme != SCHEME:
        raise RepackError(f"{clip(src)}: a {MODEL_TYPE} drafter is packed as the target is ({param('scheme')} "
                          f"{SCHEME}); {scheme} would quantize it", {"file": clip(src), "problem": "drafter-scheme"},
                          field="scheme")
    if grid.linears_off_grid:
        raise RepackError(f"{clip(src)}: a {MODEL_TYPE} drafter whose linear layers are off the 4-bit grid "
                          f"({grid.linears_off_grid} of {grid.linears_on_grid + grid.linears_off_grid} sampled, e.g. "
                          f"{clip(grid.first_off or '', 100)}): repack recovers a QAT grid and does not quantize; "
                          f"give a drafter trained on the grid (QAT)",
                          {"file": clip(src), "tensor": clip(grid.first_off or ""), "problem": "drafter-off-grid"})


__all__ = ["ARCHITECTURE", "MODEL_TYPE", "SCHEME", "DrafterGrid", "check_buildable", "grid_verdict", "is_drafter",
           "probe_summary", "table"]
