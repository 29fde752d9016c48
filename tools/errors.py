"""The one failure type the tools raise: a one-line, actionable message, plus optional detail for machines."""

from __future__ import annotations

from typing import Any


class ToolFailure(Exception):
    """A failure the caller can act on.

    `str(exc)` is one line naming the file, process or option involved and what to do; `detail` carries
    whatever helps a program or a person dig further (a log tail, the process holding a port, a state file).
    """

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        # One line: the CLI prints it as the whole reason, MCP clients show it as the error text.
        self.message = " ".join(str(message).split())
        self.detail = detail
        super().__init__(self.message)

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.message, "detail": self.detail}
