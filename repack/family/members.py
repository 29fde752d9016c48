"""The Gemma 4 family, one registered entry per member: its text configuration (with the public source of each
figure), its towers, and the tables a build of it holds.

A checkpoint's member is read from its config.json (`identify`): the text shapes that tell the members apart
(layers, width, per-layer embeddings, KV-shared layers, mixture of experts) must all match one entry, or the
layout is refused in one line. The shapes of every tensor follow from the configuration (`text_tables`), so
sizes can be planned for a member by name without any download (repack/build/fit.py).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from tools.core.errors import param

from .config import PLE, TOWER_PREFIXES, text_of, validate
from ..errors import RepackError, clip

GIB = 1 << 30


@dataclass(frozen=True)
class Drafter:
    """A member's published speculative-decoding drafter (`-it-qat-q4_0-unquantized-assistant`): its own small
    text model, as its config.json gives it. What ties it to the member is not these figures but what it shares
    with the target (`drafter_keys`): its width here is its own."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    ordered_embeddings: bool   # use_ordered_embeddings: a centroid-masked head (masked_embedding.*, 2,048 centroids)
    source: str


@dataclass(frozen=True)
class Member:
    """One member of the family: its text configuration as config.json spells it, and where each figure is
    read."""

    name: str                  # as Google's repositories spell it: E2B, E4B, 12B, 26B-A4B, 31B
    model_type: str            # the multimodal config's model_type (the 12B is `gemma4_unified`)
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int   # sliding-attention layers
    num_global_key_value_heads: int  # full-attention layers
    head_dim: int              # sliding-attention layers
    global_head_dim: int       # full-attention layers
    sliding_window: int
    full_every: int            # every n-th layer is full attention (layer n-1, 2n-1, ...)
    vocab_size: int = 262_144
    max_position_embeddings: int = 262_144
    hidden_size_per_layer_input: int = 0   # per-layer embeddings (PLE): 0 where the member has none
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False      # MLP twice as wide on the KV-shared layers
    attention_k_eq_v: bool = False         # full-attention layers ship k_proj only (V = K)
    num_experts: int = 0                   # mixture of experts: 0 where the member is dense
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    vision_params: int = 0                 # the towers a text-only build drops (parameters, bf16 in the source)
    audio_params: int = 0
    towers_source: str = ""
    source: str = ""                       # where the text configuration is read
    qat_w4a16_ct: bool = True              # Google published a -qat-w4a16-ct export of it
    drafter: "Drafter | None" = None       # the -assistant drafter Google published for it
    notes: str = ""

    @property
    def source_repo(self) -> str:
        """Google's QAT checkpoint of this member on the Hugging Face hub (what fetch downloads)."""
        return f"google/gemma-4-{self.name}-it-qat-q4_0-unquantized"

    @property
    def w4a16_repo(self) -> str | None:
        return f"google/gemma-4-{self.name}-it-qat-w4a16-ct" if self.qat_w4a16_ct else None

    @property
    def drafter_repo(self) -> str:
        """Google's QAT drafter of this member on the Hugging Face hub."""
        return self.source_repo + "-assistant"

    @property
    def text_model_type(self) -> str:
        """The text_config's model_type (the 12B's text model is gemma4_unified_text)."""
        return "gemma4_unified_text" if self.model_type == "gemma4_unified" else "gemma4_text"

    @property
    def drafter_model_type(self) -> str:
        """The model_type a drafter for this member has (vLLM serves both as gemma4_mtp)."""
        return "gemma4_unified_assistant" if self.model_type == "gemma4_unified" else "gemma4_assistant"

    def drafter_config(self) -> dict[str, Any] | None:
        """The published drafter's config.json as far as its shapes go (what vLLM's gemma4_mtp builds from it):
        its own width, and what it shares with this member (backbone, vocabulary, head sizes, KV heads)."""
        d = self.drafter
        if d is None:
            return None
        kinds = ["sliding_attention"] * (d.num_hidden_layers - 1) + ["full_attention"]
        tc = {"model_type": self.text_model_type,
              "hidden_size": d.hidden_size, "intermediate_size": d.intermediate_size,
              "num_hidden_layers": d.num_hidden_layers, "num_attention_heads": d.num_attention_heads,
              "num_key_value_heads": self.num_key_value_heads,
              "num_global_key_value_heads": self.num_global_key_value_heads, "head_dim": self.head_dim,
              "global_head_dim": self.global_head_dim, "vocab_size": self.vocab_size, "layer_types": kinds,
              "num_kv_shared_layers": d.num_hidden_layers, "hidden_size_per_layer_input": 0,
              "vocab_size_per_layer_input": 0,
              "attention_k_eq_v": self.attention_k_eq_v, "sliding_window": self.sliding_window,
              "tie_word_embeddings": True}
        return {"architectures": ["Gemma4UnifiedAssistantForCausalLM" if self.model_type == "gemma4_unified"
                                  else "Gemma4AssistantForCausalLM"],
                "model_type": self.drafter_model_type, "backbone_hidden_size": self.hidden_size,
                "use_ordered_embeddings": d.ordered_embeddings, "num_centroids": 2048,
                "centroid_intermediate_top_k": 32, "tie_word_embeddings": True, "text_config": tc}

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def first_kv_shared(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention"
                for i in range(self.num_hidden_layers)]

    def text_config(self) -> dict[str, Any]:
        """The text configuration as config.json's text_config writes it (the keys the build and vLLM read)."""
        cfg: dict[str, Any] = {
            "model_type": self.text_model_type,
            "num_hidden_layers": self.num_hidden_layers, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "global_head_dim": self.global_head_dim, "sliding_window": self.sliding_window,
            "layer_types": self.layer_types(), "vocab_size": self.vocab_size,
            "hidden_size_per_layer_input": self.hidden_size_per_layer_input,
            "num_kv_shared_layers": self.num_kv_shared_layers, "use_double_wide_mlp": self.use_double_wide_mlp,
            "attention_k_eq_v": self.attention_k_eq_v, "enable_moe_block": self.moe,
            "tie_word_embeddings": True, "final_logit_softcapping": 30.0,
            "max_position_embeddings": self.max_position_embeddings,
        }
        if self.num_global_key_value_heads != self.num_key_value_heads or self.attention_k_eq_v:
            cfg["num_global_key_value_heads"] = self.num_global_key_value_heads
        if self.moe:
            cfg.update(num_experts=self.num_experts, top_k_experts=self.top_k_experts,
                       moe_intermediate_size=self.moe_intermediate_size)
        return cfg

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "source_repo": self.source_repo, "w4a16_repo": self.w4a16_repo,
                "source": self.source, "towers_source": self.towers_source, "moe": self.moe,
                "per_layer_embeddings": bool(self.hidden_size_per_layer_input),
                "kv_shared_layers": self.num_kv_shared_layers,
                "drafter": ({"repo": self.drafter_repo, **asdict(self.drafter)} if self.drafter else None),
                "text_config": {k: v for k, v in self.text_config().items() if k != "layer_types"},
                "notes": self.notes}


