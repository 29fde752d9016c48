"""A tiny Gemma-4-shaped, QAT-like multimodal checkpoint, built here so nothing has to be downloaded.

It has the real layout of `google/gemma-4-E2B-it-qat-q4_0-unquantized` at a small size: a nested
`Gemma4ForConditionalGeneration` config with text, vision and audio towers, `model.language_model.*` names,
per-layer embeddings (PLE), KV-shared layers without k/v projections, double-wide MLPs on shared layers, a
tied head, sharded safetensors with an index, a byte-level tokenizer with a Gemma chat template. A matching
tiny drafter in the layout of Google's `gemma4_assistant` (build_tiny_drafter) is trained on the same pattern
and projected onto the same grid.

The text model is trained for a few seconds on a synthetic pattern (each token is followed by a fixed
permutation of itself) so that greedy decoding is confident and does not flip between kernels, then every
linear weight and both embedding tables are projected onto a symmetric 4-bit grid in groups of 32 along the
input axis, as QAT leaves them: bf16 values equal to bf16(step * level), the exact product of an fp32 step and
a level in [-8, 7] rounded once to bf16, with the group's peak at a level between 4 and 8. The steps are
fp32 values, as a QAT run learns them, not values of fp16 or bf16: no scale dtype reproduces every value, and
scales chosen for fp16 arithmetic differ from scales chosen for the least error, as on the real checkpoint.

It has 16,384 positions (the real model's rope settings, which hold for that length), so long prompts can be
served.

torch and transformers are imported lazily: they come with vLLM, not with the repack library.
"""

from __future__ import annotations

from contextlib import contextmanager

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..family.config import text_of
from .tiny_marker import mark
from .tiny_shapes import SHAPES

GROUP = 32
VOCAB = 512
# Special tokens, in the positions Gemma uses for the first three.
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
            "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<video_soft_token>",
            "<start_of_audio>", "<end_of_audio>", "<audio_soft_token>"]
