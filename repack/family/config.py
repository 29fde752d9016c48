"""config.json for the builds: text-only promotion, untied head, compressed-tensors quantization_config.

The targets are chosen for vLLM's compressed-tensors matching (vLLM 0.32): a target is a module name, a
``re:`` regex over the module name, or a case-insensitive substring of the module CLASS name. "Linear" picks
up vLLM's linear classes (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ReplicatedLinear
...), embeddings are named by anchored regexes (so the PLE table can be int4 while embed_tokens stays bf16),
and ParallelLMHead (whose class name contains neither) by ``re:.*lm_head$``. The towers use vLLM linear
classes too, so a multimodal build ignores them explicitly. A mixture of experts' weights are named per expert
(``re:`` over ``experts.{e}.gate_proj/up_proj/down_proj``, the names vLLM's compressed-tensors MoE method looks
its scheme up by, before it falls back to "Linear"); its router stays bf16 and is ignored by name, since
"Linear" would otherwise claim it for a loader that quantizes every nn.Linear.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from ..errors import RepackError, clip

GROUP = 32
# The names of a multimodal checkpoint's towers and of the per-layer embeddings (PLE): every table of them below
# (the config's ignore list and targets, the checkpoint's tower prefixes, the roofline's patterns) is made from these.
TOWERS = ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
PLE = "embed_tokens_per_layer"
TOWER_PREFIXES = tuple(f"model.{t}." for t in TOWERS)
TOWER_IGNORE = [f"re:.*{t}.*" for t in TOWERS]
RE_PLE = f"re:.*{PLE}$"
RE_EMBED = "re:.*embed_tokens$"
RE_HEAD = "re:.*lm_head$"
RE_EXPERTS = r"re:.*experts\.\d+\.(gate|up|down)_proj$"
RE_ROUTER = r"re:.*router\.proj$"



def text_of(config: dict[str, Any], whole: bool = True) -> dict[str, Any]:
    """A config.json's text model: its text_config where that is an object, else the config itself (a text-only
    build's); `whole=False`: an empty dict instead (a drafter's text fields are read from its text_config only)."""
    tc = config.get("text_config")
    return tc if isinstance(tc, dict) else config if whole else {}

def _weights_args() -> dict[str, Any]:
    return {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
            "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {},
            "block_structure": None}


TABLE_TARGETS = {"linears": "Linear", "experts": RE_EXPERTS, "PLE": RE_PLE, "embed_tokens": RE_EMBED,
                 "lm_head": RE_HEAD}


def targets(tables: list[str] | set[str]) -> list[str]:
    """The compressed-tensors targets naming the given report tables, in a fixed order."""
    return [t for k, t in TABLE_TARGETS.items() if k in tables]


def w4a16_group(tables: list[str] | set[str]) -> dict[str, Any]:
    """The `pack-quantized` int4 group-32 config group for the given tables."""
    return {"format": "pack-quantized", "targets": targets(tables), "weights": _weights_args(),
            "input_activations": None, "output_activations": None}


def _ordered(ts: list[str]) -> list[str]:
    known = list(TABLE_TARGETS.values())
    return [t for t in known if t in ts] + [t for i, t in enumerate(ts) if t not in known and t not in ts[:i]]


def quantization_config(groups: list[dict[str, Any]], *, previous: dict[str, Any] | None = None,
                        carried_packed: set[str] = frozenset(), carried_bf16: set[str] = frozenset(),
                        head: bool, towers: bool, router: bool = False,
                        version: str = "0.17.0") -> dict[str, Any] | None:
    """The compressed-tensors quantization_config for what a build holds (None if nothing is quantized).

    groups: the config groups of the schemes that quantized tables in this run. previous: the source's config,
    whose groups are kept for the targets this run carries unchanged (an intermediate build's int4 linears);
    carried_packed: tables carried as `weight_packed` that no previous group declares (declared int4);
    carried_bf16: tables whose weights are carried bf16, none quantized, which no previous group may declare.
    router: the build holds a mixture of experts' router (kept bf16, so ignored).
    Groups that quantize alike are merged, so a build made in steps declares what the one-pass build does."""
    fresh = {t for g in groups for t in g["targets"]}
    # a source config declaring bf16 weights quantized is stale: kept, it would make the output unloadable
    stale = set(targets(set(carried_bf16) - set(carried_packed)))
    kept: list[dict[str, Any]] = []
    prev = (previous or {}).get("quantization_config") or \
        text_of(previous or {}, whole=False).get("quantization_config") or {}
    for g in (prev.get("config_groups") or {}).values():
        keep = [t for t in g.get("targets", []) if t not in fresh and t not in stale]
        if keep:
            kept.append({"format": prev.get("format"), **copy.deepcopy(g), "targets": keep})
    declared = fresh | {t for g in kept for t in g["targets"]}
    missing = [t for t in targets(carried_packed) if t not in declared]
    merged: list[dict[str, Any]] = []
    for g in [copy.deepcopy(g) for g in groups] + kept + ([{**w4a16_group([]), "targets": missing}] if missing else []):
        same = next((m for m in merged if {**m, "targets": None} == {**g, "targets": None}), None)
        if same is None:
            merged.append(g)
        else:
            same["targets"] = _ordered(same["targets"] + g["targets"])
    if not merged:
        return None
    known = list(TABLE_TARGETS.values())  # groups in a fixed order too: one pass and steps write the same
    merged.sort(key=lambda g: known.index(g["targets"][0]) if g["targets"][0] in known else len(known))
    formats = {g["format"] for g in merged}
    ignore: list[str] = [] if head else ["lm_head"]
    if router:
        ignore.append(RE_ROUTER)
    if towers:
        ignore += TOWER_IGNORE
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": g for i, g in enumerate(merged)},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
        "version": version,
    }


# The text model's keys the project compares and counts with (members, plan, build, probe, the serving checks):
# whole numbers or null, and flags that are booleans or null; checked here, once, before any of them is used.
TEXT_WHOLE_NUMBERS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "num_global_key_value_heads", "head_dim", "global_head_dim",
                      "hidden_size_per_layer_input", "num_kv_shared_layers", "num_experts", "top_k_experts",
                      "moe_intermediate_size", "sliding_window", "max_position_embeddings")
TEXT_FLAGS = ("enable_moe_block", "tie_word_embeddings", "use_double_wide_mlp", "attention_k_eq_v")
TOP_WHOLE_NUMBERS = ("backbone_hidden_size",)  # a drafter's


def validate(config: dict[str, Any], where: str) -> None:
    """Refuses a config.json whose parts the build reads have the wrong type (one line naming the key), rather
    than failing later with a traceback or silently building the wrong thing."""
    def fail(key: str, what: str) -> RepackError:
        return RepackError(f"{where}: {key} is {what}; use the config.json that came with the checkpoint",
                           {"file": where, "key": key, "problem": "bad-config"})

    def kind(v: Any) -> str:
        names = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number",
                 dict: "an object"}
        return "null" if v is None else names.get(type(v), f"a {type(v).__name__}")

    # Python reads NaN, Infinity and 1e999; the config written back from them would not be JSON
    stack: list[tuple[str, Any]] = [("", config)]
    while stack:  # iterative: loads_json bounds the depth, not the breadth
        key, v = stack.pop()
        if isinstance(v, float) and not math.isfinite(v):
            raise fail(clip(key, 120), f"{v}, not a finite number")
        if isinstance(v, dict):
            stack += [(f"{key}.{k}" if key else str(k), x) for k, x in v.items()]
        elif isinstance(v, list):
            stack += [(f"{key}[{i}]", x) for i, x in enumerate(v)]

    if "text_config" in config and not isinstance(config["text_config"], dict):
        raise fail("text_config", f"{kind(config['text_config'])}, not an object (a multimodal checkpoint's "
                                  f"text model is described there)")
    text = text_of(config)
    scope = "" if text is config else "text_config."
    shapes = [(scope + k, text.get(k)) for k in TEXT_WHOLE_NUMBERS] + [(k, config.get(k)) for k in TOP_WHOLE_NUMBERS]
    for key, v in shapes:
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise fail(key, f"{clip(repr(v), 40)} ({kind(v)}), not a whole number")
    for key in TEXT_FLAGS:
        v = text.get(key)
        if v is not None and not isinstance(v, bool):
            raise fail(scope + key, f"{clip(repr(v), 40)} ({kind(v)}), not a boolean (true or false)")
    for scope, cfg in (("", config), ("text_config.", text_of(config, whole=False))):
        qc = cfg.get("quantization_config")
        if qc is None:
            continue
        key = scope + "quantization_config"
        if not isinstance(qc, dict):
            raise fail(key, f"{kind(qc)}, not an object")
        # a kept group's format becomes the output's format (compared and written as a string)
        if not isinstance(qc.get("format", ""), (str, type(None))):
            raise fail(key + ".format", f"{kind(qc['format'])}, not a string")
        groups = qc.get("config_groups")
        if groups is None:
            continue
        if not isinstance(groups, dict):
            raise fail(key + ".config_groups", f"{kind(groups)}, not an object")
        for name, group in groups.items():
            if not isinstance(group, dict):
                raise fail(clip(f"{key}.config_groups.{name}", 120), f"{kind(group)}, not an object")
            targets = group.get("targets", [])
            if not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
                raise fail(clip(f"{key}.config_groups.{name}.targets", 120), "not a list of strings")
            if not isinstance(group.get("format", ""), (str, type(None))):
                raise fail(clip(f"{key}.config_groups.{name}.format", 120), f"{kind(group['format'])}, not a string")


def existing_targets(config: dict[str, Any]) -> set[str]:
    """The int4 kinds an input build already declares (so a later step keeps declaring them)."""
    qc = config.get("quantization_config") or text_of(config, whole=False).get("quantization_config")
    kinds: set[str] = set()
    if not qc:
        return kinds
    for group in (qc.get("config_groups") or {}).values():
        for t in group.get("targets", []):
            kinds.add({"Linear": "linears", RE_EXPERTS: "experts", RE_PLE: "ple", RE_EMBED: "embed",
                       RE_HEAD: "head"}.get(t, t))
    return kinds


def text_only(config: dict[str, Any]) -> dict[str, Any]:
    """The multimodal config's text_config promoted to the top level as a Gemma4ForCausalLM."""
    if "text_config" not in config:
        out = copy.deepcopy(config)  # already text-only
    else:
        out = copy.deepcopy(config["text_config"])
        for key in ("dtype", "torch_dtype", "transformers_version", "tie_word_embeddings"):
            if key in config and key not in out:
                out[key] = config[key]
    out["architectures"] = ["Gemma4ForCausalLM"]
    out.setdefault("model_type", "gemma4_text")
    return out


def set_untied(config: dict[str, Any]) -> None:
    """tie_word_embeddings false wherever a loader reads it (top level and any text_config)."""
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["tie_word_embeddings"] = False


def set_quantization(config: dict[str, Any], qc: dict[str, Any] | None) -> None:
    config.pop("quantization_config", None)
    if isinstance(config.get("text_config"), dict):
        config["text_config"].pop("quantization_config", None)
    if qc is not None:
        config["quantization_config"] = qc