MEMBERS: dict[str, Member] = {}


def register(member: Member) -> Member:
    if member.name in MEMBERS:
        raise ValueError(f"member {member.name} registered twice")
    MEMBERS[member.name] = member
    return member


# transformers 5.19's default Gemma4VisionConfig / Gemma4AudioConfig, counted on the meta device (with the two
# multimodal embedders into the text width): 167,364,608 + 304,824,608 parameters.
_E_TOWERS = "transformers 5.19 default Gemma4VisionConfig/Gemma4AudioConfig, parameters counted on the meta device"

register(Member(
    "E2B", "gemma4", num_hidden_layers=35, hidden_size=1536, intermediate_size=6144, num_attention_heads=8,
    num_key_value_heads=1, num_global_key_value_heads=1, head_dim=256, global_head_dim=512, sliding_window=512,
    full_every=5, max_position_embeddings=131_072, hidden_size_per_layer_input=256, num_kv_shared_layers=20,
    use_double_wide_mlp=True,
    vision_params=167_364_608 + 768 * 1536, audio_params=304_824_608 + 1536 * 1536, towers_source=_E_TOWERS,
    source="config.json of google/gemma-4-E2B-it-qat-q4_0-unquantized (text_config), as the article's rig "
           "(xbill9/gemma4-dev gpu-vllm-t4-2b-w4a16) reads it",
    drafter=Drafter(256, 2048, 4, 4, True,
                    "config.json of google/gemma-4-E2B-it-qat-q4_0-unquantized-assistant as a public quantization "
                    "run prints it (backbone 1,536, hidden 256, intermediate 2,048, head_dim 256/512, 2,048 "
                    "centroids) and public test code transcribes it (4 layers, 4 heads, 1 KV head, ordered "
                    "embeddings): 77.7M parameters"),
    notes="the article's model"))

