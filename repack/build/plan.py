"""What a build does with each source tensor (copy, quantize with which scheme, drop), where each output tensor
goes (which shard, under which name), and the output's config.json; nothing is read but the headers."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Literal

from tools.core.errors import param

from .. import schemes
from ..errors import RepackError, clip
from ..family import config as cfgmod
from ..family import drafter
from ..family import members
from ..grid import grid
from ..params import BuildOptions
from ..source.checkpoint import MM_PREFIX, Checkpoint
from ..source.safetensors_io import OutShard, OutTensor, TensorInfo

PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")


@dataclass
class Item:
    """What happens to one source tensor."""

    src: TensorInfo
    action: Literal["copy", "quant", "drop"]
    table: str
    out_name: str                      # copy: the tensor name; quant: the module prefix (".weight" removed)
    head: bool = False                 # also write the levels and scales as lm_head.*
    outs: dict[str, OutTensor] = field(default_factory=dict)
    writers: dict[str, int] = field(default_factory=dict)  # out key -> output shard index
    scheme: type[schemes.Scheme] | None = None  # quant: the scheme that encodes it


def _classify(name: str, info: TensorInfo, ck: Checkpoint, opt: BuildOptions) -> Item:
    if ck.drafter:  # its own names, no towers, its embedding kept bf16 (repack.family.drafter)
        table, packed = drafter.table(name, info.shape)
        return Item(info, "quant" if packed and opt.quantize_linears else "copy", table, name)
    if name.startswith(cfgmod.TOWER_PREFIXES):
        return Item(info, "drop" if opt.text_only else "copy", "towers", name)
    out = name
    short = None
    if ck.multimodal and name.startswith(MM_PREFIX):
        short = name[len(MM_PREFIX):]
        if opt.text_only:
            out = "model." + short
    elif not ck.multimodal and name.startswith("model."):
        short = name[len("model."):]
    elif name.startswith("lm_head."):
        short = name
    if short is None:
        return Item(info, "copy", "rest", out)
    module = short.rsplit(".", 1)[0]
    if short.endswith(PACKED_SUFFIXES):  # already int4 (an intermediate build): carried as is
        table = ("PLE" if module == cfgmod.PLE else "embed_tokens" if module == "embed_tokens"
                 else "lm_head" if module == "lm_head" else "experts" if ".experts." in module else "linears")
        return Item(info, "copy", table, out)
    if members.FUSED_EXPERTS.search(short):  # split per expert by _expert_items when packed
        return Item(info, "quant" if opt.quantize_linears else "copy", "experts", out)
    if short.endswith(".router.proj.weight"):
        # the router stays bf16: vLLM builds it as an unquantized GateLinear (fp32 logits) whatever the config
        return Item(info, "copy", "rest", out)
    if short == cfgmod.PLE + ".weight":
        return Item(info, "quant" if opt.embed_int4 else "copy", "PLE", out)
    if short == "embed_tokens.weight":
        q = opt.embed_int4 and opt.embed_tokens
        return Item(info, "quant" if q else "copy", "embed_tokens", out, head=q and "lm_head.weight" not in ck.tensors)
    if short == "lm_head.weight":
        return Item(info, "quant" if opt.embed_int4 and opt.embed_tokens else "copy", "lm_head", out)
    # every text weight of two or more dimensions is a linear layer's (norms are 1-D): one the build cannot pack
    # is refused by _check_quantizable, never left bf16 under a config that declares every Linear int4
    if short.endswith(".weight") and len(info.shape) >= 2:
        return Item(info, "quant" if opt.quantize_linears else "copy", "linears", out)
    return Item(info, "copy", "rest", out)


def _check_quantizable(it: Item) -> None:
    s = it.src
    if s.dtype != "BF16":
        raise RepackError(f"{s.file}: tensor {clip(s.name)} is {s.dtype}, but only BF16 tensors can be "
                          f"repacked; use the bf16 QAT export (google/gemma-4-E2B-it-qat-q4_0-unquantized)")
    if len(s.shape) != 2 or s.shape[1] % grid.GROUP or 0 in s.shape:
        raise RepackError(f"{s.file}: tensor {clip(s.name)} has shape {clip(list(s.shape), 80)}; a 4-bit target "
                          f"needs 2 non-empty dimensions with the last a multiple of {grid.GROUP}")


def _expert_items(it: Item, ck: Checkpoint) -> list[Item]:
    """A fused expert tensor to pack, as one item per expert projection, each reading its own rows of the source
    (a slice of it, no copy): the per-expert modules compressed-tensors and vLLM's W4A16 MoE loading read,
    `experts.{e}.gate_proj` / `up_proj` / `down_proj` (vLLM 0.32 RoutedExperts.load_weights; its fused names
    are for unquantized weights only)."""
    s = it.src
    where = f"{clip(s.file)}: tensor {clip(s.name)}"
    if len(s.shape) != 3 or 0 in s.shape:
        raise RepackError(f"{where} has shape {clip(list(s.shape), 80)}; fused expert weights have 3 non-empty "
                          f"dimensions [experts, out, in]; use the checkpoint as Google published it",
                          {"file": clip(s.file), "tensor": clip(s.name), "problem": "expert-shape"})
    experts, rows, cols = s.shape
    declared = cfgmod.text_of(ck.config).get("num_experts")
    if declared != experts:
        raise RepackError(f"{where} holds {experts} experts, but config.json declares "
                          f"{'no mixture of experts' if not declared else f'num_experts {declared}'}; use the "
                          f"config.json that came with the checkpoint",
                          {"file": clip(s.file), "tensor": clip(s.name), "problem": "expert-count"})
    base = it.out_name.rsplit(".", 1)[0]  # ...layers.N.experts
    if it.out_name.endswith("gate_up_proj"):
        if rows % 2:
            raise RepackError(f"{where} has {rows} rows per expert; gate_up_proj holds the gate and up rows in two "
                              f"equal halves",
                              {"file": clip(s.file), "tensor": clip(s.name), "problem": "expert-shape"})
        parts = [("gate_proj", 0, rows // 2), ("up_proj", rows // 2, rows // 2)]
    else:
        parts = [("down_proj", 0, rows)]
    out: list[Item] = []
    for e in range(experts):
        for proj, r0, n in parts:
            offset = s.offset + (e * rows + r0) * cols * 2
            info = replace(s, name=f"{s.name}[expert {e}, {proj}]", shape=(n, cols), offset=offset,
                           nbytes=n * cols * 2)
            out.append(Item(info, "quant", "experts", f"{base}.{e}.{proj}"))
    return out


def _check_carried_linears(items: list[Item], opt: BuildOptions) -> None:
    """Linears an earlier build packed are carried as they are: refused when the scheme asked for would have
    written them otherwise, since the output and its report would claim that scheme."""
    if not opt.quantize_linears:
        return
    scheme = schemes.for_table(opt.scheme, "linears")
    if "weight_packed" in {o.suffix for o in scheme.outputs(grid.GROUP, grid.GROUP, opt)}:  # names, any shape
        return
    for it in items:
        if it.table in ("linears", "experts") and it.action == "copy" and it.src.name.endswith(".weight_packed"):
            raise RepackError(f"{clip(it.src.file)}: the source's linear layers are already packed as int4 "
                              f"weight_packed (e.g. {clip(it.src.name, 120)}), which {param('scheme')} {opt.scheme} does "
                              f"not write; give the bf16 QAT checkpoint as the source",
                              {"file": clip(it.src.file), "tensor": clip(it.src.name), "option": "--scheme",
                               "problem": "already-packed"}, field="scheme")


def plan(ck: Checkpoint, opt: BuildOptions) -> tuple[list[Item], list[OutShard]]:
    if not ck.drafter:
        members.refuse_unpackable(ck.tensors, str(ck.path))
    items: list[Item] = []
    shards: list[OutShard] = []
    current: OutShard | None = None

    def add(t: OutTensor, it: Item, key: str) -> None:
        nonlocal current
        if current is None or (current.tensors and current.data_bytes + t.nbytes > opt.max_shard_bytes):
            current = OutShard("")
            shards.append(current)
        current.add(t)
        it.outs[key] = t
        it.writers[key] = len(shards) - 1

    for sh in ck.shards:
        sh_items = []
        for n, i in sorted(sh.tensors.items(), key=lambda kv: kv[1].offset):
            it = _classify(n, i, ck, opt)
            sh_items += _expert_items(it, ck) if it.table == "experts" and it.action == "quant" else [it]
        for it in sh_items:
            if it.action == "quant":
                if it.table == "experts" and "experts" not in schemes.get(opt.scheme).tables:
                    raise RepackError(f"{param('scheme')} {opt.scheme}: this build packs mixture-of-experts weights "
                                      f"only as w4a16 (int4, groups of 32); build {clip(ck.path)} with "
                                      f"{param('scheme', 'w4a16')}",
                                      {"option": "--scheme", "value": opt.scheme, "problem": "experts-scheme"},
                                      field="scheme")
                it.scheme = schemes.for_table(opt.scheme, it.table)
                _check_quantizable(it)
        _check_carried_linears(sh_items, opt)
        items.extend(sh_items)
        unchanged = sh_items and all(it.action == "copy" and it.out_name == it.src.name for it in sh_items)
        if unchanged:
            # every tensor kept as is: the shard itself is reused (hard link)
            current = None
            linked = OutShard("", hardlink_from=sh.path)
            for it in sh_items:
                t = OutTensor(it.out_name, it.src.dtype, it.src.shape, it.src.nbytes)
                linked.add(t)
                it.outs["data"] = t
                it.writers["data"] = len(shards)
            shards.append(linked)
            current = None
            continue
        for it in sh_items:
            s = it.src
            if it.action == "drop":
                continue
            if it.action == "copy":
                add(OutTensor(it.out_name, s.dtype, s.shape, s.nbytes), it, "data")
                continue
            rows, cols = s.shape
            prefix = it.out_name.removesuffix(".weight")
            names = [("", prefix)] + ([("head_", "lm_head")] if it.head else [])
            for key, mod in names:
                for o in it.scheme.outputs(rows, cols, opt):  # type: ignore[union-attr]
                    add(OutTensor(f"{mod}.{o.suffix}", o.dtype, o.shape, o.nbytes), it, key + o.key)
    n = len(shards)
    for i, sh in enumerate(shards):
        sh.filename = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    return items, shards


def output_config(ck: Checkpoint, opt: BuildOptions, items: list[Item]) -> dict:
    # a drafter is text only already: its text_config stays where vLLM's gemma4_assistant config reads it
    promote = opt.text_only and not ck.drafter
    config = cfgmod.text_only(ck.config) if promote else json.loads(json.dumps(ck.config))
    by_scheme: dict[type[schemes.Scheme], set[str]] = {}  # the tables each scheme quantized in this run
    for it in items:
        if it.action == "quant":
            by_scheme.setdefault(it.scheme, set()).update([it.table] + (["lm_head"] if it.head else []))
    carried = {it.table for it in items if it.action == "copy" and it.src.name.endswith(".weight_packed")}
    carried_bf16 = {it.table for it in items if it.action == "copy" and it.src.dtype == "BF16"
                    and it.src.name.endswith(".weight")}
    head = "lm_head" in carried or any("lm_head" in t for t in by_scheme.values())
    towers = any(it.table == "towers" and it.action != "drop" for it in items)
    router = any(it.src.name.endswith(".router.proj.weight") for it in items)
    qc = cfgmod.quantization_config([s.config_group(sorted(t)) for s, t in by_scheme.items()], previous=ck.config,
                                    carried_packed=carried, carried_bf16=carried_bf16, head=head, towers=towers,
                                    router=router, version=_ct_version())
    cfgmod.set_quantization(config, qc)
    if head:
        cfgmod.set_untied(config)
    return config


def _ct_version() -> str:
    return "0.17.0"  # the compressed-tensors format version the config follows (the pinned library)


__all__ = ["PACKED_SUFFIXES", "Item", "output_config", "plan"]