FIRST_BYTE_ID = 16  # byte tokens follow the specials; ids past them up to VOCAB are <unused_N>

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=128, intermediate_size=256,
    num_hidden_layers=6,
    # Explicit: the default pattern with KV sharing can leave no non-shared full-attention layer.
    layer_types=["sliding_attention", "sliding_attention", "full_attention",
                 "sliding_attention", "sliding_attention", "full_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
    hidden_size_per_layer_input=32, num_kv_shared_layers=2, use_double_wide_mlp=True,
    final_logit_softcapping=30.0, sliding_window=64, max_position_embeddings=16384,
    # Gemma 4's own rope settings (sliding layers: theta 10k; full layers: proportional, a quarter of the head
    # dimension rotated, theta 1M), unscaled: valid well past 16,384 positions.
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0}},
    bos_token_id=2, eos_token_id=1, pad_token_id=0,
)
def text_config(shape: str = "e2b") -> dict[str, Any]:
    """The text config shaped as `shape` (repack.stand_ins.tiny_shapes.SHAPES)."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r}: choose one of {', '.join(SHAPES)}")
    return {**TEXT_CONFIG, **SHAPES[shape]}


# What tells the stand-in shapes apart in a config.json (a source's or a build's): shape_of reads them.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "use_double_wide_mlp", "hidden_size_per_layer_input", "num_kv_shared_layers",
               "num_experts")


def shape_of(config: dict[str, Any]) -> str | None:
    """The stand-in shape (SHAPES) a config.json was built as, or None for any other model."""
    tc = text_of(config)
    for shape in SHAPES:
        want = text_config(shape)
        if all((tc.get(k) or 0) == (want.get(k) or 0) for k in _SHAPE_KEYS):
            return shape
    return None


VISION_CONFIG: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                                     position_embedding_size=64, patch_size=4)
AUDIO_CONFIG: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    subsampling_conv_channels=[32, 32], output_proj_dims=128)
MM_TOKEN_IDS = dict(boi_token_id=7, eoi_token_id=8, image_token_id=9, video_token_id=10,
                    boa_token_id=11, eoa_token_index=12, audio_token_id=13)


# Trained text-model weights by (seed, train_steps), kept for the process: a second build from the same training
# (the base-model stand-in after the QAT one) skips the seconds of torch training.
_TRAINED: dict[tuple[int, int, str], tuple[dict[str, Any], Any]] = {}


@dataclass(frozen=True)
class TinyModelInfo:
    path: Path
    accuracy: float          # next-token accuracy of the grid-projected model on the training pattern
    grid_tensors: list[str]  # tensors projected onto the 4-bit grid
    permutation_seed: int


def pattern_permutation(seed: int):
    """The synthetic pattern: token t (a byte token or unused id) is followed by perm[t]."""
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.arange(FIRST_BYTE_ID, VOCAB)
    perm = torch.arange(VOCAB)
    perm[FIRST_BYTE_ID:] = ids[torch.randperm(len(ids), generator=g)]
    return perm


def _batch(perm, batch: int, seq: int, gen):
    import torch

    start = torch.randint(FIRST_BYTE_ID, VOCAB, (batch,), generator=gen)
    rows = [start]
    for _ in range(seq - 1):
        rows.append(perm[rows[-1]])
    return torch.stack(rows, dim=1)


def project_to_grid(weight, *, seed: int):
    """bf16 values on a symmetric 4-bit grid, groups of 32 along the last axis, as QAT exports them.

    The step of each group puts its peak at level 4..7 (8 for a negative peak half the time), so that a
    recovery assuming amax/8 or amax/7 would be wrong for most groups.
    """
    import torch

    w = weight.detach().float()
    rows, cols = w.shape
    if cols % GROUP:
        raise ValueError(f"last dimension {cols} is not a multiple of {GROUP}")
    g = torch.Generator().manual_seed(seed)
    grp = w.reshape(rows, cols // GROUP, GROUP)
    amax, idx = grp.abs().max(dim=-1)
    peak_negative = torch.gather(grp, -1, idx.unsqueeze(-1)).squeeze(-1) < 0
    level = torch.randint(4, 8, amax.shape, generator=g).float()
    use_eight = peak_negative & (torch.rand(amax.shape, generator=g) < 0.5)
    level = torch.where(use_eight, torch.full_like(level, 8.0), level)
    # The step as QAT learns it: an fp32 value, in general representable in neither fp16 nor bf16.
    step = (amax / level).float()
    # An all-zero group (the pad token's embedding row) stays all zero; a step of 1 avoids 0/0.
    step = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.clamp(torch.round(grp / step.unsqueeze(-1)), -8, 7)
    # step * level is exact in float64 (24 + 4 significant bits) and is rounded once, to nearest even bf16.
    return _round_bf16(q.double() * step.double().unsqueeze(-1)).reshape(rows, cols).to(torch.bfloat16)


def _round_bf16(v):
    """Round float64 values (normal bf16 range) to the nearest bf16 value, ties to even, in one rounding (a cast
    through float32 would round twice)."""
    import torch

    _, e = torch.frexp(v)
    quantum = torch.ldexp(torch.ones_like(v), (e - 8).to(v.dtype))
    return torch.round(v / quantum) * quantum  # the result has 8 significant bits: exact in bf16


def _write_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(len(SPECIALS), FIRST_BYTE_ID):
        vocab[f"<reserved_{i}>"] = i
    for b, ch in enumerate(_byte_chars()):
        vocab[ch] = FIRST_BYTE_ID + b
    for i in range(FIRST_BYTE_ID + 256, VOCAB):
        vocab[f"<unused_{i}>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t in vocab if t.startswith("<") and t.endswith(">") and len(t) > 1])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
        "add_bos_token": False, "add_eos_token": False, "model_max_length": TEXT_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}, indent=2))


def _byte_chars() -> list[str]:
    """The printable character ByteLevel uses for each byte 0..255, in byte order (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def build_tiny_qat_checkpoint(out_dir: str | Path, *, seed: int = 0, train_steps: int = 200,
                              on_grid: bool = True, max_shard_size: str = "1MB", shape: str = "e2b") -> TinyModelInfo:
    """Writes the tiny multimodal checkpoint to out_dir (replaced if present) and returns what it wrote.

    on_grid=False leaves the trained bf16 weights as they are: a stand-in for a base (non-QAT) model. shape: the
    member it is shaped as (SHAPES: e2b, e4b, moe).
    """
    cfg = text_config(shape)
    with _one_thread():
        return _build(out_dir, seed=seed, train_steps=train_steps, on_grid=on_grid, max_shard_size=max_shard_size,
                      text_cfg=cfg, shape=shape)


@contextmanager
def _one_thread():
    """Train on one thread: the models are too small to gain from more, and on a shared machine several threads
    of several processes wait on each other at every op (evidence/suite-speed.md). It also makes the trained
    weights independent of the core count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _build(out_dir: str | Path, *, seed: int, train_steps: int, on_grid: bool, max_shard_size: str,
           text_cfg: dict[str, Any], shape: str) -> TinyModelInfo:
    import torch
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    perm = pattern_permutation(seed)

    text = Gemma4ForCausalLM(Gemma4TextConfig(**text_cfg))
    trained = _TRAINED.get((seed, train_steps, shape))
    if trained is None:
        text.train()
        opt = torch.optim.AdamW(text.parameters(), lr=3e-3, weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(train_steps):
            ids = _batch(perm, 32, 24, gen)
            loss = text(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        _TRAINED[(seed, train_steps, shape)] = ({k: v.detach().clone() for k, v in text.state_dict().items()},
                                         torch.get_rng_state())
    else:
        # The same training done earlier in this process (the on- and off-grid models share it): its weights,
        # and the random state it left, so what follows draws the same numbers and writes the same files.
        text.load_state_dict(trained[0])
        torch.set_rng_state(trained[1])
    text.eval()

    cfg = Gemma4Config(text_config=dict(text_cfg), vision_config=VISION_CONFIG, audio_config=AUDIO_CONFIG,
                       **MM_TOKEN_IDS)
    mm = Gemma4ForConditionalGeneration(cfg)
    mm_state = mm.state_dict()
    grid_tensors: list[str] = []
    with torch.no_grad():
        for name, value in text.state_dict().items():
            if name == "lm_head.weight":
                continue  # tied to embed_tokens
            target = "model.language_model." + name.removeprefix("model.")
            mm_state[target].copy_(value)
        mm.load_state_dict(mm_state)
        mm.to(torch.bfloat16)
        if on_grid:
            for i, (name, p) in enumerate(mm.named_parameters()):
                if not name.startswith("model.language_model.") or p.ndim not in (2, 3):
                    continue
                if p.ndim == 3:  # a mixture of experts' fused weights: every expert's matrix on the grid
                    p.copy_(project_to_grid(p.reshape(-1, p.shape[-1]), seed=seed * 7919 + i).reshape(p.shape))
                else:
                    p.copy_(project_to_grid(p, seed=seed * 7919 + i))
                grid_tensors.append(name)
    mm.generation_config.do_sample = False
    mm.save_pretrained(out, max_shard_size=max_shard_size)
    _write_tokenizer(out)
    mark(out, "source")

    # Accuracy of the saved (projected) weights on the pattern, after the first position.
    with torch.no_grad():
        ids = _batch(perm, 16, 24, torch.Generator().manual_seed(seed + 1))
        logits = mm(input_ids=ids).logits.float()
        pred = logits[:, :-1].argmax(-1)
        accuracy = float((pred[:, 1:] == ids[:, 2:]).float().mean())
    return TinyModelInfo(path=out, accuracy=accuracy, grid_tensors=grid_tensors, permutation_seed=seed)


# The drafter (Google's `gemma4_assistant` layout, served by vLLM as `gemma4_mtp`): its own, narrower width
# (hidden_size differs from the target's by design), every layer reading the target's KV cache (no k/v
# projections), one sliding and one full layer with the target's head sizes, no per-layer inputs.
DRAFTER_TEXT_CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, vocab_size_per_layer_input=0, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
    num_attention_heads=2, num_key_value_heads=1, head_dim=32, global_head_dim=64,
    hidden_size_per_layer_input=0, num_kv_shared_layers=2, use_double_wide_mlp=False,
    final_logit_softcapping=30.0, sliding_window=64, max_position_embeddings=16384,
    rope_parameters=TEXT_CONFIG["rope_parameters"],
    bos_token_id=2, eos_token_id=1, pad_token_id=0,
)


@dataclass(frozen=True)
class TinyDrafterInfo:
    path: Path
    accuracy: float  # share of tokens t for which the drafter's first draft is the pattern's perm[t]
    grid_tensors: tuple[str, ...] = ()  # tensors projected onto the 4-bit grid


def build_tiny_drafter(out_dir: str | Path, target_dir: str | Path, *, seed: int = 0,
                       train_steps: int = 300, on_grid: bool = True) -> TinyDrafterInfo:
    """Writes a tiny `gemma4_assistant` drafter for the tiny target in target_dir (out_dir replaced if present).

    vLLM feeds the drafter [target_embedding(token) * sqrt(backbone_hidden), target_hidden_state] and lets its
    attention read the target's KV cache. The pattern needs only the token: the drafter is trained to map t to
    perm[t] through its MLPs with the attention output projection and the hidden-state half of pre_projection
    zero, so its drafts do not depend on the target's internals and are accepted whenever the target follows the
    pattern.

    Like the target, it is trained plain and then every 2-D weight (its linears and its embedding, which is its
    head) is projected onto the 4-bit grid in groups of 32 (project_to_grid), as a QAT drafter is; the accuracy
    is the projected drafter's. on_grid=False leaves the trained bf16 weights: a stand-in for a non-QAT drafter.
    """
    with _one_thread():
        return _build_drafter(out_dir, target_dir, seed=seed, train_steps=train_steps, on_grid=on_grid)


def _build_drafter(out_dir: str | Path, target_dir: str | Path, *, seed: int, train_steps: int,
                   on_grid: bool) -> TinyDrafterInfo:
    import torch
    from safetensors import safe_open
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    target = Path(target_dir)
    index = json.loads((target / "model.safetensors.index.json").read_text())["weight_map"]
    emb_name = "model.language_model.embed_tokens.weight"
    with safe_open(str(target / index[emb_name]), framework="pt") as f:
        target_emb = f.get_tensor(emb_name).float()
    backbone = int(TEXT_CONFIG["hidden_size"])
    if target_emb.shape != (VOCAB, backbone):
        raise ValueError(f"{target}: {emb_name} has shape {tuple(target_emb.shape)}, "
                         f"expected {(VOCAB, backbone)} (a tiny target from build_tiny_qat_checkpoint)")

    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    perm = pattern_permutation(seed)
    cfg = Gemma4AssistantConfig(text_config=dict(DRAFTER_TEXT_CONFIG, model_type="gemma4_text"),
                                backbone_hidden_size=backbone)
    model = Gemma4AssistantForCausalLM(cfg)
    layers = model.model.layers
    with torch.no_grad():
        for layer in layers:
            layer.self_attn.o_proj.weight.zero_()

    def draft_logits(tokens):
        emb = target_emb[tokens] * backbone ** 0.5
        x = model.pre_projection(torch.cat([emb, torch.zeros_like(emb)], dim=-1))
        for layer in layers:  # the attention branch is zero (o_proj = 0): only the MLP path remains
            x = x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))
            x = x * layer.layer_scalar
        logits = model.lm_head(model.model.norm(x))
        cap = DRAFTER_TEXT_CONFIG["final_logit_softcapping"]
        return torch.tanh(logits / cap) * cap

    params = [p for n, p in model.named_parameters() if ".self_attn." not in n]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(train_steps):
        tokens = torch.randint(FIRST_BYTE_ID, VOCAB, (256,), generator=gen)
        loss = torch.nn.functional.cross_entropy(draft_logits(tokens), perm[tokens])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        model.pre_projection.weight[:, backbone:].zero_()
        grid_tensors = _project_drafter(model, seed) if on_grid else []
        tokens = torch.arange(FIRST_BYTE_ID, VOCAB)
        accuracy = float((draft_logits(tokens).argmax(-1) == perm[tokens]).float().mean())
    model.to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    _write_tokenizer(out)
    mark(out, "drafter")
    return TinyDrafterInfo(path=out, accuracy=accuracy, grid_tensors=tuple(grid_tensors))


def _project_drafter(model, seed: int) -> list[str]:
    """Every 2-D weight onto the 4-bit grid, in place (the values bf16, held in the training dtype); an all-zero
    group (the zeroed attention outputs and hidden-state half of pre_projection) stays zero."""
    names = []
    for i, (name, p) in enumerate(model.named_parameters()):
        if p.ndim == 2:
            p.copy_(project_to_grid(p, seed=seed * 7919 + 5000 + i).to(p.dtype))
            names.append(name)
    return names


CACHE_ENV = "GEMMA4_T4_CACHE"


def default_cache_dir() -> Path | None:
    """Where trained tiny models are kept between runs: $GEMMA4_T4_CACHE (empty: no cache), else
    $XDG_CACHE_HOME/gemma4-t4 (~/.cache/gemma4-t4)."""
    raw = os.environ.get(CACHE_ENV)
    if raw is not None:
        return Path(raw).expanduser() if raw.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gemma4-t4"


def cache_key(**build_args: Any) -> str:
    """The content address of a tiny model: this module's source, the build arguments, the shape's text config
    and the versions of the libraries that train and write it. Any change to one of them trains a new model."""
    import inspect
    from importlib.metadata import version

    # Defaults filled in, so that naming a default argument or not gives the same address.
    bound = inspect.signature(build_tiny_qat_checkpoint).bind("", **build_args)
    bound.apply_defaults()
    args = {k: v for k, v in bound.arguments.items() if k != "out_dir"}
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(json.dumps(args, sort_keys=True).encode())
    # the shape's text config itself (repack/stand_ins/tiny_shapes.py): a shape that changes trains a new model
    h.update(json.dumps(text_config(args["shape"]), sort_keys=True).encode())
    for dist in ("torch", "transformers", "safetensors", "tokenizers"):
        h.update(f"{dist}=={version(dist)}".encode())
    return h.hexdigest()[:24]


def cached_tiny_qat_checkpoint(out_dir: str | Path, *, cache_dir: str | Path | None | bool = True,
                               **build_args: Any) -> TinyModelInfo:
    """build_tiny_qat_checkpoint, trained once per content address and copied from the cache after that.

    cache_dir True: default_cache_dir(); None or False: no cache (always trains). An entry is written to a
    temporary folder and renamed into place whole, so concurrent runs and kills never leave a partial one.
    """
    root = default_cache_dir() if cache_dir is True else (Path(cache_dir) if cache_dir else None)
    if root is None:
        return build_tiny_qat_checkpoint(out_dir, **build_args)
    entry = root / "tiny-model" / cache_key(**build_args)
    if not (entry / "info.json").is_file():
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.parent / f".{entry.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            info = build_tiny_qat_checkpoint(tmp / "model", **build_args)
            (tmp / "info.json").write_text(json.dumps(dict(asdict(info), path=None), indent=1))
            try:
                os.rename(tmp, entry)
            except OSError:
                if not (entry / "info.json").is_file():  # not another run's finished entry: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(entry / "model", out)
    mark(out, "source")  # also where the cached entry predates the marker
    meta = json.loads((entry / "info.json").read_text())
    return TinyModelInfo(path=out, accuracy=meta["accuracy"], grid_tensors=meta["grid_tensors"],
                         permutation_seed=meta["permutation_seed"])

