"""Synthetic QAT-like checkpoints made with numpy: for the benchmark (a dense member's real shapes, E2B's or
another's from repack/family/members.py, any fraction of the full size) and for tests that need hand-made edge cases
(bad headers, odd dtypes, off-grid groups).

Values are bf16(step * level) with a per-group step and the group's peak at a level between 4 and 8 (8 only
for a negative peak), so a recovery assuming amax/8 or amax/7 would fail; towers hold random bf16 words that
sit on no grid.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

from ..family.members import Member, by_name

GROUP = 32


def grid_words(rows: int, cols: int, rng: np.random.Generator, step_dtype: type = np.float16,
               jitter: float = 0.0, levels: str = "uniform", step_draw: str = "log-uniform") -> np.ndarray:
    """uint16 bf16 words on a symmetric 4-bit grid, groups of 32 along the last axis.

    levels: "uniform" draws every level uniformly from those the group's peak allows; "peaked" draws them
    Laplace-like around 0 (most values at small levels, as trained weights are), the peak still at 4..8.
    jitter rounds that fraction of the values the other way (to the second-nearest bf16, less than one ulp
    away), as the real checkpoint's own rounding leaves about a quarter of its values one ulp from what any
    single fp16 scale reproduces; so whole groups are rarely reproduced and every candidate scale is tried.
    step_draw: each group's step log-uniformly ("log-uniform") or uniformly ("uniform") over [e^-9, e^-3]."""
    ng = cols // GROUP
    peak = rng.integers(4, 9, size=(rows, ng), dtype=np.int8)          # the level the peak occupies
    neg = (peak == 8) | (rng.random((rows, ng)) < 0.5)
    if levels == "peaked":
        lv = np.clip(np.rint(rng.laplace(0.0, 1.5, size=(rows, ng, GROUP))), -8, 7).astype(np.int8)
    elif levels == "uniform":
        lv = rng.integers(-8, 8, size=(rows, ng, GROUP), dtype=np.int8)
    else:
        raise ValueError(f"levels {levels!r}: choose uniform or peaked")
    lv = np.clip(lv, -peak[..., None], np.minimum(peak, 7)[..., None])
    pos = rng.integers(0, GROUP, size=(rows, ng))
    np.put_along_axis(lv, pos[..., None], np.where(neg, -peak, peak)[..., None].astype(np.int8), axis=-1)
    if step_draw == "log-uniform":
        step = np.exp(rng.uniform(-9.0, -3.0, size=(rows, ng)))
    elif step_draw == "uniform":
        step = rng.uniform(np.exp(-9.0), np.exp(-3.0), size=(rows, ng))
    else:
        raise ValueError(f"step_draw {step_draw!r}: choose log-uniform or uniform")
    step = step.astype(step_dtype).astype(np.float32)
    v = lv.astype(np.float32) * step[..., None]
    b = v.reshape(rows, cols).view(np.uint32)
    w = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even bf16
    if jitter > 0:
        exact = np.abs(v.reshape(rows, cols))
        near = ((w.astype(np.uint32) & 0x7FFF) << 16).view(np.float32)
        mag = w & 0x7FFF
        other = np.where(near > exact, mag - 1, np.where(near < exact, mag + 1, mag)).astype(np.uint16)
        pick = (rng.random(w.shape) < jitter) & (mag > 0x0080)
        w = np.where(pick, (w & 0x8000) | other, w).astype(np.uint16)
    return w


def random_words(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """bf16 words of small normal values (no grid): tower weights, norms, a base model."""
    v = (rng.standard_normal(int(np.prod(shape)), dtype=np.float32) * 0.02).view(np.uint32)
    return (v >> 16).astype(np.uint16).reshape(shape)


def write_safetensors(path: Path, tensors: Iterable[tuple[str, str, tuple[int, ...], bytes | np.ndarray]],
                      metadata: dict[str, str] | None = None) -> None:
    """A minimal safetensors writer (names sorted, data contiguous), streaming one tensor at a time."""
    items = sorted(tensors, key=lambda t: t[0])
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    pos = 0
    for name, dtype, shape, data in items:
        n = data.nbytes if isinstance(data, np.ndarray) else len(data)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, _, data in items:
            f.write(data.tobytes() if isinstance(data, np.ndarray) else data)


def tiny_text_config(vocab: int = 64, hidden: int = 64, layers: int = 2) -> dict:
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "dtype": "bfloat16",
            "tie_word_embeddings": True,
            "text_config": {"model_type": "gemma4_text", "vocab_size": vocab, "hidden_size": hidden,
                            "num_hidden_layers": layers, "hidden_size_per_layer_input": 32,
                            "tie_word_embeddings": True},
            "vision_config": {"model_type": "gemma4_vision"}}


