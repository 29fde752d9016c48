"""The progress callback a long operation reports to: `progress(done, total, message)` after each unit of work
(a repeat, a prompt, a file, a phase of a server's start); `total` is None where it is not known, and 1.0 where
`done` is a share (a server's start). The command line prints it, MCP streams it as progress notifications."""

from __future__ import annotations

from typing import Callable

Progress = Callable[[float, float | None, str], None]


def percent(progress: Progress) -> Progress:
    """`progress` fed the same reports in percent of their total, to a tenth (a start's 0.4 of 1 as 40.0 of 100):
    how an MCP client shows a share."""
    return lambda done, total, message: progress(round(done / (total or 1.0) * 100, 1), 100, message)


__all__ = ["Progress", "percent"]
