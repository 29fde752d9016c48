"""Whether a Gemma 4 member fits one T4, on paper: each build's size per table, the memory vLLM loads, and the
KV cache tokens left, for the article's four columns (Google's bf16 model, Google's -qat-w4a16-ct export, the
text-only repack with bf16 embeddings, the all-4-bit build).

Sizes come from the member's shapes (repack/family/members.py): bf16 is 2 bytes a value, int4 group-32 with fp16 scales
0.5625. The load is the weights plus vLLM's rotary tables (one fp16 [max_position, head_dim] table per attention
kind) plus a small constant. The KV cache is vLLM's arithmetic for Gemma 4 (vllm/v1/core/kv_cache_utils.py, the
hybrid allocator): only the layers that own their KV hold a cache (KV-shared layers read another's); sliding and
full layers are separate groups whose page sizes are unified by widening the smaller page's block; a request at
max_model_len takes cdiv(max_model_len, block) blocks of a full group and cdiv(window - 1 + batched tokens, block)
+ 1 of a sliding one; the tokens reported are the pool's blocks over that, times max_model_len.

Two figures cannot be derived from shapes without a GPU and are calibrated on the article's E2B rows (vLLM 0.29,
warm start): the constant beside the weights and the memory outside weights and KV cache (activation peak, CUDA
graphs, the CUDA context). Google's -qat-w4a16-ct export is counted with an untied bf16 output layer (its E2B load
and the 31B export's published size both say so). Against the article, the estimate's error is at most
LOAD_ERROR_GIB on a load and KV_ERROR on a KV cache (tests/repack/test_fit.py checks both).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from pydantic import Field, model_validator

from tools.core.errors import param
from tools.core.params import OpParams
from tools.core.paths import confinement

from ..errors import RepackError
from ..family.config import text_of
from ..family.drafter import is_drafter
from ..family.members import GIB, MEMBERS, Member, by_name, identify, identify_drafter, text_tables, towers_params
from ..source.checkpoint import check_source_folder, read_config

MIB = 1 << 20
BF16 = 2.0
INT4 = 0.5 + 2 / 32      # a packed nibble per value and an fp16 scale per group of 32

# The T4 as the article serves it
T4_MIB = 15_360
UTILIZATION = 0.9
MAX_MODEL_LEN = 16_384
MAX_NUM_SEQS = 8
# vLLM's chunked-prefill budget at the article's flags on a T4: the only value that makes the article's four KV
# figures come out of one block arithmetic (1,604 blocks a request: 1,024 full + 4 x 145 sliding)
MAX_NUM_BATCHED_TOKENS = 4096
BLOCK_SIZE = 16
KV_DTYPE_BYTES = 2       # float16 on the T4 (--kv-cache-dtype auto: fp16/bf16 on any device)

# Calibrated on the article's E2B text-only rows (see the module's doc): what vLLM holds beside the weights and
# its rotary tables, and what the profile run keeps outside weights and KV cache.
LOAD_CONSTANT_GIB = 0.034
OUTSIDE_GIB = 0.789
# The stated error against the article's E2B figures (the largest residual, rounded up): the multimodal builds
# keep tower buffers and profile an encoder, which the text-only calibration does not see.
LOAD_ERROR_GIB = 0.08
KV_ERROR = 0.06          # relative: text-only rows within 0.1%, the multimodal ones within 5.3%
# The members a measurement validates the planner on (the stated error above holds for these only)
VALIDATED = {"E2B": "the article's E2B figures (one T4, vLLM 0.29.0)"}

# The article's figures (one T4, vLLM 0.29.0, --dtype float16 --gpu-memory-utilization 0.9 --max-model-len 16384
# --max-num-seqs 8), evidence/article-t4 and the article's "What the Engine Allocates"
ARTICLE_E2B = {"bf16": (9.8, 315_974), "qat-w4a16-ct": (8.02, 519_568), "repack-bf16-emb": (6.33, 711_539),
               "all-4-bit": (2.86, 1_099_587)}

BUILDS = {
    "bf16": "Google's bf16 model (google/gemma-4-<M>-it), served multimodal",
    "qat-w4a16-ct": "Google's QAT W4A16 export (-qat-w4a16-ct): int4 linears, bf16 embeddings and output layer, "
                    "towers kept",
    "repack-bf16-emb": "this project's text-only repack, int4 linears, bf16 embeddings (tied output layer)",
    "all-4-bit": "this project's all-4-bit build: int4 linears, PLE, embed_tokens and an untied int4 lm_head",
}


@dataclass
class BuildPlan:
    build: str
    what: str
    published: bool                      # false: Google published no such export for this member
    tables_gib: dict[str, float]
    size_gib: float
    load_gib: float
    kv_gib: float
    kv_tokens: int
    max_concurrency: float
    fits: bool
    verdict: str


@dataclass
class FitPlan:
    member: str
    source: str
    towers_source: str
    card: dict[str, Any]
    kv_layers: dict[str, Any]
    builds: list[BuildPlan] = field(default_factory=list)
    error: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # vLLM's flags for the smallest build that fits (the all-4-bit one first): the article's, with
    # --max-num-seqs lowered to the requests its KV cache holds; None where no build fits
    t4_flags: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def build(self, name: str) -> BuildPlan:
        return next(b for b in self.builds if b.build == name)

    def format_table(self) -> str:
        cols = [b.build for b in self.builds]
        rows = sorted({t for b in self.builds for t in b.tables_gib}, key=lambda t: list(TABLE_ORDER).index(t))
        w = 17
        lines = [f"{self.member} on one T4 ({self.card['memory_mib']:,} MiB at {self.card['gpu_memory_utilization']}, "
                 f"--max-model-len {self.card['max_model_len']:,}, --max-num-seqs {self.card['max_num_seqs']}); "
                 f"configuration: {self.source}",
                 f"{'GiB':<22}" + "".join(f"{c:>{w}}" for c in cols)]
        for t in rows:
            lines.append(f"{t:<22}" + "".join(
                f"{(f'{b.tables_gib[t]:.3f}' if t in b.tables_gib else '-'):>{w}}" for b in self.builds))
        for label, key in (("checkpoint", "size_gib"), ("model loading", "load_gib"), ("KV cache", "kv_gib")):
            lines.append(f"{label:<22}" + "".join(
                f"{(f'{getattr(b, key):.2f}' if b.published else 'n/a'):>{w}}" for b in self.builds))
        lines.append(f"{'KV cache tokens':<22}" + "".join(
            f"{(f'{b.kv_tokens:,}' if b.published and b.fits else 'n/a'):>{w}}" for b in self.builds))
        for b in self.builds:
            lines.append(f"  {b.build}: {b.verdict}")
        f = self.t4_flags
        lines.append(f"T4 flags: {f['build']} build, --gpu-memory-utilization {f['gpu_memory_utilization']} "
                     f"--max-model-len {f['max_model_len']} --max-num-seqs {f['max_num_seqs']}" if f
                     else f"T4 flags: none, {self.member} does not fit one T4 in any build")
        # the estimate's margin, not a failure: a plan that exits 0 prints no line starting "error:"
        lines.append(f"margin: {self.error['statement']}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


TABLE_ORDER = ("linears", "experts", "PLE", "embed_tokens", "lm_head", "towers", "other")


def _tables(m: Member, build: str) -> dict[str, float]:
    """Bytes per table of one build, in GiB."""
    t = text_tables(m)
    out: dict[str, float] = {}
    four = build != "bf16"
    for name in ("linears", "experts"):
        if name in t:
            out[name] = t[name].params * (INT4 if four else BF16)
    if "PLE" in t:
        out["PLE"] = t["PLE"].params * (INT4 if build == "all-4-bit" else BF16)
    emb = t["embed_tokens"].params
    out["embed_tokens"] = emb * (INT4 if build == "all-4-bit" else BF16)
    if build == "all-4-bit":
        out["lm_head"] = emb * INT4
    elif build == "qat-w4a16-ct":
        out["lm_head"] = emb * BF16
    if build in ("bf16", "qat-w4a16-ct") and towers_params(m):
        out["towers"] = towers_params(m) * BF16
    out["other"] = t["other"].params * BF16
    return {k: v / GIB for k, v in out.items()}


def rotary_gib(m: Member) -> float:
    """vLLM's rotary tables: one fp16 [max_position, head_dim] cos/sin table per attention kind, shared by the
    layers of that kind (vllm/model_executor/layers/rotary_embedding)."""
    return m.max_position_embeddings * (m.head_dim + m.global_head_dim) * 2 / GIB


def _activation_gib(m: Member) -> float:
    """The part of the profile run's peak that grows with the member: the MLP's gate/up output for a full
    chunk of batched tokens in fp16 (the widest MLP, or the experts' for the routed tokens)."""
    widest = m.intermediate_size * (2 if m.use_double_wide_mlp else 1)
    if m.moe:
        widest = max(widest, m.top_k_experts * m.moe_intermediate_size)
    return MAX_NUM_BATCHED_TOKENS * 2 * widest * 2 / GIB


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_bytes_per_token(config: dict[str, Any]) -> list[tuple[str, int]]:
    """The bytes of K and V one token takes in each layer that owns a KV cache (the first num_hidden_layers -
    num_kv_shared_layers; the shared ones read an earlier layer's), with the layer's kind (full_attention or
    sliding_attention), from a config.json or its text part. Head size and KV heads: a layer's per_layer_config,
    else the full layers' global_head_dim (where no per_layer_config says) and num_global_key_value_heads, else
    head_dim and num_key_value_heads (num_attention_heads where there are none)."""
    tc = text_of(config)
    layers = int(tc["num_hidden_layers"])
    owners = layers - int(tc.get("num_kv_shared_layers") or 0)
    types = tc.get("layer_types") or ["full_attention"] * layers
    per_layer = {int(k): v for k, v in (tc.get("per_layer_config") or {}).items()}
    out = []
    for i in range(owners):
        full = types[i] == "full_attention"
        over = per_layer.get(i) or {}
        head = over.get("head_dim") or (tc.get("global_head_dim") if full and not per_layer else None) \
            or tc["head_dim"]
        kv_heads = over.get("num_key_value_heads") or (tc.get("num_global_key_value_heads") if full else None) \
            or tc.get("num_key_value_heads") or tc["num_attention_heads"]
        out.append((types[i], 2 * int(kv_heads) * int(head) * KV_DTYPE_BYTES))
    return out


def kv_layout(m: Member, max_model_len: int = MAX_MODEL_LEN) -> dict[str, Any]:
    """vLLM's KV cache groups for the member: bytes per block of the pool and blocks one request at
    max_model_len takes."""
    owners = kv_bytes_per_token(m.text_config())
    specs: dict[str, dict[str, int]] = {}
    for t, per_token in owners:
        s = specs.setdefault(t, {"layers": 0, "bytes_per_token": per_token})
        s["layers"] += 1
    page = max(BLOCK_SIZE * s["bytes_per_token"] for s in specs.values())
    counts = [s["layers"] for s in specs.values()]
    group_size = min(counts) if max(counts) >= 1.5 * min(counts) else max(counts)
    per_request = 0
    for t, s in specs.items():
        s["block_size"] = page // s["bytes_per_token"]
        s["groups"] = _cdiv(s["layers"], group_size)
        if t == "full_attention":
            s["blocks_per_request"] = _cdiv(max_model_len, s["block_size"])
        else:
            tokens = min(m.sliding_window - 1 + MAX_NUM_BATCHED_TOKENS, max_model_len)
            s["blocks_per_request"] = _cdiv(tokens, s["block_size"]) + 1
        per_request += s["groups"] * s["blocks_per_request"]
    return {"kv_owning_layers": len(owners), "kv_shared_layers": m.num_kv_shared_layers, "kinds": specs,
            "group_size": group_size, "bytes_per_block": group_size * page, "blocks_per_request": per_request}


def plan_member(m: Member, *, memory_mib: int = T4_MIB, utilization: float = UTILIZATION,
                max_model_len: int = MAX_MODEL_LEN, max_num_seqs: int = MAX_NUM_SEQS) -> FitPlan:
    layout = kv_layout(m, max_model_len)
    budget = memory_mib * MIB * utilization / GIB
    outside = OUTSIDE_GIB + _activation_gib(m) - _activation_gib(_E2B())
    plan = FitPlan(m.name, m.source, m.towers_source,
                   {"name": "NVIDIA Tesla T4" if memory_mib == T4_MIB else "custom", "memory_mib": memory_mib,
                    "gpu_memory_utilization": utilization, "max_model_len": max_model_len,
                    "max_num_seqs": max_num_seqs, "budget_gib": round(budget, 3)},
                   layout, error=stated_error(m))
    for build, what in BUILDS.items():
        what = what.replace("<M>", m.name)
        if not m.hidden_size_per_layer_input:  # no per-layer embeddings in this member
            what = what.replace("int4 linears, PLE, embed_tokens", "int4 linears, embed_tokens")
        if m.moe:
            what = what.replace("int4 linears", "int4 linears and experts")
        published = not (build == "qat-w4a16-ct" and not m.qat_w4a16_ct)
        tables = _tables(m, build)
        size = sum(tables.values())
        load = size + rotary_gib(m) + LOAD_CONSTANT_GIB
        kv = budget - load - outside
        blocks = max(0, int(kv * GIB) // layout["bytes_per_block"])
        conc = blocks / layout["blocks_per_request"]
        tokens = int(conc * max_model_len)
        fits = published and conc >= 1
        if not published:
            verdict = "not published by Google for this member"
        elif load + outside >= budget:
            verdict = (f"does not fit: the weights alone load {load:.2f} GiB of the {budget:.2f} GiB vLLM may use "
                       f"({outside:.2f} GiB more go to activations and the CUDA context)")
        elif not fits:
            verdict = (f"does not fit: {kv:.2f} GiB is left for KV cache, less than one {max_model_len:,}-token "
                       f"request needs")
        elif conc < max_num_seqs:
            verdict = (f"fits, but the KV cache holds {conc:.2f} requests of {max_model_len:,} tokens, fewer than "
                       f"--max-num-seqs {max_num_seqs}")
        else:
            verdict = f"fits: {tokens:,} KV tokens, {conc:.2f}x {max_model_len:,}-token requests"
        plan.builds.append(BuildPlan(build, what, published, {k: round(v, 3) for k, v in tables.items()},
                                     round(size, 3), round(load, 2), round(max(kv, 0.0), 2),
                                     tokens if fits else 0, round(conc, 2), fits, verdict))
    best = next((b for b in reversed(plan.builds) if b.fits), None)
    if best is not None:
        plan.t4_flags = {"build": best.build, "gpu_memory_utilization": utilization, "max_model_len": max_model_len,
                         "max_num_seqs": max(1, min(max_num_seqs, int(best.max_concurrency)))}
    relation = kv_relation(layout, max_model_len) if best is not None else None  # moot where nothing fits
    if relation:
        plan.notes.append(relation)
    if m.moe:
        plan.notes.append("mixture of experts: the repack columns hold the expert weights at int4, as the build "
                          "writes them (one pack-quantized module per expert projection, the layout vLLM 0.32's "
                          "compressed-tensors WNA16 MoE method loads), and the router at bf16 (in other); on a GPU "
                          "vLLM runs them through its fused-MoE kernels (Marlin: read in its source, not run here); "
                          "its CPU backend has no kernel for Gemma 4's gelu_tanh experts (evidence/moe-tiny-cpu.md)")
    if not m.towers_source.startswith("transformers"):
        plan.notes.append(f"towers: {m.towers_source}")
    return plan


def stated_error(m: Member) -> dict[str, Any]:
    """The plan's error as far as a measurement backs it: E2B's against the article's figures; for a member never
    measured, none is known (E2B's calibration applied to its shapes), and the statement says so."""
    e2b = f"loads within {LOAD_ERROR_GIB} GiB, KV tokens within {KV_ERROR:.0%}"
    if m.name in VALIDATED:
        return {"validated": True, "load_gib": LOAD_ERROR_GIB, "kv_relative": KV_ERROR,
                "statement": f"validated against {VALIDATED[m.name]}: {e2b}",
                "calibrated_on": "the article's E2B figures (vLLM 0.29.0, warm start)"}
    return {"validated": False, "load_gib": None, "kv_relative": None,
            "statement": f"unknown, not validated: no measurement of {m.name} exists (E2B's calibration applied "
                         f"to its shapes)",
            "calibrated_on": "the article's E2B figures (vLLM 0.29.0, warm start)"}


def kv_relation(layout: dict[str, Any], max_model_len: int) -> str | None:
    """Why KV cache tokens fall with a shorter context while the users hardly change, where a request's sliding-
    window blocks are most of its blocks: vLLM counts tokens as requests held x max_model_len, and each request
    reserves its sliding layers' window plus a prefill chunk whatever the context (kv_layout)."""
    kinds = layout["kinds"]
    sliding = kinds.get("sliding_attention")
    if sliding is None:
        return None
    reserved = sliding["groups"] * sliding["blocks_per_request"]
    share = reserved / layout["blocks_per_request"]
    if share < 0.5:
        return None
    full = kinds.get("full_attention")
    return (f"KV cache tokens are requests held x max_model_len: a request reserves {reserved:,} blocks for "
            f"sliding-window layers (window + {MAX_NUM_BATCHED_TOKENS:,}-token prefill chunk, whatever the context), "
            f"{full['groups'] * full['blocks_per_request'] if full else 0:,} for full-attention ones (scaling with "
            f"it): at {share:.0%} sliding, a shorter context barely raises the users and the KV tokens fall with it")


class PlanParams(OpParams):
    """Which Gemma 4 member fits one T4, and how: a checkpoint folder (its config.json names the member) or a
    member by name (nothing is downloaded)."""

    path: str | None = Field(None, description="Checkpoint folder (its config.json is read; no tensor)")
    member: str | None = Field(None, description="Member by name: E2B, E4B, 12B, 26B-A4B or 31B")
    memory_mib: int = Field(T4_MIB, ge=1, le=1 << 24, description="GPU memory in MiB (the T4: 15,360)")
    gpu_memory_utilization: float = Field(UTILIZATION, gt=0, le=1, allow_inf_nan=False,
                                          description="Fraction of GPU memory vLLM may use (the article: 0.9)")
    max_model_len: int = Field(MAX_MODEL_LEN, ge=1, le=1 << 24, description="Longest request in tokens, prompt and output (the article: 16,384)")
    max_num_seqs: int = Field(MAX_NUM_SEQS, ge=1, le=1 << 16, description="Most sequences served at once (the article: 8)")

    # the command line takes the folder as an optional positional (`python -m repack plan [PATH] [--member M]`)
    CLI_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"path"})

    @model_validator(mode="after")
    def _one_of(self) -> "PlanParams":
        if self.path is None and self.member is None:
            raise RepackError(f"give a checkpoint folder (path) or {param('member')}", field="member")
        if self.path is not None and self.member is not None:
            raise RepackError(f"give a checkpoint folder (path) or {param('member')}, not both: the folder's "
                              "config.json names its member", field="member")
        return self


