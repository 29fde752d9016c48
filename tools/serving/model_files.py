"""What a local checkpoint folder says about serving it: its context limit, its embedding method, its size."""

from __future__ import annotations

import json
from pathlib import Path

from repack.checks import SOURCE_REPO
from tools.core.errors import op

TINY_SOURCE = "tiny-gemma4-qat"  # the stand-in source's folder name the remedies suggest


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


def make_source(source: str, platform: str) -> str:
    """The operation (op() marks) that makes a missing source folder: on CPU the tiny stand-in, on a GPU the
    fetched QAT checkpoint."""
    return op("tiny_model", out=source) if platform == "cpu" else op("fetch", repo_id=SOURCE_REPO, out=source)


def missing_model_fix(model: str, platform: str) -> str:
    """How to make a missing model folder, with op() marks: a source, then the repack into it (or the demo, which
    does both for both builds)."""
    source = TINY_SOURCE if platform == "cpu" else "SOURCE"
    return (f"make a source with {make_source(source, platform)}, build it with "
            f"{op('repack', source=source, output=model)} (or run {op('demo')}), or point MODEL_NAME at a build "
            "or a Hugging Face id")


__all__ = ["TINY_SOURCE", "checkpoint_bytes", "embedding_method", "make_source", "missing_model_fix",
           "model_position_limit"]