register(Member(
    "E4B", "gemma4", num_hidden_layers=42, hidden_size=2560, intermediate_size=10240, num_attention_heads=8,
    num_key_value_heads=2, num_global_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512,
    full_every=6, max_position_embeddings=131_072, hidden_size_per_layer_input=256, num_kv_shared_layers=18,
    vision_params=167_364_608 + 768 * 2560, audio_params=304_824_608 + 1536 * 2560, towers_source=_E_TOWERS,
    source="NVIDIA Megatron-Bridge's Gemma 4 E4B recipe test (the hub config's text_config: 42 layers, hidden "
           "2,560, intermediate 10,240, 8 heads, 2 KV heads, head_dim 256/512, PLE 256, 18 KV-shared layers, "
           "sliding/full 5:1)",
    drafter=Drafter(256, 2048, 4, 4, True,
                    "config.json of google/gemma-4-E4B-it-qat-q4_0-unquantized-assistant as public test code "
                    "transcribes it (backbone 2,560, hidden 256, intermediate 2,048, 4 layers, 4 heads, 2 KV heads, "
                    "head_dim 256/512, ordered embeddings); a public load of it counts 78.518M parameters, what "
                    "these shapes give")))

register(Member(
    "12B", "gemma4_unified", num_hidden_layers=48, hidden_size=3840, intermediate_size=15360,
    num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=1, head_dim=256, global_head_dim=512,
    sliding_window=1024, full_every=6, attention_k_eq_v=True,
    source="google/gemma-4-12B-it config.json (Gemma4UnifiedForConditionalGeneration, text_config "
           "gemma4_unified_text) as public test code transcribes it: 48 layers, hidden 3,840, intermediate 15,360, "
           "16 heads, 8 KV heads (1 on full layers, k_eq_v), sliding window 1,024; vLLM 0.32: gemma4_unified.py",
    towers_source="not established (encoder-free vision path): towers counted as none",
    drafter=Drafter(1024, 8192, 4, 16, False,
                    "config.json of the 12B's assistant (gemma4_unified_assistant) as public test code transcribes "
                    "it (mlx-community/gemma-4-12B-it-assistant-4bit; google/gemma-4-12B-it-qat-q4_0-unquantized-"
                    "assistant pinned in public scripts): backbone 3,840, hidden 1,024, intermediate 8,192, 4 "
                    "layers, 16 heads, 8 KV heads (1 on the full layer), no ordered embeddings"),
    notes="dense, no per-layer embeddings; a unified (encoder-free) multimodal layout"))

register(Member(
    "26B-A4B", "gemma4", num_hidden_layers=30, hidden_size=2816, intermediate_size=2112, num_attention_heads=16,
    num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=1024,
    full_every=6, attention_k_eq_v=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
    source="config.json of bg-digitalservices/Gemma-4-26B-A4B-it-NVFP4A16 and mlx-community/gemma-4-26b-a4b-it-4bit "
           "(Google's text_config, as public test code transcribes it): 30 layers, hidden 2,816, dense MLP 2,112 "
           "beside 128 experts of 704 (top 8), 16 heads, 8 KV heads (2 on full layers, k_eq_v), window 1,024",
    towers_source="not established: vision tower counted as none (audio_config null)",
    qat_w4a16_ct=False,
    drafter=Drafter(1024, 8192, 4, 16, False,
                    "public test code's 26B-A4B pairing (backbone 2,816, hidden 1,024, intermediate 8,192, 4 "
                    "layers, no ordered embeddings), heads as its target's; a public README counts "
                    "google/gemma-4-26B-A4B-it-qat-q4_0-unquantized-assistant at 0.42B parameters, 0.78 GiB, "
                    "what these shapes give"),
    notes="mixture of experts, about 3.8B active; Google published no -qat-w4a16-ct export"))

