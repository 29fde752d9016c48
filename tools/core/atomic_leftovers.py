"""The temporary folders of atomic output (tools.core.atomic), their owners, and the sweep of dead owners' ones.

A build of OUT writes `.OUT.partial-PID-START-RAND` beside it (PID and START, the owner's process start time in
ms, name the owner in messages; the same token names its `.OUT.old-...` folder and its `.OUT.lock-...` file). The
owner holds an advisory lock (flock) on the lock file from before its folders exist until after they are gone; the
kernel drops it however the owner ends, and in any PID namespace, so a lock that can be taken marks a dead
owner's leftovers. Nothing else is swept: not a folder named like a leftover without its lock file, a link, a
mount point, nor a kept path (nor anything holding one or inside one).

The owner's identity (`own_id`: pid and start time in ms, `start_ms(pid)`) lives here with the names it is
written into.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tools.core.atomic_renames import rename_noreplace
from tools.core.paths import inside

NAME_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old|lock)-(?P<pid>\d+)-(?P<start>\d+)-(?P<rand>[0-9a-f]{8})$")
# the longest temporary name is `.NAME.partial-PID-START-RAND`: PID up to 7 digits (Linux's pid_max is at most
# 2**22), START 13 (milliseconds since 1970 until the year 2286), RAND 8
TEMP_EXTRA = len(".") + len(".partial-") + 7 + 1 + 13 + 1 + 8


# -- process identity ----------------------------------------------------------------------------------------

def start_ms(pid: int) -> int | None:
    """The process's start time in ms, or None when no such process runs (a zombie counts as gone)."""
    import psutil

    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return int(round(p.create_time() * 1000))
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:
        return -1  # exists but cannot be inspected: treated as alive


_own: tuple[int, int] | None = None


def own_id() -> tuple[int, int]:
    """This process's (pid, start time in ms)."""
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:  # recomputed in a forked child
        _own = (pid, start_ms(pid) or int(time.time() * 1000))
    return _own


# -- leftovers -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Leftover:
    """A temporary folder of a build: `.NAME.partial-...` or `.NAME.old-...` beside NAME."""

    path: Path
    name: str     # the output folder's name
    kind: str     # "partial", "old" or "lock"
    pid: int
    start_ms: int
    token: str    # pid-start-rand: shared by the folders and the lock file of one build

    def describe(self) -> str:
        return f"{self.path} ({_size(_du(self.path))}, left by pid {self.pid}, which is no longer running)"


def _parse(p: Path) -> Leftover | None:
    m = NAME_RE.match(p.name)
    if m is None:
        return None
    token = f"{m['pid']}-{m['start']}-{m['rand']}"
    return Leftover(p, m["name"], m["kind"], int(m["pid"]), int(m["start"]), token)


