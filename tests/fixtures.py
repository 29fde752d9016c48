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


def fake_t4_hardware():
    """A Tesla T4 on a small host (compute capability 7.5, `ram` bytes of RAM, `swap` bytes of swap), as the
    serving code's Hardware sees it: the class is built on first use so importing this module stays light."""
    from tools.serving.vllm_server import Hardware

    class FakeT4(Hardware):
        def __init__(self, ram: int = 64 << 30, swap: int = 0) -> None:
            self.ram, self.swap = ram, swap

        def platform(self):
            return "cuda"

        def compute_capability(self):
            return (7, 5)

        def host_memory(self):
            return self.ram, self.swap

    return FakeT4
