"""The parameters of `python -m repack build|probe`, of the article's three step scripts and of the MCP tools
`repack_checkpoint` / `probe_checkpoint`: one model each, the flags and the tool signature derived from it."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator

from tools.core.params import OpParams

from .choices import DEFAULT_OBJECTIVE, DEFAULT_SCHEME, Objective, ScaleDtype, Target
from .errors import RepackError

MAX_SHARD_GIB = 1 << 20  # a pebibyte: far above any checkpoint, so one shard holds all of it


class BuildParams(OpParams):
    """One build: which tables are packed, how the scales are chosen, where it goes."""

    source: str = Field(description="QAT checkpoint folder (config.json + safetensors)")
    output: str = Field(description="Folder to write")
    quantize_linears: bool = Field(True, description="Pack every linear layer with the build scheme "
                                                     "(false: leave them bf16)")
    text_only: bool = Field(False, description="Drop the vision/audio towers (Gemma4ForCausalLM)")
    embed_int4: bool = Field(False, description="Pack the per-layer embedding table (PLE) as int4")
    embed_tokens: bool | None = Field(None, description="With embed_int4: also pack embed_tokens and write it "
                                                        "again as an untied int4 lm_head")
    scheme: str = Field(DEFAULT_SCHEME, description="How the linear layers are quantized: a scheme registered in "
                                                    "repack/schemes (w4a16: the QAT grid, int4; w8a8: int8 weights "
                                                    "and activations); the tables stay int4")
    target_dtype: Target | None = Field(
        None, description="The dtype the model is served in, whose arithmetic the scales are chosen for; the "
                          "scales are stored in it (default float16: the T4 computes fp16(level*scale))")
    objective: Objective = Field(
        DEFAULT_OBJECTIVE, description="min-error: least squared error in the target's arithmetic; "
                                            "runtime-exact: most values exact in it, ties by squared error")
    scale_dtype: ScaleDtype | None = Field(
        None, description="Older spelling of --target-dtype: fp16 = float16, bf16 = bfloat16")
    # bounded above so that the size in bytes stays an integer (a float beyond ~1.7e299 GiB is infinite in bytes)
    max_shard_size: float = Field(2.0, gt=0, le=MAX_SHARD_GIB, allow_inf_nan=False,
                                  description="Output shard size in GiB")
    force: bool = Field(False, description="Replace an empty folder or exactly a build this tool wrote")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("source", "output")
    CLI_BAD_INPUT: ClassVar[type[Exception] | None] = RepackError
    # The command line keeps the article's opt-in flags; through MCP the all-4-bit build is the default, and
    # embed_tokens left unset follows embed_int4 there (the command line asks for it by name).
    CLI_DEFAULTS: ClassVar[dict[str, Any]] = {"embed_tokens": False}
    MCP_DEFAULTS: ClassVar[dict[str, Any]] = {"text_only": True, "embed_int4": True}
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"scale_dtype", "max_shard_size"})

    @field_validator("max_shard_size")
    @classmethod
    def _at_least_a_byte(cls, v: float) -> float:
        if v * (1 << 30) < 1:
            raise ValueError("must be at least one byte (a size in GiB, e.g. 2 or 0.5)")
        return v

    @field_validator("scheme")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        from . import schemes

        schemes.get(v)  # refuses an unknown name, listing the choices
        return v

    def options(self) -> Any:
        """The library's BuildOptions (it checks the combinations: embed_tokens without embed_int4, a scale
        dtype that contradicts the target)."""
        from .build import BuildOptions

        return BuildOptions(quantize_linears=self.quantize_linears, text_only=self.text_only,
                            embed_int4=self.embed_int4,
                            embed_tokens=self.embed_int4 if self.embed_tokens is None else self.embed_tokens,
                            scheme=self.scheme, target_dtype=self.target_dtype, objective=self.objective,
                            scale_dtype=self.scale_dtype, force=self.force,
                            max_shard_bytes=int(self.max_shard_size * (1 << 30)))


class ProbeParams(OpParams):
    """Whether a checkpoint's tensors sit on the 4-bit grid; reads headers and sampled rows only."""

    path: str = Field(description="Checkpoint folder (config.json + safetensors)")
    rows: int = Field(16, ge=1, le=1 << 20, description="Rows sampled per tensor")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("path",)
    CLI_BAD_INPUT: ClassVar[type[Exception] | None] = RepackError


__all__ = ["BuildParams", "ProbeParams"]
