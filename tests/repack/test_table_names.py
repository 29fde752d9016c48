"""The towers' and the per-layer embeddings' names have one home (repack.config.TOWERS, PLE): the build's config
(ignore list, targets), the checkpoint's and the probe's tower test, the plan's tables and the roofline's count
all read them from there, so each tower is one thing everywhere."""

from __future__ import annotations

import json
import re

from repack.family.config import PLE, RE_PLE, TOWER_IGNORE, TOWER_PREFIXES, TOWERS
from repack.stand_ins.synthetic import e2b_config, e2b_tensors, write_safetensors
from tools.measure.roofline import decode_step_bytes


def _matches(target: str, module: str) -> bool:
    return re.fullmatch(target[len("re:"):], module) is not None


def test_each_tower_is_a_prefix_an_ignored_module_and_nothing_else():
    assert TOWERS == ("vision_tower", "audio_tower", "embed_vision", "embed_audio")
    for t in TOWERS:
        module = f"model.{t}.encoder.layers.0.mlp.up_proj"
        assert (module + ".weight").startswith(TOWER_PREFIXES)
        assert sum(_matches(target, module) for target in TOWER_IGNORE) == 1
        assert not _matches(RE_PLE, module)
    assert _matches(RE_PLE, f"model.language_model.{PLE}") and not _matches(RE_PLE, "model.embed_tokens")
    assert not "model.language_model.layers.0.mlp.up_proj.weight".startswith(TOWER_PREFIXES)


def test_the_roofline_leaves_every_tower_out_and_reads_one_ple_row(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(e2b_config(e2b_tensors(1.0))))
    towers = [(f"model.{t}.x.weight", "BF16", (8, 8), b"\0" * 128) for t in TOWERS]
    write_safetensors(d / "model.safetensors", [
        (f"model.language_model.{PLE}.weight", "BF16", (4, 8), b"\0" * 64),
        ("model.language_model.layers.0.mlp.up_proj.weight", "BF16", (2, 8), b"\0" * 32), *towers])
    step = decode_step_bytes(d, 0)
    assert (step.ple_rows, step.linears, step.other) == (16, 32, 0)
