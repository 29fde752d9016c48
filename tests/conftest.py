"""Fixtures shared by the whole suite. Everything is built here; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_qat(tmp_path_factory) -> Path:
    """The tiny multimodal QAT-like checkpoint (sharded, towers, tied head), built once per session."""
    from tools.tiny_model import build_tiny_qat_checkpoint

    info = build_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny") / "gemma-4-tiny-qat")
    assert info.accuracy > 0.95, f"tiny model did not learn its pattern (accuracy {info.accuracy:.3f})"
    return info.path


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """The same tiny model left off the grid: a stand-in for a base (non-QAT) bf16 checkpoint."""
    from tools.tiny_model import build_tiny_qat_checkpoint

    return build_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny-base") / "gemma-4-tiny-base", on_grid=False).path
