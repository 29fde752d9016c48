"""An output checked before any server is asked: a measurement that would fail to write its result only after
minutes of work, or after starting a server, is refused at once, in one line naming the path and the parameter.

Nothing is created here (the atomic writers create the output, and clean up after a failure); what the file
system will refuse is read from it: a file where a folder is wanted (or the reverse), a parent that is a file, a
read-only place (access(2) answers EROFS even to root), a disk with no room left. Each is bad input (exit 2):
the remedy named is another path, found before any work was done.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from tools.core.errors import BadInput, param

MIN_FREE_BYTES = 1 << 20  # below this a run cannot write even its summary


def _ancestor(p: Path) -> Path:
    """The nearest existing path at or above `p`."""
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _writable_place(p: Path, shown: Path, field: str) -> None:
    anc = _ancestor(p)
    if not anc.is_dir():
        raise BadInput(f"{param(field)} {shown}: {anc} is a file, not a folder; pass another {param(field)}",
                       detail={"path": str(shown), "errno": "ENOTDIR"}, field=field)
    if not os.access(anc, os.W_OK):
        why = "read-only" if _read_only(anc) else "not writable by this user"
        raise BadInput(f"{param(field)} {shown}: {anc} is {why}; pass another {param(field)}",
                       detail={"path": str(shown), "errno": "EROFS" if why == "read-only" else "EACCES"},
                       field=field)
    try:
        st = os.statvfs(anc)
    except OSError:
        return
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        raise BadInput(f"{param(field)} {shown}: no space left on the disk of {anc} "
                          f"({st.f_bavail * st.f_frsize // 1024} KiB free); free space or pass another {param(field)}",
                          detail={"path": str(shown), "errno": errno.errorcode[errno.ENOSPC]}, field=field)


def _read_only(p: Path) -> bool:
    try:
        return bool(os.statvfs(p).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_output_folder(out: str | Path, field: str = "out") -> Path:
    """`out`, a folder that receives run folders: refused when it is a file, under a file, read-only or full."""
    shown = Path(out).expanduser()
    p = Path(os.path.abspath(shown))
    if os.path.lexists(p) and not p.is_dir():
        raise BadInput(f"{param(field)} {shown} is a file: give a folder", detail={"path": str(shown)}, field=field)
    _writable_place(p, shown, field)
    return p


def check_output_file(path: str | Path, field: str = "out") -> Path:
    """`path`, a file a command writes: refused when it is a folder, under a file, read-only or full (whether an
    existing file may be replaced is the command's own rule)."""
    shown = Path(path).expanduser()
    p = Path(os.path.abspath(shown))
    if p.is_dir():
        raise BadInput(f"{param(field)} {shown} is a folder; {param(field)} takes a file path",
                       detail={"path": str(shown)}, field=field)
    _writable_place(p.parent, shown, field)
    return p


__all__ = ["MIN_FREE_BYTES", "check_output_file", "check_output_folder"]