def plan_fit(p: PlanParams, roots: list[Path] | None = None) -> FitPlan:
    """The plan for the member a folder's config.json names, or the member named."""
    if p.member is not None:
        m = by_name(p.member)
    else:
        src = Path(p.path)  # type: ignore[arg-type]
        check_source_folder(src)
        cfg = read_config(src, confinement(src, roots))
        if is_drafter(cfg):  # its text_config is its own draft width: no member's, and not what is served alone
            d = identify_drafter(cfg, str(src / "config.json"))
            whose = f"{d.name}'s" if d else "a"
            raise RepackError(f"{src}: {whose} speculative-decoding drafter ({cfg.get('model_type')}), served "
                              f"beside its target, not alone: plan the target ({param('member')} "
                              f"{d.name if d else 'MEMBER'}, or its checkpoint folder)",
                              {"file": str(src / "config.json"), "problem": "drafter-not-planned",
                               "member": d.name if d else None}, field="path")
        m = identify(cfg, str(src / "config.json"))
    return plan_member(m, memory_mib=p.memory_mib, utilization=p.gpu_memory_utilization,
                       max_model_len=p.max_model_len, max_num_seqs=p.max_num_seqs)


def _E2B() -> Member:
    return MEMBERS["E2B"]


__all__ = ["ARTICLE_E2B", "BUILDS", "BuildPlan", "FitPlan", "KV_ERROR", "LOAD_ERROR_GIB", "PlanParams",
           "kv_bytes_per_token", "kv_layout",
           "plan_fit", "plan_member", "rotary_gib"]
