"""Text that came from outside (a path, a tensor name, a log line) as it may appear in a message."""

from __future__ import annotations

ECHO_LIMIT = 200  # characters of any one input (a name, a path) repeated in a message


def clip(text: object, limit: int = ECHO_LIMIT) -> str:
    """`text` on one line (control characters, newlines included, escaped), at most about `limit` characters.

    Names come from headers or arguments a stranger may have written: a megabyte-long name or terminal escape
    codes must not reach a screen or a client's log. A long text loses its middle, since a message ends with what
    to do."""
    s = str(text)
    if not s.isprintable():
        s = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in s)
    if len(s) > limit:
        half = (limit - 5) // 2
        s = f"{s[:half]}[...]{s[-half:]}"
    return s


def size_text(n: float) -> str:
    """A size in bytes as a message gives it: GiB to two places from 1 GiB, MiB to one below, KiB below 1 MiB
    (a 3 MB checkpoint read "0.00 GiB")."""
    if n >= 1 << 30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 1 << 20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.0f} KiB"


__all__ = ["ECHO_LIMIT", "clip", "size_text"]
