"""What a build of a checkpoint will hold, per table, before anything is written: the member its config.json
names (repack/family/members.py) and the bytes of each table in the two builds, read from the headers alone through
the build's own plan (repack/build/plan.py)."""

from __future__ import annotations

from typing import Any

from ..errors import RepackError
from ..family import members
from ..params import BuildOptions
from ..source.checkpoint import Checkpoint
from .plan import plan

PREVIEWED = {"all-4-bit": {}, "repack-bf16-emb": {"embed_int4": False}}


def build_tables(ck: Checkpoint, **options: Any) -> dict[str, int]:
    """Output bytes per table of the build with these options (towers dropped or kept, as the options say)."""
    items, _ = plan(ck, BuildOptions(**options))
    out: dict[str, int] = {}
    for it in items:
        if it.action == "drop":
            continue
        n = sum(t.nbytes for t in it.outs.values() if not t.name.startswith("lm_head."))
        out[it.table] = out.get(it.table, 0) + n
        heads = sum(t.nbytes for t in it.outs.values() if t.name.startswith("lm_head."))
        if heads:
            out["lm_head"] = out.get("lm_head", 0) + heads
    return out


def preview(ck: Checkpoint) -> dict[str, Any]:
    """The member and each build's tables in bytes (`tables_bytes`, `total_bytes`: the unit in the name); a
    layout the build refuses says so in one line."""
    if ck.drafter:
        kind = f"{ck.config.get('model_type') or 'gemma4_assistant'} drafter"
        try:
            d = members.identify_drafter(ck.config, str(ck.path / "config.json"))
        except RepackError as e:
            return {"member": None, "layout": kind, "builds": {}, "refused": e.message}
        return {"member": d.name if d else None, "source": d.drafter.source if d and d.drafter else None,
                "layout": (f"{kind} of Gemma 4 {d.name}" if d else
                           f"{kind} of no released member (a stand-in or custom layout)"),
                "builds": {}}
    m = members.identify_or_none(ck.config)
    out: dict[str, Any] = {"member": m.name if m else None,
                           "source": m.source if m else None,
                           "layout": (f"Gemma 4 {m.name}" if m else "not a released Gemma 4 member (a stand-in "
                                      "or custom layout)"),
                           "builds": {}}
    try:
        members.refuse_unpackable(ck.tensors, str(ck.path))
        for build, opts in PREVIEWED.items():
            tables = build_tables(ck, **opts)
            out["builds"][build] = {"tables_bytes": tables, "total_bytes": sum(tables.values())}
    except RepackError as e:
        out["refused"] = e.message
    return out


def format_preview(p: dict[str, Any]) -> list[str]:
    lines = [f"member: {p['member'] or '-'} ({p['layout']})"]
    if p.get("refused"):
        lines.append(f"build refused: {p['refused']}")
    for build, b in p["builds"].items():
        parts = ", ".join(f"{k} {v / members.GIB:.3f}" for k, v in b["tables_bytes"].items())
        lines.append(f"{build} build: {b['total_bytes'] / members.GIB:.3f} GiB ({parts} GiB)")
    return lines
