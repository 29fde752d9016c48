"""The serving commands' bad-input error (parameter models derive their flags from tools.params.OpParams)."""

from __future__ import annotations

from tools.errors import ToolFailure


class BadInput(ToolFailure):
    """Input the caller must change (an option, an id, a path): the command line exits with status 2."""
