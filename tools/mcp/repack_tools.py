"""Repack tools: probe a checkpoint, build the all-4-bit checkpoint (repack/ does the work).

repack.probe and repack.build hold numpy: they load when a tool runs, not when the server lists its tools.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


from tools.mcp.registry import Reply, tool
from repack.params import BuildParams, ProbeParams
from tools.serving.preflight import ensure


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

    report = probe(src, rows_per_tensor=p.rows, roots=list(app.roots.models))
    d = report.to_dict()
    tensors = d.pop("tensors")
    off = [t for t in tensors if t.get("on_grid") is False]
    summary = (f"{src}: verdict {report.verdict}; text tensors {report.text_on_grid} on grid, "
               f"{report.text_off_grid} off")
    # The full per-tensor list runs to hundreds of entries on E2B: the off-grid ones are what an agent acts on.
    return Reply(d, summary, {"tensor_count": len(tensors), "off_grid_tensors": off,
                              "table": report.format_table()})


def _repack_paths(app, p: BuildParams) -> tuple[Path, Path]:
    """The source and output, confined to the models roots; the source's config.json and the free disk."""
    src = app.roots.confine(p.source, "models", must_exist=True, what="source")
    out = app.roots.confine(p.output, "models", what="output")
    ensure("repack", source=src, out=out, force=p.force,  # the build's own refusals, before any write
           protected_roots=[*app.roots.models, *app.roots.evidence])
    return src, out


@tool(toolset="repack", title="Repack a QAT checkpoint to all-4-bit", params=BuildParams, long=True,
      destructive=True, idempotent=True, check=_repack_paths,
      extra={"output": (str, "The written checkpoint folder; pass it to start_vllm_server as model"),
             "tables": (list[dict[str, Any]], "Per table (PLE, embed_tokens, lm_head, linears, rest, towers): "
                                              "bytes, groups, off-grid groups, values exact in runtime fp16 "
                                              "and bf16, errors in bf16 ulps, sign-of-zero changes"),
             "removed_partials": (list[str], "Leftovers of dead builds beside the output, removed first"),
             "table": (str, "The report as a fixed-width table, for people")})
def repack_checkpoint(app, p: BuildParams, progress) -> Reply:
    """Build the all-4-bit checkpoint from a QAT checkpoint in one pass (W4A16 linears, text only, int4 PLE and
    embed_tokens, or embed_int4=false for the bf16-embedding build). Aborts on any off-grid group, leaves nothing
    half written; replaces an existing output only with force=true. Long: progress in bytes."""
    src, out = _repack_paths(app, p)
    from repack.build import build_checkpoint

    opts = p.options()
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
