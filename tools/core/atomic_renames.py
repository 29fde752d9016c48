"""The two renames atomic output needs beyond rename(2): Linux renameat2's RENAME_NOREPLACE (fail if the target
exists, where a plain rename would replace an empty folder) and RENAME_EXCHANGE (swap two names in one step)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from pathlib import Path

RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "i686": 353, "i386": 353, "armv7l": 382, "ppc64le": 357,
                  "s390x": 347, "riscv64": 276}
# what a file system (or a libc without the call) answers when it cannot do the rename asked for
UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)

_libc = None


def renameat2(src: Path, dst: Path, flags: int) -> None:
    """Linux renameat2(2); OSError(ENOSYS) where neither libc nor a known syscall number provides it."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    a, b = os.fsencode(src), os.fsencode(dst)
    fn = getattr(_libc, "renameat2", None)
    if fn is not None:
        rc = fn(_AT_FDCWD, a, _AT_FDCWD, b, ctypes.c_uint(flags))
    elif platform.machine() in _SYS_RENAMEAT2:
        rc = _libc.syscall(ctypes.c_long(_SYS_RENAMEAT2[platform.machine()]), _AT_FDCWD, a, _AT_FDCWD, b,
                           ctypes.c_uint(flags))
    else:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), str(src))
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(src), None, str(dst))


def rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails with EEXIST if dst exists (plain rename would replace an empty folder)."""
    try:
        renameat2(src, dst, RENAME_NOREPLACE)
        return
    except OSError as e:
        if e.errno not in UNSUPPORTED:
            raise
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


__all__ = ["RENAME_EXCHANGE", "RENAME_NOREPLACE", "UNSUPPORTED", "rename_noreplace", "renameat2"]