register(Member(
    "31B", "gemma4", num_hidden_layers=60, hidden_size=5376, intermediate_size=21504, num_attention_heads=32,
    num_key_value_heads=16, num_global_key_value_heads=4, head_dim=256, global_head_dim=512, sliding_window=1024,
    full_every=6, attention_k_eq_v=True,
    source="config.json of nvidia/Gemma-4-31B-IT-NVFP4 (Google's text_config, as public test code transcribes it): "
           "60 layers, hidden 5,376, intermediate 21,504, 32 heads, 16 KV heads (4 on full layers, k_eq_v), "
           "window 1,024",
    towers_source="not established: vision tower counted as none (audio_config null)",
    drafter=Drafter(1024, 8192, 4, 32, False,
                    "config.json of the 31B's assistant as public test code transcribes it (mlx-swift-lm, "
                    "vllm-ascend): backbone 5,376, hidden 1,024, intermediate 8,192, 4 layers, 32 heads, 16 KV "
                    "heads (4 on the full layer), no ordered embeddings; google/gemma-4-31B-it-qat-q4_0-"
                    "unquantized-assistant named in public benchmark plans"),
    notes="dense; too large for a T4 at 4 bits"))


def by_name(name: str, where: str = "member") -> Member:
    """The member named (case-insensitive); an unknown name is refused in one line listing the known ones."""
    for m in MEMBERS.values():
        if m.name.lower() == str(name).strip().lower():
            return m
    raise RepackError(f"{param(where)} {clip(repr(name))} is not a Gemma 4 member: choose one of {', '.join(MEMBERS)}",
                      {"field": where, "input": clip(repr(name)), "problem": "unknown-member"}, field=where)


# The keys that tell the members apart, with the default config.json implies where a key is absent.
_KEYS = {"num_hidden_layers": None, "hidden_size": None, "intermediate_size": None, "num_attention_heads": None,
         "num_key_value_heads": None, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
         "num_experts": 0, "moe_intermediate_size": 0}


def _shape_of(m: Member) -> dict[str, Any]:
    return {k: getattr(m, k) for k in _KEYS}


def _read(tc: dict[str, Any]) -> dict[str, Any]:
    got = {k: (tc.get(k) if tc.get(k) is not None else d) for k, d in _KEYS.items()}
    if not tc.get("enable_moe_block", got["num_experts"] > 0):
        got["num_experts"], got["moe_intermediate_size"] = 0, 0
    return got


def identify(config: dict[str, Any], where: str = "config.json") -> Member:
    """The member whose text shapes a config.json has, exactly; an unknown layout, or a shape of the wrong type
    (repack.family.config.validate, before any comparison), is refused in one line."""
    validate(config, where)
    got = _read(text_of(config))
    for m in MEMBERS.values():
        if _shape_of(m) == got:
            return m
    # the nearest member, to say what differs: of the same kind first (experts or dense, per-layer embeddings or
    # not), then by the fewest differing keys
    near = min(MEMBERS.values(), key=lambda m: (m.moe != (got["num_experts"] > 0),
                                                 bool(m.hidden_size_per_layer_input)
                                                 != bool(got["hidden_size_per_layer_input"]),
                                                 sum(_shape_of(m)[k] != got[k] for k in _KEYS)))
    diff = ", ".join(f"{k} {got[k]} (not {_shape_of(near)[k]})" for k in _KEYS if _shape_of(near)[k] != got[k])
    raise RepackError(f"{where}: not a known Gemma 4 layout (nearest {near.name}: {clip(diff, 200)}); the build "
                      f"knows {', '.join(MEMBERS)}",
                      {"file": where, "problem": "unknown-layout", "nearest": near.name}, field=None)


def identify_or_none(config: dict[str, Any]) -> Member | None:
    try:
        return identify(config)
    except RepackError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# A drafter's member: what it shares with its target, not its own (draft-width) text model. vLLM's gemma4_mtp feeds
# pre_projection the target's embedding and last hidden state (2 x backbone_hidden_size), draws from the target's
# vocabulary, and its attention reads the target's KV cache (vllm/v1/spec_decode/gemma4.py: each draft layer reads
# the target's last non-shared layer of its kind), so its head sizes and KV heads per kind are the target's.

FAMILY_VOCAB = 262_144  # every member's (transformers' Gemma4TextConfig default too)


def _drafter_keys(m: Member) -> dict[str, Any]:
    return {"model_type": m.drafter_model_type, "backbone_hidden_size": m.hidden_size,
            "text_config.vocab_size": m.vocab_size, "text_config.head_dim": m.head_dim,
            "text_config.global_head_dim": m.global_head_dim,
            "text_config.num_key_value_heads": m.num_key_value_heads,
            "text_config.num_global_key_value_heads": m.num_global_key_value_heads}


