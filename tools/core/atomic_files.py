"""Atomic output files and run folders, the file-and-folder counterpart of tools.core.atomic's build folders.

A file is written to `.NAME.partial-PID-START-RAND` beside it (its owner holding `.NAME.lock-...`, the names of
tools.core.atomic_leftovers), fsynced and renamed over NAME. A run folder (`TempFolder`) is filled under such a
name and renamed into place by `publish`. Either way, a dead owner's leftovers are swept by the next write in that
folder, and every failure of the file system (a full disk, a read-only mount, a parent that is a file, a folder
where a file is wanted, a mount point) is one line naming the path: OutputRefused, or ToolFailure for a full disk
or an I/O error, where another path is no remedy.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

from tools.core.atomic import OutputRefused, make_parents, remove_parents
from tools.core.atomic_leftovers import Lock, own_id, rmtree, sweep_stale_partials
from tools.core.atomic_renames import rename_noreplace
from tools.core.errors import ToolFailure

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG)
_WHY = {errno.EROFS: "a read-only file system", errno.ENOTDIR: "a parent of it is a file, not a folder",
        errno.EISDIR: "it is a folder", errno.EBUSY: "it is a mount point or in use",
        errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the disk",
        errno.EDQUOT: "the disk quota is used up", errno.EXDEV: "it is on another file system",
        errno.ENAMETOOLONG: "the name is too long"}


def refusal(path: str | Path, exc: OSError, doing: str = "write") -> ToolFailure:
    """One line naming `path` and what the file system said: ToolFailure for a full disk or an I/O error,
    OutputRefused (bad input: choose another path) for the rest."""
    why = _WHY.get(exc.errno or 0) or exc.strerror or str(exc)
    msg = f"{path}: cannot {doing} it ({why})"
    detail = {"path": str(path), "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))}
    if exc.errno in _NO_ROOM:
        return ToolFailure(msg, detail)
    return OutputRefused(msg, detail)


def _check_file_target(p: Path) -> None:
    """Refuses, before anything is written, a target that is a folder or a mount point, or whose nearest existing
    parent is not a folder."""
    if os.path.ismount(p):
        raise OutputRefused(f"{p}: cannot write it (it is a mount point)", {"path": str(p)})
    if p.is_dir():
        raise OutputRefused(f"{p}: cannot write it (it is a folder, not a file)", {"path": str(p)})
    anc = p.parent
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise OutputRefused(f"{p}: cannot write it ({anc} is a file, not a folder)", {"path": str(p)})


def _temp_names(parent: Path, name: str) -> tuple[Lock, Path]:
    """A held lock and the (not yet created) temporary name of one write of `parent/name`."""
    pid, start = own_id()
    for _ in range(100):
        token = f"{pid}-{start}-{secrets.token_hex(4)}"
        lock = Lock.create(parent / f".{name}.lock-{token}")  # first: a temporary never exists unlocked
        if lock is not None:
            return lock, parent / f".{name}.partial-{token}"
    raise OutputRefused(f"{parent}: cannot find a free temporary name for {name}", {"path": str(parent)})


def write_file(path: str | Path, data: str | bytes) -> Path:
    """Writes `path` whole or not at all: a temporary beside it, fsynced, renamed over it. Missing parent folders
    are created (and removed again when the write fails). OutputRefused / ToolFailure in one line on failure, with
    nothing of this write left behind."""
    p = Path(os.path.abspath(path))
    _check_file_target(p)
    raw = data.encode() if isinstance(data, str) else data
    created: list[Path] = []
    lock: Lock | None = None
    tmp: Path | None = None
    try:
        make_parents(p.parent, created)
        sweep_stale_partials(p.parent)
        lock, tmp = _temp_names(p.parent, p.name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
        tmp = None
        return p
    except OSError as exc:
        raise refusal(p, exc) from None
    finally:
        if tmp is not None:
            rmtree(tmp)
        if lock is not None:
            lock.release()
        if tmp is not None or not p.exists():
            remove_parents(created)


class TempFile:
    """A file written piece by piece (a reference streamed a window at a time) under a temporary name beside
    `path`; `publish` puts it in place, `discard` removes it. Every failure is one line naming `path`."""

    def __init__(self, path: Path, tmp: Path, lock: Lock, created: list[Path]) -> None:
        self.path, self.tmp, self._lock, self._created = path, tmp, lock, created
        self._f = os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), "w",
                            encoding="utf-8")

    @classmethod
    def open(cls, path: str | Path) -> "TempFile":
        p = Path(os.path.abspath(path))
        _check_file_target(p)
        created: list[Path] = []
        lock: Lock | None = None
        try:
            make_parents(p.parent, created)
            sweep_stale_partials(p.parent)
            lock, tmp = _temp_names(p.parent, p.name)
            return cls(p, tmp, lock, created)
        except OSError as exc:
            if lock is not None:
                lock.release()
            remove_parents(created)
            raise refusal(p, exc) from None

    def write(self, text: str) -> None:
        try:
            self._f.write(text)
        except OSError as exc:
            self.discard()
            raise refusal(self.path, exc) from None

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as exc:
            self.discard()
            raise refusal(self.path, exc) from None

    def publish(self, replace: bool = True) -> Path:
        """Puts the file in place. replace=False: FileExistsError when `path` appeared meanwhile (nothing is
        overwritten; the caller says which parameter replaces it)."""
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            if replace:
                os.replace(self.tmp, self.path)
            else:
                os.link(self.tmp, self.path)  # fails rather than replace a file created meanwhile
        except FileExistsError:
            self.discard()
            raise
        except OSError as exc:
            self.discard()
            raise refusal(self.path, exc) from None
        self.discard()
        return self.path

    def discard(self) -> None:
        if not self._f.closed:
            try:
                self._f.close()
            except OSError:
                pass
        rmtree(self.tmp)
        self._lock.release()
        if not self.path.exists():
            remove_parents(self._created)


class TempFolder:
    """A run folder being filled under a temporary name beside `final`; `publish` renames it into place,
    `discard` removes it. A dead owner's one is swept by the next `open` in that folder."""

    def __init__(self, final: Path, path: Path, lock: Lock) -> None:
        self.final, self.path, self._lock = final, path, lock

    @classmethod
    def open(cls, out: str | Path, name: str) -> "TempFolder":
        """The temporary folder of `out/name`; `out` is created when missing. Refused in one line when `out`
        cannot hold it (a file, read-only, full) or `out/name` exists."""
        parent = Path(os.path.abspath(out))
        final = parent / name
        anc = parent
        while not os.path.lexists(anc) and anc != anc.parent:
            anc = anc.parent
        if not anc.is_dir():
            raise OutputRefused(f"{parent}: cannot write into it ({anc} is a file, not a folder)",
                                {"path": str(parent)})
        created: list[Path] = []
        lock: Lock | None = None
        try:
            make_parents(parent, created)
            sweep_stale_partials(parent)
            if os.path.lexists(final):
                raise ToolFailure(f"{final} already exists: choose another label or out folder, or remove it",
                                  {"path": str(final)})
            lock, tmp = _temp_names(parent, name)
            os.mkdir(tmp)
            return cls(final, tmp, lock)
        except OSError as exc:
            if lock is not None:
                lock.release()
            remove_parents(created)
            raise refusal(parent, exc, "write into") from None
        except BaseException:
            if lock is not None:
                lock.release()
            remove_parents(created)
            raise

    def publish(self) -> Path:
        """Renames the folder into place; ToolFailure when `final` appeared meanwhile (the folder is then kept,
        under its temporary name, for the caller to report or discard)."""
        try:
            rename_noreplace(self.path, self.final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise ToolFailure(f"{self.final} appeared while the run was measuring: the run is kept in "
                                  f"{self.path}", {"path": str(self.final), "partial": str(self.path)}) from None
            raise refusal(self.final, exc, "publish") from None
        self._lock.release()
        return self.final

    def discard(self) -> None:
        rmtree(self.path)
        self._lock.release()


__all__ = ["TempFile", "TempFolder", "refusal", "write_file"]
