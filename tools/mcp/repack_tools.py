"""Repack tools: make the tiny stand-in source, probe a checkpoint, build the all-4-bit checkpoint (repack/ does
the work).

repack.build.probe and repack.build hold numpy, the tiny model torch: they load when a tool runs, not when the server
lists its tools.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar


from repack.stand_ins import tiny_marker, tiny_model
from repack.build.fit import PlanParams, plan_fit as plan
from repack.params import BuildParams, ProbeParams, TinyModelParams
from tools.core.atomic import REPORT
from tools.core.errors import BadInput, ToolFailure, param
from tools.core.paths import PathNotAllowed
from tools.mcp.bounded import RESULT_BUDGET, pages, size
from tools.mcp.registry import Reply, tool
from tools.serving import TINY_SOURCE, ensure, make_source


def _source(app, path: str, what: str) -> Path:
    """A source folder confined to the models roots; a missing one is refused with the call that makes it on
    this platform (the stand-in on CPU, the hub's checkpoint on a GPU)."""
    try:
        return app.roots.confine(path, "models", must_exist=True, what=what)
    except PathNotAllowed as exc:
        if exc.detail["problem"] != "missing":
            raise
        raise ToolFailure(f"{exc}: make it with {make_source(exc.detail['input'], app.platform())}",
                          detail=exc.detail) from None


class TinyParams(TinyModelParams):
    """The command line's parameters (`python -m repack.tiny_model`); out lies under a models root."""

    MCP_DEFAULTS: ClassVar[dict[str, Any]] = {"out": TINY_SOURCE}


def _tiny_out(app, p: TinyParams) -> Path:
    """The output under a models root, never a root itself; an existing one only with force=true, and only one
    this tool wrote (its marker file), since the build replaces the folder whole."""
    out = app.roots.confine(p.out, "models", what="out")
    if any(r.is_relative_to(out) for r in [*app.roots.models, *app.roots.evidence]):
        raise BadInput(f"{param('out')} {out} is a root or holds one: give a folder under a models root",
                       field="out")
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        if not p.force:
            raise BadInput(f"{param('out')} {out} exists: pass {param('force', True)} to replace it, or choose "
                           f"another", field="out")
        why = tiny_marker.not_replaceable(out)  # its own marker: a config.json is any checkpoint's, a build's too
        if why:
            raise BadInput(f"{param('out')} {out} exists and {param('force', True)} replaces only a folder this "
                           f"tool wrote: {why}; choose another or move it away", field="out")
    return out


@tool(toolset="repack", title="Make the tiny stand-in", params=TinyParams, long=True, destructive=True,
      idempotent=True, check=_tiny_out,
      extra={"path": (str, "Probe and repack it"),
             "accuracy": (float, "Greedy accuracy on its pattern"),
             "shape": (str, "")}, ops="tiny_model")
def make_tiny_model(app, p: TinyParams, progress, checked: Path) -> Reply:
    """Write a tiny Gemma-4-shaped QAT source: the CPU walk needs no real checkpoint. Long."""
    out = checked
    progress(0, 1, f"building the tiny {p.shape}-shaped QAT source in {out}")
    info = tiny_model.cached_tiny_qat_checkpoint(out, shape=p.shape)
    progress(1, 1, f"wrote {out}")
    return Reply({}, f"wrote the tiny QAT source {out}, shaped as {p.shape}: {len(info.grid_tensors)} tensors on "
                     f"the 4-bit grid",
                 {"path": str(out), "accuracy": info.accuracy, "grid_tensors": len(info.grid_tensors),
                  "shape": p.shape})


@tool(toolset="repack", title="Probe a checkpoint", params=ProbeParams, read_only=True, idempotent=True,
      extra={"source": (str, ""),
             "verdict": (str, "qat: repack_checkpoint will succeed; base, mixed, no-candidates or packed (already "
                              "a build) otherwise"),
             "blockers": (list[dict[str, Any]], "The first text tensors off the grid (text_off_grid counts all)"),
             "tensors": (list[dict[str, Any]] | None, "With detail=true: a page of the tensors")},
      ops="probe")
def probe_checkpoint(app, p: ProbeParams) -> Reply:
    """Check that a source's tensors sit on the 4-bit grid (verdict qat) before repack_checkpoint. Writes
    nothing."""
    src = _source(app, p.path, "path")
    from repack.build.probe import probe_checkpoint as probe

    report = probe(src, rows_per_tensor=p.rows, roots=list(app.roots.models))
    summary = (f"{src}: verdict {report.verdict}; text tensors {report.text_on_grid} on grid, "
               f"{report.text_off_grid} off"
               + (f"; {report.towers_off_grid} tower tensors off it, never packed" if report.towers_off_grid else ""))
    # The per-tensor list runs to hundreds of entries on E2B (36-58K characters), and the towers are never packed:
    # by default only what blocks a build; with detail=true the tensors in pages that keep each answer within
    # RESULT_BUDGET, each naming the next.
    head = report.summary_dict()
    if not p.detail:
        return Reply(head, summary)
    room = RESULT_BUDGET - size({"summary": summary, **head}) - 400  # the page fields and the result's framing
    tensors = report.to_dict()["tensors"]
    book = pages([json.dumps(t, separators=(",", ":")) for t in tensors], max(room, 600))
    if p.page > len(book):
        raise BadInput(f"{param('page', p.page)}: the tensors take {len(book)} page(s); pass 1 to {len(book)}",
                       {"pages": len(book)}, field="page")
    n = p.page
    first = sum(len(pg) for pg in book[:n - 1])
    shown = tensors[first:first + len(book[n - 1])]
    more = f": page={n + 1} for the next" if n < len(book) else ", the last"
    return Reply(head, summary + f"; tensors {first + 1}-{first + len(shown)} of {len(tensors)} (page {n} of "
                 f"{len(book)}{more})", {"tensors": shown})


def _repack_paths(app, p: BuildParams) -> tuple[Path, Path]:
    """The source and output, confined to the models roots; the source's config.json and the free disk."""
    src = _source(app, p.source, "source")
    out = app.roots.confine(p.output, "models", what="output")
    ensure("repack", source=src, out=out, force=p.force,  # the build's own refusals, before any write
           protected_roots=[*app.roots.models, *app.roots.evidence])
    return src, out


@tool(toolset="repack", title="Repack a QAT checkpoint to all-4-bit", params=BuildParams, long=True,
      destructive=True, idempotent=True, check=_repack_paths,
      extra={"output": (str, "The written checkpoint folder; pass it to start_vllm_server as model"),
             "report_path": (str, ""),  # repack-report.json: the whole report (every column)
             "tables": (list[dict[str, Any]], "Per table with tensors: sizes, groups, exactness")},
      ops="repack")
def repack_checkpoint(app, p: BuildParams, progress, checked: tuple[Path, Path]) -> Reply:
    """Build the all-4-bit checkpoint from a QAT source (embed_int4=false: the bf16-embedding build); leaves
    nothing half written. Long."""
    src, out = checked
    from repack.build.build import build_checkpoint

    opts = p.options()
    # a root itself, or a folder above one, is never an output (repack refuses, naming it)
    report = build_checkpoint(src, out, opts, progress=lambda d, t, m: progress(d, t, m),
                              protected_roots=[*app.roots.models, *app.roots.evidence], roots=list(app.roots.models))
    d = report.to_dict()
    off = sum(t["offgrid_groups"] for t in d["tables"])
    nonfinite = sum(t.get("nonfinite_values") or 0 for t in d["tables"])
    result = _repack_result(d, out)
    summary = (f"wrote {out}" + (" (all-4-bit: every packed table int4)" if result["all_4_bit"] else "") + ": "
               f"{d['total_bytes_before'] / 2**20:.1f} -> {d['total_bytes_after'] / 2**20:.1f} MiB "
               f"in {d['wall_s']:.1f} s, {off} off-grid groups"
               + (f", {nonfinite} NaN/inf source values" if nonfinite else "")
               + f"; the whole report: {result['report_path']}")
    return Reply(result, summary)


# The tables the repack packs to int4 (others, `rest` and `towers`, are copied as they are).
PACKED = ("linears", "experts", "PLE", "embed_tokens", "lm_head")
# Per table, the figures shown: sizes, groups and the target runtime's exactness (the report holds every column).
_TABLE_KEYS = ("name", "tensors", "bytes_before", "bytes_after", "groups", "offgrid_groups", "nonfinite_values")


def _repack_result(d: dict[str, Any], out: Path) -> dict[str, Any]:
    """The repack report within the result budget: every table holding tensors as one compact row (an empty one
    left out), the totals, and repack-report.json named as where the whole is."""
    short = {"float16": "fp16", "bfloat16": "bf16"}[d["target_dtype"]]
    tables = []
    order = {n: i for i, n in enumerate(PACKED)}
    for t in sorted(d["tables"], key=lambda t: order.get(t["name"], len(PACKED))):
        if not t.get("tensors"):
            continue
        row = {k: t.get(k) for k in _TABLE_KEYS}
        if t.get("groups"):  # exactness in the runtime the build targets; none for a table left unpacked
            row |= {"exact_pct": t.get(f"exact_runtime_{short}_pct"),
                    "max_err_ulp": t.get(f"max_err_ulp_bf16_runtime_{short}")}
        tables.append(row)
    packed = [t for t in tables if t["name"] in PACKED]
    return {"source": d["source"], "output": str(out), "report_path": str(out / REPORT),
            "scheme": d.get("scheme", "w4a16"), "options": d["options"], "target_dtype": d["target_dtype"],
            "all_4_bit": d.get("scheme", "w4a16") == "w4a16" and bool(packed) and all(t["groups"] for t in packed),
            "tables": tables, "total_bytes_before": d["total_bytes_before"],
            "total_bytes_after": d["total_bytes_after"], "wall_s": d["wall_s"], "mb_per_s": d["mb_per_s"],
            "peak_rss_bytes": d["peak_rss_bytes"], "output_shards": d["output_shards"],
            "exactness": f"in the {d['target_dtype']} runtime the build targets: exact_pct, the share of values it "
                         "gives back exactly; max_err_ulp, its largest error in units of the last place of the "
                         "source's bfloat16 values; the other runtime's and every column per table: report_path"}


def _plan_params(app, p) -> Any:
    """The folder confined to the models roots (its config.json is the only file read)."""
    return _source(app, p.path, "path") if p.path is not None else None


@tool(toolset="hub", title="Plan which Gemma 4 member fits one T4", params=PlanParams, read_only=True,
      idempotent=True,
      extra={"member": (str, "The member planned"),
             "builds": (list[dict[str, Any]], "Per build (bf16, qat-w4a16-ct, repack-bf16-emb, all-4-bit): size, "
                                              "model loading and KV cache in GiB, KV cache tokens, fits (per table "
                                              "and verdicts: `table`)"),
             "error": (dict[str, Any], "validated (E2B, against the article's figures) or not (every other "
                                        "member: no error known), and the error where validated"),
             "table": (str, "The planner's table: per-table GiB, loads, KV cache, each build's verdict, T4 flags"),
             "whole": (str, "Where the whole plan is")})
def plan_fit(app, p: PlanParams) -> Reply:
    """Plan a Gemma 4 member on one T4 before fetching or building it: each build's size per table, the memory
    vLLM loads and the KV cache tokens left, or "does not fit"; a checkpoint folder or a member by name."""
    src = _plan_params(app, p)
    fit = plan(p.model_copy(update={"path": str(src)}) if src is not None else p,
               roots=list(app.roots.models) if src is not None else None)
    best = next((b for b in reversed(fit.builds) if b.fits), None)
    card = fit.card
    gpu = "a T4" if card["name"] == "NVIDIA Tesla T4" else f"a GPU of {card['memory_mib']:,} MiB"
    verdict = f"the {best.build} build fits, {best.kv_tokens:,} KV tokens" if best else "no build fits"
    summary = (f"{fit.member}, the planner's figures (on paper, planned for {gpu}; not measured): {verdict}; "
               + "; ".join(f"{b.build} loads {b.load_gib:.2f} GiB" for b in fit.builds if b.published)
               + ("; error validated against the article" if fit.error["validated"] else
                  f"; error unknown (no {fit.member} measurement)")
               + ("; why KV tokens follow the context: table" if any(
                   n.startswith("KV cache tokens are") for n in fit.notes) else ""))
    where = str(src) if src is not None else f"--member {fit.member}"
    return Reply(_plan_result(fit, where), summary, {"table": fit.format_table()})


# Left out of plan_fit's result, as the table or the command line holds them: each build's tables and verdict (the
# table's rows), its description (the same for every member), the KV cache layout (the command line's --json).
_PLAN_KEPT = ("build", "published", "fits", "size_gib", "load_gib", "kv_gib", "kv_tokens", "max_concurrency")


def _plan_result(fit: Any, where: str) -> dict[str, Any]:
    """The plan within the result budget: the figures a program reads, the rest in `table` and `whole`."""
    return {"member": fit.member, "card": fit.card, "t4_flags": fit.t4_flags,
            "builds": [{k: getattr(b, k) for k in _PLAN_KEPT} for b in fit.builds],
            "error": {k: v for k, v in fit.error.items() if k not in ("calibrated_on", "statement")},
            "whole": f"each build's tables and verdict: `table`; the whole plan (the KV cache layout too): "
                     f"python -m repack plan {where} --json"}