def _drafter_read(config: dict[str, Any]) -> dict[str, Any]:
    tc = text_of(config, whole=False)
    got = {k: (config if "." not in k else tc).get(k.split(".", 1)[-1]) for k in _drafter_keys(MEMBERS["E2B"])}
    if got["backbone_hidden_size"] is None:  # vLLM's gemma4_mtp then takes the drafter's own width
        got["backbone_hidden_size"] = tc.get("hidden_size")
    return got


def identify_drafter(config: dict[str, Any], where: str = "config.json") -> Member | None:
    """The member a drafter's config.json is made for, from what it shares with its target (backbone_hidden_size,
    vocabulary, head sizes, KV heads, model_type); a field the config leaves out is not compared. None for a drafter
    outside the family's vocabulary whose backbone is no member's width: a stand-in or custom drafter, built as a
    stand-in target is. A drafter that claims the family (its vocabulary, or a member's width) at a layout no member
    has is refused in one line."""
    got = _drafter_read(config)
    bb = got["backbone_hidden_size"]
    m = next((m for m in MEMBERS.values() if m.hidden_size == bb), None)
    if m is None:
        if got["text_config.vocab_size"] != FAMILY_VOCAB:
            return None
        widths = ", ".join(f"{x.name} {x.hidden_size}" for x in MEMBERS.values())
        raise RepackError(f"{where}: not a known Gemma 4 drafter layout: backbone_hidden_size {clip(repr(bb), 40)} "
                          f"is no member's width ({widths}) though its vocabulary is the family's; a drafter's "
                          f"backbone is its target's hidden_size: use the drafter published for the target",
                          {"file": where, "problem": "unknown-drafter-layout", "key": "backbone_hidden_size"})
    want = _drafter_keys(m)
    diff = [k for k, v in want.items() if got[k] is not None and got[k] != v]
    if diff:
        shown = ", ".join(f"{k} {clip(repr(got[k]), 40)} (not {want[k]!r})" for k in diff)
        raise RepackError(f"{where}: not a known Gemma 4 drafter layout: backbone_hidden_size {bb} is {m.name}'s, but "
                          f"{clip(shown, 240)}; a drafter reads its target's vocabulary and KV cache at the target's "
                          f"shapes: use {m.name}'s drafter ({m.drafter_repo})",
                          {"file": where, "problem": "unknown-drafter-layout", "nearest": m.name, "key": diff[0]})
    return m


def identify_drafter_or_none(config: dict[str, Any]) -> Member | None:
    try:
        return identify_drafter(config)
    except RepackError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# The tables a member's text model holds, counted from its configuration.

@dataclass
class Table:
    """One table of a build: its parameters and how they are stored."""

    name: str        # linears, PLE, embed_tokens, lm_head, experts, towers, other
    params: int
    notes: str = ""
    shapes: list[tuple[str, list[int], int]] = field(default_factory=list)  # (tensor pattern, shape, count)


def _linear_shapes(m: Member) -> Iterator[tuple[str, list[int], int]]:
    """Every 2-D linear of the text model as (pattern, [out, in], count), from the configuration: q/k/v/o per
    layer (k/v only on layers that own their KV; v not on k_eq_v full layers), the MLP, the PLE projections."""
    h, types = m.hidden_size, m.layer_types()
    per: dict[tuple[str, tuple[int, int]], int] = {}

    def add(name: str, out: int, inp: int) -> None:
        per[(name, (out, inp))] = per.get((name, (out, inp)), 0) + 1

    for i, t in enumerate(types):
        full = t == "full_attention"
        hd = m.global_head_dim if full else m.head_dim
        kv = m.num_global_key_value_heads if full else m.num_key_value_heads
        add("self_attn.q_proj", m.num_attention_heads * hd, h)
        add("self_attn.o_proj", h, m.num_attention_heads * hd)
        if i < m.first_kv_shared:
            add("self_attn.k_proj", kv * hd, h)
            if not (full and m.attention_k_eq_v):
                add("self_attn.v_proj", kv * hd, h)
        inter = m.intermediate_size * (2 if m.use_double_wide_mlp and i >= m.first_kv_shared > 0 else 1)
        add("mlp.gate_proj", inter, h)
        add("mlp.up_proj", inter, h)
        add("mlp.down_proj", h, inter)
        if m.hidden_size_per_layer_input:
            add("per_layer_input_gate", m.hidden_size_per_layer_input, h)
            add("per_layer_projection", h, m.hidden_size_per_layer_input)
    if m.hidden_size_per_layer_input:
        add("per_layer_model_projection", m.num_hidden_layers * m.hidden_size_per_layer_input, h)
    for (name, shape), n in per.items():
        yield name, list(shape), n


