"""The progress callback a long operation reports to: `progress(done, total, message)` after each unit of work
(a repeat, a prompt, a file); the command line prints it, MCP streams it as progress notifications."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[int, int, str], None]

__all__ = ["Progress"]
