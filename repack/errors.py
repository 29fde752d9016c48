"""The one error type the repack library raises for bad input or a failed run.

Its message is a single line that names the file, tensor or option at fault and what to do about it; the
commands print it as ``error: <message>`` and exit with status 2.
"""

from __future__ import annotations

from typing import Any

ECHO_LIMIT = 200  # characters of any one input (a name, a path) repeated in a message


def clip(text: object, limit: int = ECHO_LIMIT) -> str:
    """An input as it may appear in a message: control characters escaped, at most about `limit` characters.

    Names come from headers a stranger may have written; a megabyte-long name or terminal escape codes must
    not end up on the user's screen or in a client's log."""
    s = str(text)
    if not s.isprintable():
        s = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)
    if len(s) > limit:
        half = (limit - 5) // 2
        s = f"{s[:half]}[...]{s[-half:]}"
    return s


class RepackError(Exception):
    """Bad input or a failed write. ``str(err)`` is one line meant for the user; ``detail`` (optional) says the
    same for programs: the file, the tensor and a short problem code."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.detail = detail


class OffGridError(RepackError):
    """A group of 32 values that no symmetric 4-bit grid reproduces within the tolerance."""

    def __init__(self, tensor: str, row: int, group: int, worst_ulps: float, hint: str = "") -> None:
        self.tensor, self.row, self.group, self.worst_ulps = tensor, row, group, worst_ulps
        msg = (f"{clip(tensor)}: row {row}, group {group} (columns {group * 32}-{group * 32 + 31}) is off the 4-bit grid "
               f"(worst value {worst_ulps:.3g} bf16 ulps off, tolerance 2): this is not a QAT q4_0 export "
               f"(a base model?); run `python3 -m repack probe` on the source to check")
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)
