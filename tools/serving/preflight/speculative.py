"""A speculative-decoding config (vLLM's `--speculative-config` JSON) checked before any server starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt

from repack.family import members
from tools.core.errors import BadInput
from tools.core.json_files import read_json_model
from tools.core.paths import ENV, Roots


def parse_speculative_config(text: str) -> dict[str, Any]:
    try:
        val = json.loads(text)
    except ValueError as exc:
        raise BadInput(f"SPECULATIVE_CONFIG is not JSON ({exc}): write it as "
                          f"{{\"model\": \"PATH\", \"num_speculative_tokens\": 3}}",
                          detail={"field": "speculative_config", "value": text[:200]}) from None
    if not isinstance(val, dict):
        raise BadInput(f"SPECULATIVE_CONFIG must be a JSON object, got {text[:100]!r}",
                          detail={"field": "speculative_config", "value": text[:200]})
    return val


def validate_speculative_config(spec: str, target: str, *, models_roots: tuple[Path, ...] | None = None,
                                enforce_roots: bool = True) -> dict[str, Any]:
    """Refuse a speculative config that cannot work, before any server starts: not JSON, a drafter folder
    outside the models roots (unless enforce_roots is False: the operator's own tpu.env, like MODEL_NAME), a
    drafter made for another member of the family than the target's (both named), a drafter whose vocabulary or
    backbone_hidden_size does not match the target."""
    val = parse_speculative_config(spec)
    drafter = val.get("model")
    if not drafter or val.get("method") == "ngram":
        return val
    dp = Path(drafter).expanduser()
    local = dp.is_absolute() or drafter.startswith(".") or dp.exists()
    if not local:
        return val  # a hub id: vLLM fetches and checks it
    dp = dp.resolve()
    roots = models_roots if models_roots is not None else Roots.from_env().models
    if enforce_roots and not any(dp == r or r in dp.parents for r in roots):
        raise BadInput(f"drafter {dp} is outside the models roots ({', '.join(map(str, roots))}): move it "
                          f"under one or add its folder to {ENV['models']}",
                          detail={"field": "drafter", "path": str(dp)})
    dcfg = _read_config(dp, "drafter")
    tp = Path(target).expanduser()
    if not tp.is_dir():
        return val
    tcfg = _read_config(tp, "target")
    _check_members(dp, tp)
    ttext, dtext = tcfg.text(), dcfg.text()
    if dtext.vocab_size != ttext.vocab_size:
        raise BadInput(f"drafter {dp}: vocab_size {dtext.vocab_size} does not match the target's "
                          f"{ttext.vocab_size} ({tp}): use the drafter made for this target",
                          detail={"field": "vocab_size", "drafter": dtext.vocab_size,
                                  "target": ttext.vocab_size})
    backbone = dcfg.backbone_hidden_size
    if backbone is not None and backbone != ttext.hidden_size:
        raise BadInput(f"drafter {dp}: backbone_hidden_size {backbone} does not match the target's "
                          f"hidden_size {ttext.hidden_size} ({tp}): use the drafter made for this target",
                          detail={"field": "backbone_hidden_size", "drafter": backbone,
                                  "target": ttext.hidden_size})
    return val


def _check_members(drafter: Path, target: Path) -> None:
    """A drafter of one member beside a target of another, both named from their config.json (repack.family.members);
    nothing said where either is a stand-in or custom layout (the shape checks that follow hold them)."""
    try:
        dm = members.identify_drafter_or_none(json.loads((drafter / "config.json").read_text()))
        tm = members.identify_or_none(json.loads((target / "config.json").read_text()))
    except (OSError, ValueError):  # read and judged by _read_config already; nothing to name
        return
    if dm and tm and dm is not tm:
        fix = f"use {tm.name}'s drafter ({tm.drafter_repo})" if tm.drafter else "leave the drafter out"
        raise BadInput(f"drafter {drafter} is {dm.name}'s (backbone_hidden_size {dm.hidden_size}) but the target "
                       f"{target} is Gemma 4 {tm.name} (hidden_size {tm.hidden_size}): {fix}",
                       detail={"field": "drafter", "drafter_member": dm.name, "target_member": tm.name})


class _TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    vocab_size: StrictInt | None = None
    hidden_size: StrictInt | None = None


class _CheckpointConfig(_TextConfig):
    """The fields of a checkpoint's config.json the check compares (a multimodal one keeps them in text_config)."""

    backbone_hidden_size: StrictInt | None = None
    text_config: _TextConfig | None = None

    def text(self) -> _TextConfig:
        return self.text_config or self


def _read_config(folder: Path, what: str) -> _CheckpointConfig:
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"{what} {folder} is a file: give a checkpoint folder",
                       detail={"field": what, "path": str(folder)}, field=what if what == "drafter" else None)
    f = folder / "config.json"
    if not f.is_file():
        raise BadInput(f"{what} {folder} has no config.json: give a checkpoint folder",
                          detail={"field": what, "path": str(folder)})
    return read_json_model(f, _CheckpointConfig, remedy=f"give a checkpoint folder as the {what}")
