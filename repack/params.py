"""The build options and the parameters of `python -m repack build|probe`, of the article's three step scripts,
of `python -m repack.tiny_model` and of the MCP tools `repack_checkpoint` / `probe_checkpoint` /
`make_tiny_model`: one model each, the flags and the tool signature derived from it.

`BuildOptions` is the one options model: the library's defaults are its defaults (the all-4-bit build); where the
command line's defaults differ (the article's opt-in flags) the model says so in CLI_DEFAULTS. `BuildParams` is
the same options plus the source and output folders of one operation.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from tools.core.errors import param
from tools.core.params import OpParams

from .choices import (DEFAULT_OBJECTIVE, DEFAULT_SCHEME, DEFAULT_TARGET, OBJECTIVES, SCHEMES, TARGETS, Objective,
                      ScaleDtype, Target)
from .errors import RepackError, clip, unknown_scheme
from .stand_ins.tiny_shapes import SHAPE_NAMES, Shape

# The report's other-dtype figures from one run of 64 groups in 8 (grid.in_other_sample): that search costs about
# what the target's own does (evidence/repack-bench.md); 1 gives every group's
OTHER_DTYPE_SAMPLE = 8
MAX_OTHER_DTYPE_SAMPLE = 1 << 20
MAX_SHARD_GIB = 1 << 20  # a pebibyte: far above any checkpoint, so one shard holds all of it
SCALE_DTYPES = ("fp16", "bf16")
_TARGET_OF = {"fp16": "float16", "bf16": "bfloat16"}
_SCALE_OF = {v: k for k, v in _TARGET_OF.items()}


class BuildOptions(OpParams):
    """One build: which tables are packed, how the scales are chosen, how it is written."""

    quantize_linears: bool = Field(True, description="Pack the linear layers (false: bf16)")
    text_only: bool = Field(True, description="Drop the vision/audio towers (Gemma4ForCausalLM)")
    embed_int4: bool = Field(True, description="Pack the per-layer embedding table (PLE) as int4")
    # None: follows embed_int4 (the all-4-bit build packs both); resolved when the model is made
    embed_tokens: bool | None = Field(None, description="With embed_int4: also pack embed_tokens "
                                                        "(and an untied int4 lm_head)")
    # The runtime dtype the scales are chosen for (float16: the T4); the stored scale dtype follows it
    # (scale_dtype is the older spelling: fp16 = float16, bf16 = bfloat16).
    target_dtype: Target | None = Field(
        None, description="Serving dtype the scales are chosen for and stored in (default float16: the T4)")
    objective: Objective = Field(
        DEFAULT_OBJECTIVE, description="min-error: least squared error; runtime-exact: most values exact (in "
                                       "the target's arithmetic)")
    scale_dtype: ScaleDtype | None = Field(
        None, description="Older spelling of --target-dtype: fp16 = float16, bf16 = bfloat16")
    other_dtype_sample: int = Field(
        OTHER_DTYPE_SAMPLE, ge=0, le=MAX_OTHER_DTYPE_SAMPLE,
        description="The report's figures for the other serving dtype from one run of 64 groups in N (1: every "
                    "group, slower; 0: none)")
    force: bool = Field(False, description="Replace an empty folder or exactly a build this tool wrote")
    # bounded above so that the size in bytes stays an integer (a float beyond ~1.7e299 GiB is infinite in bytes)
    max_shard_size: float = Field(2.0, gt=0, le=MAX_SHARD_GIB, allow_inf_nan=False,
                                  description="Output shard size in GiB")
    threads: int = Field(0, ge=0, description="Worker threads (0: one per available core)")
    scheme: str = Field(DEFAULT_SCHEME, description="Linear layers: w4a16 (the QAT grid, int4) or w8a8 "
                                                    "(int8 weights and activations)")

    CLI_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"threads"})
    # The command line keeps the article's opt-in flags (embed_tokens too is asked for by name there); the
    # library and MCP build all-4-bit by default.
    CLI_DEFAULTS: ClassVar[dict[str, Any]] = {"text_only": False, "embed_int4": False, "embed_tokens": False}
    # other_dtype_sample: the MCP result gives the target's figures only (the rest are in the report file)
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"scale_dtype", "max_shard_size", "threads",
                                                       "other_dtype_sample"})

    @field_validator("max_shard_size")
    @classmethod
    def _at_least_a_byte(cls, v: float) -> float:
        if v * (1 << 30) < 1:
            raise ValueError("must be at least one byte (a size in GiB, e.g. 2 or 0.5)")
        return v

    @field_validator("scheme", mode="before")
    @classmethod
    def _known_scheme(cls, v: Any) -> Any:
        if not isinstance(v, str) or v not in SCHEMES:
            raise unknown_scheme(v, sorted(SCHEMES))
        return v

    # before pydantic's own check of the Literal: the library's one-line error, naming the parameter
    @field_validator("scale_dtype", mode="before")
    @classmethod
    def _known_scale_dtype(cls, v: Any) -> Any:
        if v is not None and v not in SCALE_DTYPES:
            raise RepackError(f"{param('scale_dtype')} {clip(repr(v))}: choose fp16 or bf16", field="scale_dtype")
        return v

    @field_validator("target_dtype", mode="before")
    @classmethod
    def _known_target(cls, v: Any) -> Any:
        if v is not None and v not in TARGETS:
            raise RepackError(f"{param('target_dtype')} {clip(repr(v))}: choose float16 or bfloat16",
                              field="target_dtype")
        return v

    @field_validator("objective", mode="before")
    @classmethod
    def _known_objective(cls, v: Any) -> Any:
        if v not in OBJECTIVES:
            raise RepackError(f"{param('objective')} {clip(repr(v))}: choose runtime-exact or min-error",
                              field="objective")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "BuildOptions":
        if self.target_dtype is None:
            self.target_dtype = _TARGET_OF[self.scale_dtype] if self.scale_dtype else DEFAULT_TARGET
        elif self.scale_dtype is not None and _TARGET_OF[self.scale_dtype] != self.target_dtype:
            raise RepackError(f"{param('scale_dtype')} {self.scale_dtype} does not match {param('target_dtype')} "
                              f"{self.target_dtype}: the stored scales follow the target (float16: fp16, "
                              f"bfloat16: bf16); pass {param('target_dtype')} alone", field="scale_dtype")
        self.scale_dtype = _SCALE_OF[self.target_dtype]  # type: ignore[index]
        if self.embed_tokens is None:
            self.embed_tokens = self.embed_int4
        if self.embed_tokens and not self.embed_int4:
            raise RepackError(f"{param('embed_tokens')} needs {param('embed_int4')} (embed_tokens is packed with "
                              f"the PLE table)", field="embed_tokens")
        return self

    @property
    def max_shard_bytes(self) -> int:
        return int(self.max_shard_size * (1 << 30))

    def report_dict(self) -> dict[str, Any]:
        """The options as the build report records them (the shard size in bytes)."""
        return {("max_shard_bytes" if k == "max_shard_size" else k): (self.max_shard_bytes if k == "max_shard_size"
                                                                       else v) for k, v in self.model_dump().items()}


class BuildParams(BuildOptions):
    """One build operation: the options, the source and where it goes."""

    source: str = Field(description="QAT checkpoint folder")
    output: str = Field(description="Folder to write")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("source", "output")

    def options(self) -> BuildOptions:
        """The build options of this operation (already checked when the parameters were)."""
        return BuildOptions.model_validate(self.model_dump(exclude={"source", "output"}))


class ProbeParams(OpParams):
    """Whether a checkpoint's tensors sit on the 4-bit grid; reads headers and sampled rows only."""

    path: str = Field(description="Checkpoint folder (config.json + safetensors)")
    rows: int = Field(16, ge=1, le=1 << 20, description="Rows sampled per tensor")
    detail: bool = Field(False, description="Also list every tensor, in pages")
    page: int = Field(1, ge=1, description="Page (detail)")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("path",)
    # the command line has --verbose and --json, and prints the whole list
    CLI_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"detail", "page"})


class TinyModelParams(OpParams):
    """The tiny stand-in source: where it goes and the member it is shaped as (repack.stand_ins.tiny_shapes)."""

    # short: every MCP client pays for the default tools' descriptions (tests/mcp/test_mcp_tools.py)
    out: str = Field(description="Folder to write")
    force: bool = Field(False, description="Replace a folder this tool wrote")
    shape: Shape = Field("e2b", description="Member it mimics")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("out",)

    # before pydantic's own check of the Literal: one line naming the parameter and the choices
    @field_validator("shape", mode="before")
    @classmethod
    def _known_shape(cls, v: Any) -> Any:
        if v not in SHAPE_NAMES:
            raise RepackError(f"{param('shape')} {clip(repr(v))}: choose {', '.join(SHAPE_NAMES)}", field="shape")
        return v


__all__ = ["BuildOptions", "BuildParams", "MAX_SHARD_GIB", "ProbeParams", "TinyModelParams"]
