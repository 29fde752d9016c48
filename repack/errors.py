"""The one error type the repack library raises for bad input or a failed run.

Its message is a single line that names the file, tensor or option at fault and what to do about it; the
commands print it as ``error: <message>`` and exit with status 2.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

from tools.core.atomic import OutputRefused
from tools.core.errors import BadInput, op, param
from tools.core.paths import FileRefused
from tools.core.text import ECHO_LIMIT, clip

__all__ = ["ECHO_LIMIT", "OffGridError", "RepackError", "clip", "core_refusals", "unknown_scheme"]


class RepackError(BadInput):
    """Bad input or a failed write (exit status 2). ``str(err)`` is one line meant for the user; ``detail``
    (optional) says the same for programs: the file, the tensor and a short problem code."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None, *, field: str | None = None) -> None:
        super().__init__(message, detail, field=field)


class OffGridError(RepackError):
    """A group of 32 values that no symmetric 4-bit grid reproduces within the tolerance."""

    def __init__(self, tensor: str, row: int, group: int, worst_ulps: float, hint: str = "") -> None:
        self.tensor, self.row, self.group, self.worst_ulps = tensor, row, group, worst_ulps
        msg = (f"{clip(tensor)}: row {row}, group {group} (columns {group * 32}-{group * 32 + 31}) is off the 4-bit grid "
               f"(worst value {worst_ulps:.3g} bf16 ulps off, tolerance 2): this is not a QAT q4_0 export "
               f"(a base model?); run {op('probe')} on the source to check")
        if hint:
            msg += f"; {hint}"
        super().__init__(msg)


@contextmanager
def core_refusals() -> Iterator[None]:
    """The core's refusals (an output folder, a confined file) raised as the library's own error, the same line;
    an exception raised after the output was published keeps saying so (`written`)."""
    try:
        yield
    except (OutputRefused, FileRefused) as exc:
        err = RepackError(exc.message, exc.detail, field=exc.field)
        if hasattr(exc, "written"):
            err.written = exc.written  # type: ignore[attr-defined]
        raise err from None


def unknown_scheme(name: object, choices: list[str]) -> RepackError:
    """The refusal of a build scheme name that is not registered."""
    return RepackError(f"{param('scheme')} {clip(repr(name))}: unknown build scheme; choose one of "
                       f"{', '.join(choices)}",
                       {"option": "--scheme", "value": clip(name), "choices": choices, "problem": "unknown-scheme"},
                       field="scheme")
