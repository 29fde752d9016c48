"""Helpers the test modules import (conftest.py holds the pytest fixtures built on them)."""

from __future__ import annotations

import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVE_MAX_MODEL_LEN = 512  # the tiny model has max_position_embeddings 1024


def free_port() -> int:
    """A TCP port nothing listens on right now (127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
