"""What a local checkpoint folder says about serving it: its context limit, its embedding method, its size."""

from __future__ import annotations

import json
from pathlib import Path


def model_position_limit(model: str) -> int | None:
    """The longest context a local checkpoint's config allows (max_position_embeddings, top level or in
    text_config); None for a hub id or a config that does not say."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, RecursionError, OSError):
        return None
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    for source in ((text if isinstance(text, dict) else {}), cfg):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def embedding_method(model: str) -> str | None:
    """On CUDA vLLM does not log the embedding method: read it from a local checkpoint's quantization config."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        qc = json.loads(path.read_text()).get("quantization_config") or {}
    except ValueError:
        return None
    for group in (qc.get("config_groups") or {}).values():
        if any(t == "Embedding" or "embed" in str(t).lower() for t in group.get("targets", [])):
            return "CompressedTensorsEmbeddingWNA16Int"
    return "VocabParallelEmbedding (unquantized)"


def checkpoint_bytes(model: str) -> int | None:
    """Size of a local checkpoint's weight files; None for a hub id (not downloaded here)."""
    path = Path(model)
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) or None


__all__ = ["checkpoint_bytes", "embedding_method", "model_position_limit"]