def text_tables(m: Member) -> dict[str, Table]:
    """The text model's tables: linears, the expert weights (MoE), the PLE table, embed_tokens, and the rest
    (norms, layer scalars, the router, which every build keeps bf16): parameters counted from the configuration."""
    h = m.hidden_size
    lin = list(_linear_shapes(m))
    out = {"linears": Table("linears", sum(s[0] * s[1] * n for _, s, n in lin), "q/k/v/o, MLP, PLE projections",
                            lin)}
    if m.moe:
        e, mi = m.num_experts, m.moe_intermediate_size
        shapes = [("experts.gate_up_proj", [e, 2 * mi, h], m.num_hidden_layers),
                  ("experts.down_proj", [e, h, mi], m.num_hidden_layers)]
        out["experts"] = Table("experts", sum(a * b * c * n for _, (a, b, c), n in shapes),
                               f"{e} experts of {mi} (top {m.top_k_experts}) per layer", shapes)
    if m.hidden_size_per_layer_input:
        w = m.num_hidden_layers * m.hidden_size_per_layer_input
        out["PLE"] = Table("PLE", m.vocab_size * w, PLE, [(PLE, [m.vocab_size, w], 1)])
    out["embed_tokens"] = Table("embed_tokens", m.vocab_size * h, "tied to the output layer",
                                [("embed_tokens", [m.vocab_size, h], 1)])
    # RMSNorm weights: 4 per layer (input, post-attention, pre/post feed-forward), q/k norms, a PLE norm; the MoE
    # block's three extra norms, the router's scales and its projection [experts, hidden] (bf16 in every build:
    # vLLM runs it unquantized): small, counted so the total is whole
    norms = m.num_hidden_layers * (4 * h + 2 * m.global_head_dim + (h if m.hidden_size_per_layer_input else 0)
                                   + (3 * h + h + m.num_experts + m.num_experts * h if m.moe else 0) + 1) + h
    out["other"] = Table("other", norms, "norms, layer scalars, the router")
    return out


def towers_params(m: Member) -> int:
    return m.vision_params + m.audio_params


__all__ = ["FAMILY_VOCAB", "FUSED_EXPERTS", "GIB", "MEMBERS", "Drafter", "Member", "Table", "by_name", "identify",
           "identify_drafter", "identify_drafter_or_none", "identify_or_none", "register", "text_tables",
           "towers_params"]


# A mixture-of-experts block's fused expert weights as transformers' Gemma4TextExperts holds them (and Google's
# checkpoints store them): gate_up_proj [experts, 2 x moe_intermediate, hidden], the gate rows first, and down_proj
# [experts, hidden, moe_intermediate]. The build packs each expert's projections as modules of their own.
FUSED_EXPERTS = re.compile(r"(^|\.)layers\.\d+\.experts\.(gate_up_proj|down_proj)$")


def refuse_unpackable(tensors: dict[str, Any], where: str) -> None:
    """A text tensor of three or more dimensions under `.experts.` that is not one of the fused expert weights
    the build packs (`experts.gate_up_proj`, `experts.down_proj`) is a layout neither the build nor vLLM's Gemma 4
    loading knows; refused in one line, before anything is written, rather than copied to a build that would not
    load."""
    for name, info in tensors.items():
        if len(info.shape) >= 3 and not name.startswith(TOWER_PREFIXES) \
                and ".experts." in name and not FUSED_EXPERTS.search(name):
            raise RepackError(f"{where}: {clip(name, 120)} is a mixture-of-experts weight {list(info.shape)} in a "
                              f"layout this build does not know (it packs experts.gate_up_proj and "
                              f"experts.down_proj as Gemma 4 checkpoints hold them); use the checkpoint as Google "
                              f"published it",
                              {"file": where, "tensor": clip(name, 120), "problem": "moe-layout"})
