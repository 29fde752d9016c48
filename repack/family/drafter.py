"""Google's speculative-decoding drafters (`gemma4_assistant`, the 12B's `gemma4_unified_assistant`, both served by
vLLM as `gemma4_mtp`) as a repack source: one path for every member's drafter.

A drafter is a small text model beside the target: a `text_config` like a multimodal checkpoint's, but its
tensors are named `model.*`, `pre_projection.*` and `post_projection.*`, it has no towers and its head is tied to
its own (draft-width) embedding; E2B's and E4B's also have a centroid-masked head (`masked_embedding.centroids`, a
plain nn.Linear in vLLM, and `masked_embedding.token_ordering`), carried as they are. The build packs its linear
layers exactly as the target's (compressed-tensors `pack-quantized` int4, groups of 32: repack.schemes' w4a16),
recovering the QAT grid; it never quantizes, so a
drafter whose linears are off the grid is refused before anything is written. Its embedding (which is also its
head, and which vLLM replaces with the target's for the input side) stays bf16.

Before a byte is written, `check_layout` holds the weights to the layout the drafter's config declares (what
vLLM's gemma4_mtp builds from it): every layer's linears, norms and scalar and the shared tensors present, their shapes from
hidden_size, vocab_size, backbone_hidden_size, intermediate_size and the heads, no layer beyond
num_hidden_layers. A damaged drafter builds otherwise and is served, drafting nothing the target accepts.

`member` names the family member a drafter is for (repack.family.members.identify_drafter: from what it shares with its
target, backbone_hidden_size, vocabulary, head sizes and KV heads), refusing a layout that claims the family but is
no member's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from tools.core.errors import param

from . import members
from ..errors import RepackError, clip

MODEL_TYPE = "gemma4_assistant"
ARCHITECTURE = "Gemma4AssistantForCausalLM"
# the 12B's drafter: the same tensors over a gemma4_unified_text model (transformers' gemma4_unified_assistant)
MODEL_TYPES = (MODEL_TYPE, "gemma4_unified_assistant")
ARCHITECTURES = (ARCHITECTURE, "Gemma4UnifiedAssistantForCausalLM")
SCHEME = "w4a16"  # the target's scheme: the only one that recovers the grid rather than quantizing
EMBEDDING = "model.embed_tokens.weight"
MASKED = "masked_embedding."  # the centroid-masked head: vLLM's Gemma4MTPMaskedEmbedder, a plain nn.Linear


def is_drafter(config: dict[str, Any]) -> bool:
    """Whether a config.json is a gemma4_assistant (or gemma4_unified_assistant) drafter's."""
    archs = config.get("architectures")
    return config.get("model_type") in MODEL_TYPES or (isinstance(archs, list)
                                                       and any(a in archs for a in ARCHITECTURES))


def table(name: str, shape: Sequence[int]) -> tuple[str, bool]:
    """A drafter tensor's report table, and whether the build packs it: every 2-D weight but the embedding is a
    linear layer's (pre/post projection, attention, MLP); norms and layer scalars are 1-D. The masked head's
    centroids stay bf16: vLLM loads them into a plain nn.Linear, which reads `.weight` and no packed form."""
    if name == EMBEDDING:
        return "embed_tokens", False
    if name.startswith(MASKED):
        return "rest", False
    if name.endswith(".weight") and len(shape) >= 2:
        return "linears", True
    return "rest", False


class _Probed(Protocol):  # repack.build.probe.ProbeTensor, as far as the drafter's verdict reads it
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