def write_small_checkpoint(out: Path, *, seed: int = 0, extra: dict[str, tuple[str, tuple[int, ...], bytes]]
                           | None = None, off_grid: tuple[str, int, int] | None = None) -> Path:
    """A small multimodal-layout checkpoint (one shard): embeddings, two layers of linears, norms, a tower.

    extra adds or replaces tensors (name -> (dtype, shape, raw bytes)); off_grid=(tensor, row, group) nudges
    one value of that group off the grid by 5 ulps."""
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(tiny_text_config(), indent=2))
    (out / "tokenizer.json").write_text("{}")
    p = "model.language_model."
    t: dict[str, tuple[str, tuple[int, ...], np.ndarray | bytes]] = {
        p + "embed_tokens.weight": ("BF16", (64, 64), grid_words(64, 64, rng)),
        p + "embed_tokens_per_layer.weight": ("BF16", (64, 64), grid_words(64, 64, rng)),
        p + "per_layer_model_projection.weight": ("BF16", (64, 64), grid_words(64, 64, rng)),
        p + "norm.weight": ("BF16", (64,), random_words((64,), rng)),
        "model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight": ("BF16", (64, 64),
                                                                          random_words((64, 64), rng)),
    }
    for i in range(2):
        for mod, shape in (("self_attn.q_proj", (64, 64)), ("mlp.up_proj", (128, 64)), ("mlp.down_proj", (64, 128))):
            t[f"{p}layers.{i}.{mod}.weight"] = ("BF16", shape, grid_words(*shape, rng))
        t[f"{p}layers.{i}.input_layernorm.weight"] = ("BF16", (64,), random_words((64,), rng))
        t[f"{p}layers.{i}.layer_scalar"] = ("BF16", (1,), random_words((1,), rng))
    if off_grid is not None:
        name, row, group = off_grid
        w = np.array(t[name][2], copy=True)
        w[row, group * GROUP + 3] = np.uint16(w[row, group * GROUP + 3] + 5)
        t[name] = (t[name][0], t[name][1], w)
    for name, (dtype, shape, data) in (extra or {}).items():
        t[name] = (dtype, shape, data)
    write_safetensors(out / "model.safetensors", [(n, d, s, v) for n, (d, s, v) in t.items()])
    return out


# -- Member-shaped checkpoints for the benchmark ------------------------------------------------------------

HIDDEN, PLE_DIM, LAYERS, VOCAB = 1536, 256, 35, 262144  # E2B's (repack/family/members.py holds every member's)
FIRST_SHARED = 15  # E2B: layers 15-34 reuse KV of earlier layers: no k/v projections


def _member(member: str | Member) -> Member:
    m = by_name(member) if isinstance(member, str) else member
    if m.moe:
        raise ValueError(f"member {m.name}: the synthetic writer lays out dense members only (no expert weights)")
    return m


