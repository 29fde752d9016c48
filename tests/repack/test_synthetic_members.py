"""The synthetic source at a member's real shapes (repack.stand_ins.synthetic.write_member_checkpoint), as the
real-shape bench writes it: E2B's files exactly as before the writer took the member, and another member's source with
that member's configuration and the tables the fit planner counts. Sparse files (fill "none"): headers only, no
multi-GiB writes."""

from __future__ import annotations

import hashlib
import json
import math
import struct

import pytest

from repack.source.checkpoint import open_checkpoint
from repack.build.fit import plan_member
from repack.family.members import GIB, MEMBERS, identify, text_tables
from repack.build.preview import build_tables
from repack.stand_ins.synthetic import (e2b_config, e2b_tensors, member_config, member_tensors, write_e2b_checkpoint,
                              write_member_checkpoint)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _header(path) -> bytes:
    """The length prefix and the JSON header: every tensor's name, dtype, shape and offsets."""
    with open(path, "rb") as f:
        raw = f.read(8)
        return raw + f.read(struct.unpack("<Q", raw)[0])


# Digests of what write_e2b_checkpoint wrote before the writer took the member (commit 4c28421): the tensor
# list, the config.json and the safetensors header, at full size and at 5%.
E2B_BEFORE = {1.0: ("8acfd2e763f902b4145efbd19629a6b1de813a48f7f661636ff33177152558f7",
                    "15e75cae37fd8d3496c699c4fc0bdbed54bb39ac63fe5fab88a19fd8f7704c22", 10_270_924_702),
              0.05: ("ab769be378da8a0a02cd421a9d2e85968409ed827cc42c99f17bffc34e3b65fa",
                     "7d9f10c8744a4d4b62cc1cffa912613114f704b6380cfba9e81ae092ae2d10d5", 312_192_532)}
E2B_HEADER_005 = "24f38bd6401f3e09b1fb8b483ab6009c8224526d19e05e5ff4f58b6b9468e0eb"


@pytest.mark.parametrize("scale", [1.0, 0.05])
def test_e2b_source_is_unchanged(scale):
    specs_sha, config_sha, _ = E2B_BEFORE[scale]
    specs = e2b_tensors(scale)
    assert specs == member_tensors("E2B", scale)
    assert _sha(json.dumps(specs).encode()) == specs_sha
    assert _sha(json.dumps(e2b_config(sorted(specs)), indent=2).encode()) == config_sha


def test_e2b_files_are_unchanged(tmp_path):
    size = write_e2b_checkpoint(tmp_path, 0.05, fill="none")
    assert size == E2B_BEFORE[0.05][2] == (tmp_path / "model.safetensors").stat().st_size
    assert _sha(_header(tmp_path / "model.safetensors")) == E2B_HEADER_005
    assert _sha((tmp_path / "config.json").read_bytes()) == E2B_BEFORE[0.05][1]


@pytest.mark.parametrize("name", ["E2B", "E4B", "12B", "31B"])
def test_a_member_source_has_the_member_config_and_the_planner_tables(name):
    m = MEMBERS[name]
    specs = member_tensors(name)
    cfg = member_config(name, sorted(specs))
    assert identify(cfg) is m
    tc = cfg["text_config"]
    want = m.text_config()
    for key in ("layer_types", "num_key_value_heads", "head_dim", "global_head_dim", "sliding_window",
                "num_kv_shared_layers", "use_double_wide_mlp", "attention_k_eq_v", "vocab_size"):
        assert tc[key] == want[key], key
    # the grid tensors are exactly the tables the planner counts
    params = {n: math.prod(s) for n, s, k in specs if k == "grid"}
    tables = text_tables(m)
    ple = sum(v for n, v in params.items() if "embed_tokens_per_layer" in n)
    emb = sum(v for n, v in params.items() if n.endswith(".embed_tokens.weight"))
    assert emb == tables["embed_tokens"].params
    assert ple == (tables["PLE"].params if "PLE" in tables else 0)
    assert sum(params.values()) - ple - emb == tables["linears"].params
    assert any("vision_tower" in n for n, _, _ in specs) == bool(m.vision_params)


def test_12b_source_has_no_v_on_full_layers_and_no_per_layer_embeddings():
    specs = {n: s for n, s, _ in member_tensors("12B", 0.25)}
    assert not any("per_layer" in n for n in specs)
    p = "model.language_model.layers."
    assert f"{p}0.self_attn.v_proj.weight" in specs            # a sliding layer: k and v
    assert f"{p}5.self_attn.k_proj.weight" in specs and f"{p}5.self_attn.v_proj.weight" not in specs  # full: k = v
    assert specs[f"{p}5.self_attn.k_proj.weight"] == (1 * 512, 3840)


def test_e4b_source_previews_to_the_planner_size(tmp_path):
    """The full-size E4B source, header only: its member is E4B and the build's own plan of the all-4-bit build
    is the planner's size (the bench then checks the written build)."""
    size = write_member_checkpoint("E4B", tmp_path, 1.0, fill="none")
    assert 14 * GIB < size < 15 * GIB
    ck = open_checkpoint(tmp_path)
    assert identify(ck.config) is MEMBERS["E4B"]
    tables = build_tables(ck)
    plan = plan_member(MEMBERS["E4B"]).build("all-4-bit")
    assert sum(tables.values()) / GIB == pytest.approx(plan.size_gib, rel=0.02)
    for t in ("linears", "PLE", "embed_tokens", "lm_head"):
        assert tables[t] / GIB == pytest.approx(plan.tables_gib[t], rel=0.01), t


def test_moe_member_is_refused():
    with pytest.raises(ValueError, match="26B-A4B.*dense members only"):
        member_tensors("26B-A4B")