class Lock:
    """A build's hold on its lock file (see the module's docstring)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def create(cls, path: Path) -> "Lock | None":
        """Creates and locks `path`; None when the name is taken (or was swept before the lock was held)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # waits only while a sweep that saw the new file checks it
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    raise
                # no locks on this file system: sweeps cannot take it either, so they keep these folders
            if not _same_file(fd, path):  # a sweep took the lock first and removed the file
                os.close(fd)
                return None
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Removes the lock file, then drops the lock (a sweep waiting on it then finds the file gone)."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _take_dead_lock(path: Path, exclusive: bool) -> int | None:
    """A descriptor holding the lock of a dead build's lock file; None while its owner lives (or when it cannot be
    told: a link, another user's file, no lock support), so the folders are kept."""
    try:
        fd = os.open(path, (os.O_RDWR if exclusive else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
                     | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        if stat.S_ISREG(os.fstat(fd).st_mode) and _same_file(fd, path):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _related(p: Path, keep: list[Path]) -> bool:
    return any(inside(k, p) or inside(p, k) for k in keep)


def _leftover_groups(folder: Path, keep: Iterable[str | Path]) -> list[tuple[str, str, list[Leftover]]]:
    """Each build's leftovers in `folder` that have a lock file: (output name, token, its folders). A build with
    any folder that is not one a build makes (a link, a mount point) or that is, holds or lies inside a kept path
    is left out whole: settling it partly could rename or delete what is not ours."""
    try:
        folder = Path(os.path.realpath(folder))
        dev = os.stat(folder).st_dev
        entries = list(os.scandir(folder))
    except OSError:
        return []
    kept = [Path(os.path.realpath(k)) for k in keep]
    groups: dict[tuple[str, str], list[Leftover]] = {}
    bad: set[tuple[str, str]] = set()
    for e in entries:
        lo = _parse(Path(e.path))
        if lo is None:
            continue
        key = (lo.name, lo.token)
        groups.setdefault(key, []).append(lo)
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            bad.add(key)
            continue
        # a partial is a folder, or a file (atomic_files' temporary copy of an output file)
        want = (stat.S_ISREG if lo.kind == "lock" else
                (lambda m: stat.S_ISDIR(m) or stat.S_ISREG(m)) if lo.kind == "partial" else stat.S_ISDIR)
        if not want(st.st_mode) or st.st_dev != dev or _related(lo.path, kept):
            bad.add(key)
    out = []
    for key, los in sorted(groups.items()):
        if key in bad or not any(lo.kind == "lock" for lo in los):
            continue  # without its lock file it is not a leftover of a build that can be judged
        out.append((key[0], key[1], sorted((lo for lo in los if lo.kind != "lock"), key=lambda x: x.path.name)))
    return out


def find_stale_partials(folder: str | Path, keep: Iterable[str | Path] = ()) -> list[Leftover]:
    """The build leftovers in `folder` whose owner is gone (its lock can be taken). Reads only. `keep`: paths never
    reported (the source a command reads)."""
    found = []
    for name, token, los in _leftover_groups(Path(folder), keep):
        fd = _take_dead_lock(Path(folder) / f".{name}.lock-{token}", exclusive=False)
        if fd is not None:
            os.close(fd)
            found += los
    return sorted(found, key=lambda x: x.path.name)


def settle(parent: Path, name: str, token: str) -> list[Path]:
    """Brings one build's swap to rest: an old build moved aside comes back if OUT is missing (roll back) and is
    deleted if OUT is there; the temporary folder is deleted. Returns what was deleted."""
    removed = []
    out, tmp, old = parent / name, parent / f".{name}.partial-{token}", parent / f".{name}.old-{token}"
    if os.path.lexists(old):
        if not os.path.lexists(out):
            try:
                rename_noreplace(old, out)
            except OSError:
                pass  # the old build stays under its temporary name: it is the only copy
        else:
            rmtree(old)
            removed.append(old)
    if os.path.lexists(tmp):
        rmtree(tmp)
        removed.append(tmp)
    return removed


def sweep_stale_partials(folder: str | Path, keep: Iterable[str | Path] = ()) -> list[str]:
    """Removes (or rolls back) the build leftovers in `folder` whose owner is gone; returns one line for each.
    `keep`: paths that are never touched, nor anything holding them or inside them (the source, the roots)."""
    folder = Path(os.path.realpath(folder))
    lines = []
    for name, token, los in _leftover_groups(folder, keep):
        lock = folder / f".{name}.lock-{token}"
        fd = _take_dead_lock(lock, exclusive=True)
        if fd is None:
            continue
        try:  # held while settling: another build's sweep skips this one meanwhile
            desc = {lo.path: lo.describe() for lo in los}
            old = folder / f".{name}.old-{token}"
            removed = settle(folder, name, token)
            lines += [f"removed {desc.get(p, p)}" for p in removed]
            if old in desc and old not in removed and not os.path.lexists(old):
                lines.append(f"restored {folder / name} from {old}: its replacement was interrupted when pid "
                             f"{token.split('-')[0]} stopped")
            if not os.path.lexists(old):  # an old build that could not be restored keeps its lock file
                os.unlink(lock)
        except OSError:
            pass
        finally:
            os.close(fd)
    return lines


def rmtree(p: Path) -> None:
    """Removes a folder (only the link, for a symbolic link; the file, for a file), ignoring what cannot be
    removed."""
    if p.is_symlink() or (os.path.lexists(p) and not p.is_dir()):
        try:
            p.unlink(missing_ok=True)
        except OSError:
            pass
    else:
        shutil.rmtree(p, ignore_errors=True)


def _du(p: Path) -> int:
    if not p.is_dir():
        try:
            return os.lstat(p).st_blocks * 512
        except OSError:
            return 0
    total = 0
    for dirpath, _, files in os.walk(p):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


__all__ = ["NAME_RE", "TEMP_EXTRA", "Leftover", "Lock", "find_stale_partials", "own_id", "rmtree", "settle",
           "start_ms", "sweep_stale_partials"]