def probe_summary(tensors: Sequence[_Probed], config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The probe report's drafter entry: the member it is for, the linears' verdict and its line."""
    g = grid_verdict(tensors)
    try:
        m, refused = members.identify_drafter(dict(config or {})), None
    except RepackError as e:
        m, refused = None, e.message
    whose = (f"{m.name}'s drafter" if m else "no member's drafter: refused" if refused
             else "no member's drafter (a stand-in or custom layout)")
    out = {**g.to_dict(), "member": m.name if m else None, "line": f"{whose}; {g.line()}"}
    if refused:
        out["refused"] = refused
    return out


def member(src: Path, config: Mapping[str, Any]) -> members.Member | None:
    """The member a drafter is for; None for a stand-in or custom drafter outside the family's vocabulary and
    widths. A layout that claims the family and is no member's is refused (RepackError, one line)."""
    return members.identify_drafter(dict(config), clip(src / "config.json"))


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


# -- the layout its config declares -------------------------------------------------------------------------------

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
_LAYER = re.compile(r"model\.layers\.([^.]+)\.")
_Dim = int | None  # None: the config does not fix it (only its agreement with the other tensors is checked)


def _bad(where: str, what: str, detail: dict[str, Any]) -> RepackError:
    return RepackError(f"{where}: {what}; a damaged {MODEL_TYPE} drafter: use the config.json and weights it came "
                       f"with", {"file": where, **detail, "problem": "drafter-layout"})


def _positive(cfg: Mapping[str, Any], key: str, where: str, scope: str, *, required: bool) -> int | None:
    v = cfg.get(key)
    if v is None and not required:
        return None
    if type(v) is not int or v < 1:
        what = "missing" if v is None else f"{clip(repr(v), 40)}, not a positive whole number"
        raise _bad(where, f"{scope}{key} is {what}", {"key": scope + key})
    return v


def _head_dims(tc: Mapping[str, Any], layers: int, where: str) -> list[_Dim]:
    """Each layer's head size as vLLM reads it: per_layer_config's, else global_head_dim for a full-attention
    layer and head_dim for the rest; None where the config leaves it to a library default."""
    types = tc.get("layer_types")
    if types is not None and not (isinstance(types, list) and len(types) == layers
                                  and all(isinstance(t, str) for t in types)):
        raise _bad(where, f"text_config.layer_types is not a list of {layers} layer kinds (text_config."
                          f"num_hidden_layers)", {"key": "text_config.layer_types"})
    per = tc.get("per_layer_config")
    if per is not None and not isinstance(per, dict):
        raise _bad(where, "text_config.per_layer_config is not an object (layer index to its settings)",
                   {"key": "text_config.per_layer_config"})
    per = per or {}
    for k, v in per.items():
        if not (str(k).isdigit() and int(k) < layers and isinstance(v, dict)):
            raise _bad(where, f"text_config.per_layer_config has {clip(repr(k), 40)}: not one of its {layers} "
                              f"layers with an object of settings", {"key": "text_config.per_layer_config"})
        _positive(v, "head_dim", where, f"text_config.per_layer_config.{k}.", required=False)
    head = _positive(tc, "head_dim", where, "text_config.", required=False)
    full = _positive(tc, "global_head_dim", where, "text_config.", required=False)
    dims: list[_Dim] = []
    for i in range(layers):
        own = per.get(str(i), per.get(i, {})).get("head_dim")  # type: ignore[call-overload]
        kind = types[i] if types is not None else None
        dims.append(own if own is not None else full if kind == "full_attention" else head
                    if kind is not None else None)
    return dims


def check_layout(src: Path, config: Mapping[str, Any], shapes: Mapping[str, Sequence[int]],
                 files: Mapping[str, Path] | None = None) -> None:
    """Refuses (RepackError, one line naming the file and the field or tensor) a drafter whose weights are not
    the layout its config declares: a field missing or out of range, a tensor missing, of another shape, or of
    a layer beyond num_hidden_layers."""
    cfg_where = clip(src / "config.json")
    mt = config.get("model_type")
    if mt is not None and mt not in MODEL_TYPES:
        raise _bad(cfg_where, f"model_type is {clip(repr(mt), 60)}, not {' or '.join(map(repr, MODEL_TYPES))}",
                   {"key": "model_type"})
    tc = config.get("text_config")
    if not isinstance(tc, dict):
        raise _bad(cfg_where, "text_config is missing (its text model is described there)", {"key": "text_config"})
    hidden = _positive(tc, "hidden_size", cfg_where, "text_config.", required=True)
    vocab = _positive(tc, "vocab_size", cfg_where, "text_config.", required=True)
    layers = _positive(tc, "num_hidden_layers", cfg_where, "text_config.", required=True)
    inter = _positive(tc, "intermediate_size", cfg_where, "text_config.", required=False)
    heads = _positive(tc, "num_attention_heads", cfg_where, "text_config.", required=False)
    backbone = _positive(config, "backbone_hidden_size", cfg_where, "", required=False) or hidden
    assert hidden and vocab and layers
    dims = _head_dims(tc, layers, cfg_where)

    for name in shapes:
        m = _LAYER.match(name)
        if m and not (m.group(1).isdigit() and int(m.group(1)) < layers):
            where = clip((files or {}).get(name, src))
            raise _bad(where, f"tensor {clip(name)} is of a layer beyond text_config.num_hidden_layers {layers}",
                       {"tensor": clip(name)})

    def expect(name: str, want: tuple[_Dim, ...], why: str) -> tuple[int, ...]:
        got = shapes.get(name)
        if got is None:
            raise _bad(clip(src), f"tensor {name} is missing (text_config.num_hidden_layers {layers})",
                       {"tensor": name})
        got = tuple(got)
        if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
            shown = "[" + ", ".join("?" if w is None else str(w) for w in want) + "]"
            raise _bad(clip((files or {}).get(name, src)), f"tensor {name} has shape {list(got)}, its config "
                       f"gives {shown} ({why})", {"tensor": name})
        return got

    expect(EMBEDDING, (vocab, hidden), "text_config.vocab_size, hidden_size")
    expect("model.norm.weight", (hidden,), "text_config.hidden_size")
    expect("pre_projection.weight", (hidden, 2 * backbone), "text_config.hidden_size, 2 x backbone_hidden_size")
    expect("post_projection.weight", (backbone, hidden), "backbone_hidden_size, text_config.hidden_size")
    if config.get("use_ordered_embeddings"):  # the masked head vLLM builds (num_centroids defaults to 2048 there)
        cents = _positive(config, "num_centroids", cfg_where, "", required=False) or 2048
        if vocab % cents:
            raise _bad(cfg_where, f"text_config.vocab_size {vocab} is not a multiple of num_centroids {cents}",
                       {"key": "num_centroids"})
        expect(MASKED + "centroids.weight", (cents, hidden), "num_centroids, text_config.hidden_size")
        expect(MASKED + "token_ordering", (vocab,), "text_config.vocab_size")
    for i, hd in enumerate(dims):
        at = f"model.layers.{i}."
        q_rows = heads * hd if heads and hd else None
        why = f"text_config.num_attention_heads x head size of layer {i}, hidden_size"
        q = expect(at + "self_attn.q_proj.weight", (q_rows, hidden), why)
        if heads and q[0] % heads:
            raise _bad(clip((files or {}).get(at + "self_attn.q_proj.weight", src)),
                       f"tensor {at}self_attn.q_proj.weight has {q[0]} rows, not a multiple of text_config."
                       f"num_attention_heads {heads}", {"tensor": at + "self_attn.q_proj.weight"})
        expect(at + "self_attn.o_proj.weight", (hidden, q[0]), f"hidden_size, the q_proj's {q[0]} rows")
        gate = expect(at + "mlp.gate_proj.weight", (inter, hidden), "text_config.intermediate_size, hidden_size")
        expect(at + "mlp.up_proj.weight", (gate[0], hidden), f"the gate_proj's {gate[0]} rows, hidden_size")
        expect(at + "mlp.down_proj.weight", (hidden, gate[0]), f"hidden_size, the gate_proj's {gate[0]} rows")
        for norm in LAYER_NORMS:
            expect(at + norm + ".weight", (hidden,), "text_config.hidden_size")
        expect(at + "self_attn.q_norm.weight", (q[0] // heads if heads else hd,), f"the head size of layer {i}")
        expect(at + "layer_scalar", (1,), "one scalar a layer")


__all__ = ["ARCHITECTURE", "ARCHITECTURES", "MODEL_TYPE", "MODEL_TYPES", "SCHEME", "DrafterGrid", "check_buildable",
           "check_layout", "grid_verdict", "is_drafter", "member", "probe_summary", "table"]
