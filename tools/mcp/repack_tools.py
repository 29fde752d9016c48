"""Repack tools: probe a checkpoint, build the all-4-bit checkpoint (repack/ does the work)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tools.mcp.registry import Reply, tool
from tools.params import OpParams


class ProbeParams(OpParams):
    path: str = Field(description="Checkpoint folder under a models root")


@tool(toolset="repack", title="Probe a checkpoint", params=ProbeParams, read_only=True, idempotent=True,
      extra={"source": (str, "The checkpoint probed"),
             "verdict": (str, "qat: every sampled text tensor is on the 4-bit grid (repack_checkpoint will "
                              "succeed); base, mixed or no-candidates otherwise"),
             "off_grid_tensors": (list[dict[str, Any]], "Text and tower tensors found off the grid"),
             "table": (str, "The report as a fixed-width table, for people")})
def probe_checkpoint(app, p: ProbeParams) -> Reply:
    """Read a checkpoint's config and safetensors headers and sample whether its tensors sit on the 4-bit grid;
    run it before repack_checkpoint. Writes nothing."""
    src = app.roots.confine(p.path, "models", must_exist=True, what="path")
    from repack.probe import probe_checkpoint as probe

    report = probe(src, roots=list(app.roots.models))
    d = report.to_dict()
    tensors = d.pop("tensors")
    off = [t for t in tensors if t.get("on_grid") is False]
    summary = (f"{src}: verdict {report.verdict}; text tensors {report.text_on_grid} on grid, "
               f"{report.text_off_grid} off")
    # The full per-tensor list runs to hundreds of entries on E2B: the off-grid ones are what an agent acts on.
    return Reply(d, summary, {"tensor_count": len(tensors), "off_grid_tensors": off,
                              "table": report.format_table()})


class RepackParams(OpParams):
    source: str = Field(description="QAT checkpoint folder (config.json + safetensors) under a models root")
    output: str = Field(description="Folder to write, under a models root")
    quantize_linears: bool = Field(True, description="Pack every linear layer as W4A16")
    text_only: bool = Field(True, description="Drop vision/audio towers (Gemma4ForCausalLM)")
    embed_int4: bool = Field(True, description="Pack the per-layer embedding table (PLE) as int4")
    embed_tokens: bool | None = Field(None, description="Also pack embed_tokens and write an untied int4 lm_head; "
                                                        "default: same as embed_int4")
    scheme: str = Field("w4a16", description="Build scheme of the linears: w4a16 (the QAT grid, int4) or w8a8 "
                                             "(int8 weights, dynamic int8 activations); the tables stay int4")
    target_dtype: Literal["float16", "bfloat16"] = Field(
        "float16", description="The runtime dtype the scales are chosen and stored for; float16 for the T4")
    objective: Literal["runtime-exact", "min-error"] | None = Field(
        None, description="Scale choice: most values exact in the target's arithmetic, or least squared error; "
                          "default: the library's (see the README)")
    force: bool = Field(False, description="Replace an empty folder or exactly a build this tool wrote")


@tool(toolset="repack", title="Repack a QAT checkpoint to all-4-bit", params=RepackParams, long=True,
      destructive=True, idempotent=True,
      extra={"output": (str, "The written checkpoint folder; pass it to start_vllm_server as model"),
             "tables": (list[dict[str, Any]], "Per table (PLE, embed_tokens, lm_head, linears, rest, towers): "
                                              "bytes, groups, off-grid groups, values exact in runtime fp16 "
                                              "and bf16, errors in bf16 ulps, sign-of-zero changes"),
             "removed_partials": (list[str], "Leftovers of dead builds beside the output, removed first"),
             "table": (str, "The report as a fixed-width table, for people")})
def repack_checkpoint(app, p: RepackParams, progress) -> Reply:
    """Build the all-4-bit checkpoint from a QAT checkpoint in one pass (W4A16 linears, text only, int4 PLE and
    embed_tokens, or embed_int4=false for the bf16-embedding build). Aborts on any off-grid group, leaves nothing
    half written; replaces an existing output only with force=true. Long: progress in bytes."""
    src = app.roots.confine(p.source, "models", must_exist=True, what="source")
    out = app.roots.confine(p.output, "models", what="output")
    from repack.build import BuildOptions, build_checkpoint
    from tools.serving.preflight import ensure

    ensure("repack", source=src, out=out)  # the source's config.json and free disk: refused before any write

    from repack.grid import DEFAULT_OBJECTIVE

    opts = BuildOptions(quantize_linears=p.quantize_linears, text_only=p.text_only, embed_int4=p.embed_int4,
                        embed_tokens=p.embed_int4 if p.embed_tokens is None else p.embed_tokens,
                        target_dtype=p.target_dtype, objective=p.objective or DEFAULT_OBJECTIVE, force=p.force,
                        scheme=p.scheme)
    # a root itself, or a folder above one, is never an output (repack refuses, naming it)
    report = build_checkpoint(src, out, opts, progress=lambda d, t, m: progress(d, t, m),
                              protected_roots=[*app.roots.models, *app.roots.evidence], roots=list(app.roots.models))
    d = report.to_dict()
    off = sum(t["offgrid_groups"] for t in d["tables"])
    nonfinite = sum(t.get("nonfinite_values") or 0 for t in d["tables"])
    summary = (f"wrote {out}: {d['total_bytes_before'] / 2**20:.1f} -> {d['total_bytes_after'] / 2**20:.1f} MiB "
               f"in {d['wall_s']:.1f} s, {off} off-grid groups"
               + (f", {nonfinite} NaN/inf source values" if nonfinite else ""))
    return Reply(d, summary, {"table": report.format_table()})
