"""The names a build is chosen by (no numpy here: the MCP server's parameter models import this module)."""

from __future__ import annotations

from typing import Literal, get_args

ScaleDtype = Literal["fp16", "bf16"]
Target = Literal["float16", "bfloat16"]
Objective = Literal["runtime-exact", "min-error"]
TARGETS: tuple[str, ...] = get_args(Target)
OBJECTIVES: tuple[str, ...] = get_args(Objective)
DEFAULT_TARGET: Target = "float16"  # the T4 computes in fp16
DEFAULT_OBJECTIVE: Objective = "min-error"  # lower KLD vs the source (evidence/fidelity-objectives.md); set here only
DEFAULT_SCHEME = "w4a16"
# The build schemes repack/schemes registers, named here so that the parameter models can check a name without
# importing the schemes (numpy); the package checks at import that this list is what it registers.
SCHEMES: tuple[str, ...] = ("w4a16", "w8a8")