def member_tensors(member: str | Member, scale: float = 1.0) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of a QAT checkpoint shaped like a dense member of repack/family/members.py; scale shrinks the
    vocabulary, the layer count and the towers together. kind: 'grid' (on the 4-bit grid), 'tower' (random),
    'norm' (random). The text tensors are those members.text_tables counts: q/o on every layer, k/v only on the
    layers that own their KV (no v on a k_eq_v member's full layers), double-wide MLPs where the member has them,
    per-layer embeddings and their projections where it has them."""
    m = _member(member)
    hidden, ple = m.hidden_size, m.hidden_size_per_layer_input
    vocab = max(GROUP, int(m.vocab_size * scale) // GROUP * GROUP)
    layers = max(2, round(m.num_hidden_layers * scale))
    if not m.num_kv_shared_layers:
        first_shared = layers
    else:
        first_shared = min(m.first_kv_shared, layers - 1) if scale < 1 else m.first_kv_shared
    p = "model.language_model."
    out: list[tuple[str, tuple[int, ...], str]] = [(p + "embed_tokens.weight", (vocab, hidden), "grid")]
    if ple:
        out += [(p + "embed_tokens_per_layer.weight", (vocab, ple * layers), "grid"),
                (p + "per_layer_model_projection.weight", (ple * layers, hidden), "grid"),
                (p + "per_layer_projection_norm.weight", (ple,), "norm")]
    out.append((p + "norm.weight", (hidden,), "norm"))
    for i in range(layers):
        full = (i + 1) % m.full_every == 0
        hd = m.global_head_dim if full else m.head_dim
        kv = (m.num_global_key_value_heads if full else m.num_key_value_heads) * hd
        q = m.num_attention_heads * hd
        mlp = m.intermediate_size * (2 if m.use_double_wide_mlp and i >= first_shared else 1)
        lp = f"{p}layers.{i}."
        out += [(lp + "self_attn.q_proj.weight", (q, hidden), "grid"),
                (lp + "self_attn.o_proj.weight", (hidden, q), "grid"),
                (lp + "self_attn.q_norm.weight", (hd,), "norm")]
        if i < first_shared:
            out.append((lp + "self_attn.k_proj.weight", (kv, hidden), "grid"))
            if not (full and m.attention_k_eq_v):
                out.append((lp + "self_attn.v_proj.weight", (kv, hidden), "grid"))
            out.append((lp + "self_attn.k_norm.weight", (hd,), "norm"))
        out += [(lp + "mlp.gate_proj.weight", (mlp, hidden), "grid"),
                (lp + "mlp.up_proj.weight", (mlp, hidden), "grid"),
                (lp + "mlp.down_proj.weight", (hidden, mlp), "grid")]
        if ple:
            out += [(lp + "per_layer_input_gate.weight", (ple, hidden), "grid"),
                    (lp + "per_layer_projection.weight", (hidden, ple), "grid")]
        out.append((lp + "layer_scalar", (1,), "norm"))
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm") + (("post_per_layer_input_norm",) if ple else ()):
            out.append((lp + n + ".weight", (hidden,), "norm"))
    if m.vision_params or m.audio_params:
        # Towers: ~1 GB at full size (vision ~0.3B and audio ~0.3B parameters), as a few big random tensors; the
        # text-only build drops them, so only their presence and rough size matter.
        tower_rows = max(1, int(4096 * scale))
        for i in range(16):
            out.append((f"model.vision_tower.encoder.layers.{i}.mlp.up_proj.linear.weight", (tower_rows, 4608),
                        "tower"))
        for i in range(12):
            out.append((f"model.audio_tower.layers.{i}.feed_forward1.ffw_layer_1.linear.weight", (tower_rows, 4096),
                        "tower"))
        out.append(("model.embed_vision.embedding_projection.weight", (hidden, 768), "tower"))
        out.append(("model.embed_audio.embedding_projection.weight", (hidden, 1536), "tower"))
    return out


def member_config(member: str | Member, specs: list[tuple[str, tuple[int, ...], str]]) -> dict:
    """A config laid out like the hub's (google/gemma-4-E2B-it-qat-q4_0-unquantized: nested text_config with
    `global_head_dim`, KV sharing, a tied head) with the member's figures, for the tensors of
    member_tensors(member, scale): the layer count, the KV-owning layers and the vocabulary follow the tensors."""
    m = _member(member)
    shapes = {n: s for n, s, _ in specs}
    p = "model.language_model."
    layers = sum(1 for n in shapes if n.endswith("layer_scalar"))
    owners = sum(1 for n in shapes if n.endswith("self_attn.k_proj.weight"))
    vocab = shapes[p + "embed_tokens.weight"][0]
    full_q = m.num_attention_heads * m.global_head_dim
    text = {"model_type": m.text_model_type, "vocab_size": vocab}
    if m.hidden_size_per_layer_input:
        text["vocab_size_per_layer_input"] = vocab
    text.update({
        "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size, "num_hidden_layers": layers,
        # The layer types follow the tensors: q_proj is heads x global_head_dim rows on full-attention layers.
        "layer_types": ["full_attention" if shapes[f"{p}layers.{i}.self_attn.q_proj.weight"][0] == full_q
                        else "sliding_attention" for i in range(layers)],
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_key_value_heads,
        "head_dim": m.head_dim, "global_head_dim": m.global_head_dim})
    if m.num_global_key_value_heads != m.num_key_value_heads or m.attention_k_eq_v:
        text["num_global_key_value_heads"] = m.num_global_key_value_heads
    text.update({
        "hidden_size_per_layer_input": m.hidden_size_per_layer_input, "num_kv_shared_layers": layers - owners,
        "use_double_wide_mlp": m.use_double_wide_mlp, "final_logit_softcapping": 30.0,
        "sliding_window": m.sliding_window, "max_position_embeddings": m.max_position_embeddings,
        "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                               "rope_theta": 1000000.0}},
        "attention_bias": False, "attention_k_eq_v": m.attention_k_eq_v, "enable_moe_block": False,
        "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
        "dtype": "bfloat16"})
    arch = "Gemma4UnifiedForConditionalGeneration" if m.model_type == "gemma4_unified" else \
        "Gemma4ForConditionalGeneration"
    out = {"architectures": [arch], "model_type": m.model_type, "dtype": "bfloat16",
           "tie_word_embeddings": True, "text_config": text}
    if m.vision_params:
        out["vision_config"] = {"model_type": "gemma4_vision"}
    if m.audio_params:
        out["audio_config"] = {"model_type": "gemma4_audio"}
    out.update({"boi_token_id": 7, "eoi_token_id": 8, "image_token_id": 9, "video_token_id": 10, "boa_token_id": 11,
                "eoa_token_index": 12, "audio_token_id": 13})
    return out


def e2b_tensors(scale: float = 1.0) -> list[tuple[str, tuple[int, ...], str]]:
    """member_tensors of E2B (the article's model)."""
    return member_tensors("E2B", scale)


def e2b_config(specs: list[tuple[str, tuple[int, ...], str]]) -> dict:
    """member_config of E2B."""
    return member_config("E2B", specs)


def copy_tokenizer(src: Path, out: Path, vocab: int) -> None:
    """The tokenizer files of `src` (the tiny model's) into `out`, its vocabulary widened with `<unused_N>`
    entries up to `vocab` so every id the model can generate decodes."""
    for name in ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).is_file():
            (out / name).write_bytes((src / name).read_bytes())
    tok = json.loads((src / "tokenizer.json").read_text())
    have = set(tok["model"]["vocab"].values())
    tok["model"]["vocab"].update({f"<unused_{i}>": i for i in range(vocab) if i not in have})
    (out / "tokenizer.json").write_text(json.dumps(tok))


