"""A source checkpoint folder: config, shards (single file or indexed), tensor table, side files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import RepackError
from .safetensors_io import SafetensorsHeader, TensorInfo, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
MM_PREFIX = "model.language_model."


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    shards: list[SafetensorsHeader]  # in file-name order
    tensors: dict[str, TensorInfo]

    @property
    def multimodal(self) -> bool:
        return "text_config" in self.config

    def side_files(self) -> list[Path]:
        """Files carried along unchanged: tokenizer, chat template, generation config and the like."""
        skip = {INDEX, SINGLE, "config.json", "repack-report.json"}
        shard_names = {s.path.name for s in self.shards}
        return sorted(p for p in self.path.iterdir()
                      if p.is_file() and p.name not in skip and p.name not in shard_names
                      and not p.name.endswith(".safetensors") and not p.name.startswith("."))


def open_checkpoint(src: str | Path) -> Checkpoint:
    """Reads a checkpoint's config and every shard header; raises RepackError on anything unusable."""
    src = Path(src)
    if not src.exists():
        raise RepackError(f"{src}: no such folder; pass the folder of a downloaded checkpoint")
    if not src.is_dir():
        raise RepackError(f"{src}: not a folder; pass the checkpoint folder that holds config.json")
    cfg_path = src / "config.json"
    if not cfg_path.is_file():
        raise RepackError(f"{src}: no config.json; pass the folder of a Hugging Face checkpoint")
    try:
        config = json.loads(cfg_path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise RepackError(f"{cfg_path}: not valid JSON ({e}); re-download it") from None

    index_path = src / INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise RepackError(f"{index_path}: not a valid safetensors index ({e}); re-download it") from None
        for f in files:
            if not (src / f).is_file():
                raise RepackError(f"{index_path}: names shard {f}, which is missing; re-download the checkpoint")
    elif (src / SINGLE).is_file():
        weight_map, files = None, [SINGLE]
    else:
        raise RepackError(f"{src}: no {SINGLE} and no {INDEX}; pass a folder with safetensors weights")

    shards = [read_header(src / f) for f in files]
    tensors: dict[str, TensorInfo] = {}
    for sh in shards:
        for name, info in sh.tensors.items():
            if name in tensors:
                raise RepackError(f"{sh.path}: tensor {name} also appears in {tensors[name].file.name}")
            tensors[name] = info
    if weight_map is not None:
        for name, f in weight_map.items():
            if name not in tensors or tensors[name].file.name != f:
                raise RepackError(f"{index_path}: lists {name} in {f}, but that shard does not hold it; "
                                  f"re-download the checkpoint")
    return Checkpoint(src, config, shards, tensors)
