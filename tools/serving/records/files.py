"""The run folder's files as files: a record read whole but small, a lock file opened safely, who holds a lock.
A record or a lock is never a link, a FIFO or a folder: a link's target is not read or stamped (stamping it would
overwrite whatever file it names), a FIFO never hangs a reader."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path
from typing import Any

from tools.core import clock
from tools.core.errors import ToolFailure
from tools.core.jsonout import object_of

# A record is a few hundred bytes: a bigger file (or a link to /dev/zero) is no record, and is not read whole.
RECORD_MAX_BYTES = 1 << 20
def read_small(path: Path) -> str | None:
    """The text of the regular file at `path` (not followed if a link: a record or lock is never one), None when
    it is no regular file or is over RECORD_MAX_BYTES. Opened without blocking: a FIFO never hangs the reader."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > RECORD_MAX_BYTES:
            return None
        data = os.read(fd, RECORD_MAX_BYTES + 1)
    finally:
        os.close(fd)
    return None if len(data) > RECORD_MAX_BYTES else data.decode()


def present(path: Path) -> bool:
    """A record is there in any form: a link, a FIFO or a folder in its place counts (its reader then says it is
    damaged), so that listing and reading a record never disagree on whether it exists."""
    return os.path.lexists(path)


def open_lock(path: Path, mode: str = "a+") -> Any:
    """A lock file opened for flock: created if missing, a regular file of its own, never followed if a link
    (stamping a link's target would overwrite whatever file it names) and never waited on if a FIFO. Anything else
    at `path` is a ToolFailure naming it; nothing is written."""
    access = os.O_RDWR if "+" in mode else os.O_WRONLY
    return _open_own(path, access | (os.O_APPEND if "a" in mode else 0), mode, "lock")


def open_log(path: Path, mode: str = "wb") -> Any:
    """A log file opened for writing ("wb": emptied, "ab": appended to), as open_lock opens a lock: never through
    a link (writing through it would overwrite whatever file it names), never waiting on a FIFO."""
    return _open_own(path, os.O_WRONLY | (os.O_APPEND if "a" in mode else os.O_TRUNC), mode, "log")


def _open_own(path: Path, flags: int, mode: str, what: str) -> Any:
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise _not_regular(path, what) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _not_regular(path, what)
    os.set_blocking(fd, True)
    return os.fdopen(fd, mode)


def _not_regular(path: Path, what: str) -> ToolFailure:
    return ToolFailure(f"{what} file {path} is not a regular file (a link, FIFO or folder): nothing was written "
                       "to it; delete it, then run the command again", {"path": str(path)})


def flocked(path: Path) -> Any:
    """The lock file at `path`, open and exclusively flocked; None while another process holds it. A file its
    holder removed between our open and flock (on release) is not the lock any more: it is opened again."""
    while True:
        fh = open_lock(path)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.close()
            return None
        except BaseException:
            fh.close()
            raise
        try:
            if os.fstat(fh.fileno()).st_ino == os.stat(path).st_ino:
                return fh
        except FileNotFoundError:
            pass
        fh.close()


def stamp_holder(fh: Any, holder: dict[str, Any]) -> None:
    """Writes who holds a flocked lock file (`holder`, and since when) in place of what it said."""
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps({**holder, "since": clock.iso()}) + "\n")
    fh.flush()


def holder(path: Path) -> dict[str, Any] | None:
    """Who holds the flocked lock file at `path`, as it stamped itself (pid, what, since; {} when unreadable); None
    when no process holds it. Reads without taking it: a reader never makes a command it races refuse."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # none, or a link or something else no command of ours holds
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder opens too, and is no file to read a line from
        os.close(fd)
        return None
    with os.fdopen(fd) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return object_of(fh.readline())
        fcntl.flock(fh, fcntl.LOCK_UN)
    return None


def holder_text(path: Path) -> str:
    """The holder of a lock file in a few words: 'pid N: what, since T', else 'another command'."""
    try:
        h = object_of((read_small(path) or "").partition("\n")[0])
        return f"pid {int(h['pid'])}: {str(h['what'])[:120]}, since {str(h['since'])[:40]}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another command"



__all__ = ["RECORD_MAX_BYTES", "flocked", "holder", "holder_text", "open_lock", "open_log", "present", "read_small",
           "stamp_holder"]