def _tensor_bytes(kind: str, shape: tuple[int, ...], rng: np.random.Generator, fill: str, step_dtype: type,
                  jitter: float, levels: str, step_draw: str) -> Iterable[bytes]:
    """The tensor's data in row blocks. fill "tiled" draws one block and repeats it (same shapes and grid
    properties, written at disk speed: for serving, where the values do not matter)."""
    if kind == "norm" or len(shape) == 1:
        yield random_words(shape, rng).tobytes()
        return
    rows, cols = shape
    per = max(1, (8 << 20) // (cols * 2))
    tile = None
    for r0 in range(0, rows, per):
        n = min(per, rows - r0)
        if tile is None or fill != "tiled":
            tile = (grid_words(n, cols, rng, step_dtype, jitter, levels, step_draw) if kind == "grid"
                    else random_words((n, cols), rng)).tobytes()
        yield tile[:n * cols * 2]


def write_member_checkpoint(member: str | Member, out: Path, scale: float = 1.0, seed: int = 0,
                            progress: bool = False, jitter: float = 0.26, step_dtype: type = np.float32,
                            levels: str = "uniform", step_draw: str = "log-uniform", fill: str = "grid") -> int:
    """Writes a synthetic checkpoint shaped like a dense member as ONE model.safetensors (as Google ships E2B)
    with a config laid out like the hub's (member_config), streaming row blocks so memory stays small at full
    size. Grid tensors: `grid_words` with the given step dtype, level distribution and jitter. fill: "grid" (every
    block drawn), "tiled" (one block per tensor, repeated) or "none" (a sparse file: the header and the size
    only, for planning at real shapes). Returns the file size."""
    if fill not in ("grid", "tiled", "none"):
        raise ValueError(f"fill {fill!r}: choose grid, tiled or none")
    m = _member(member)
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    specs = sorted(member_tensors(m, scale))
    header: dict = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, shape, _ in specs:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    (out / "config.json").write_text(json.dumps(member_config(m, specs), indent=2))
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        if fill == "none":
            f.truncate(8 + len(raw) + pos)
            return 8 + len(raw) + pos
        for k, (name, shape, kind) in enumerate(specs):
            if progress:
                print(f"\r  writing {k + 1}/{len(specs)} {name[:70]:<70}", end="", flush=True)
            for block in _tensor_bytes(kind, shape, rng, fill, step_dtype, jitter, levels, step_draw):
                f.write(block)
    if progress:
        print()
    return 8 + len(raw) + pos


def write_e2b_checkpoint(out: Path, scale: float = 1.0, seed: int = 0, progress: bool = False,
                        jitter: float = 0.26, step_dtype: type = np.float32, levels: str = "uniform",
                        step_draw: str = "log-uniform", fill: str = "grid") -> int:
    """write_member_checkpoint of E2B (the article's model): the same files as before members were general."""
    return write_member_checkpoint("E2B", out, scale, seed, progress, jitter, step_dtype, levels, step_draw, fill)
