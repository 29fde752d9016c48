"""The tiny model's shapes: E2B's (its default) and stand-ins shaped as other members of the family, as changes
to repack.stand_ins.tiny_model.TEXT_CONFIG."""

from __future__ import annotations

from typing import Any, Literal, get_args

# Stand-ins shaped as other members, by what sets them apart in the text model (repack/family/members.py): E4B's grouped
# KV heads (2), single-width MLP and wider hidden state; the 26B-A4B's mixture of experts beside a dense MLP,
# full-attention layers that ship k_proj only (k_eq_v), no per-layer embeddings and no KV-shared layers. Their sizes
# keep the members' order (E2B < E4B < 26B-A4B: 1.20, 1.45 and 1.60 M text parameters), so rehearsing a move to a
# bigger member on CPU moves to a bigger model: E4B's width (2,560 against E2B's 1,536) is 160 against 128 here.
SHAPES: dict[str, dict[str, Any]] = {
    "e2b": {},
    "e4b": dict(num_attention_heads=4, num_key_value_heads=2, use_double_wide_mlp=False, hidden_size=160),
    "moe": dict(num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True,
                enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, num_kv_shared_layers=0,
                use_double_wide_mlp=False),
}


# The shapes by name, for the parameter models (repack/params.py TinyModelParams): the choices of the command line's
# --shape and of the MCP tool's `shape`.
Shape = Literal["e2b", "e4b", "moe"]
SHAPE_NAMES: tuple[str, ...] = get_args(Shape)
# The member each stand-in is shaped as (repack/family/members.py's names).
MEMBER_OF: dict[str, str] = {"e2b": "E2B", "e4b": "E4B", "moe": "26B-A4B"}
if SHAPE_NAMES != tuple(SHAPES):
    raise ImportError(f"repack.stand_ins.tiny_shapes: Shape {SHAPE_NAMES} is not SHAPES {tuple(SHAPES)}")
