"""Atomic output files and run folders, the file-and-folder counterpart of tools.core.atomic's build folders.

A file is written to `.NAME.partial-PID-START-RAND` beside it (its owner holding `.NAME.lock-...`, the names of
tools.core.atomic_leftovers), fsynced and renamed over NAME. A run folder (`TempFolder`) is filled under such a
name and renamed into place by `publish`. Either way, a dead owner's leftovers are swept by the next write in that
folder, and every failure of the file system (a full disk, a read-only mount, a parent that is a file, a folder
where a file is wanted, a mount point) is one line naming the path: OutputRefused, or ToolFailure for a full disk
or an I/O error, where another path is no remedy.

Run folders are named by the time they start, so two runs started in the same second ask for one name: the name is
reserved while the folder's name lock is held (`names_held`, an flock on the parent folder itself, which the
kernel drops however its holder ends), and a name that is taken (a folder there, or a live run's temporary of
that name) gets a suffix, `-2`, `-3`, ... A run folder that is written in place (a resumable sweep) is held by
an flock on the folder itself for as long as its run writes it (`HeldFolder`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tools.core.atomic import OutputRefused, make_parents, remove_parents
from tools.core.atomic_leftovers import NAME_RE, Lock, own_id, rmtree, sweep_stale_partials
from tools.core.atomic_renames import rename_noreplace
from tools.core.errors import BadInput, ToolFailure
from tools.core.text import clip

_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG)
_WHY = {errno.EROFS: "a read-only file system", errno.ENOTDIR: "a parent of it is a file, not a folder",
        errno.EISDIR: "it is a folder", errno.EBUSY: "it is a mount point or in use",
        errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the disk",
        errno.EDQUOT: "the disk quota is used up", errno.EXDEV: "it is on another file system",
        errno.ENAMETOOLONG: "the name is too long"}
_REMEDY = {errno.ENAMETOOLONG: "give a shorter path (each name at most 255 bytes, the whole under 4,096)",
           errno.ENOENT: "give a path that exists", errno.ELOOP: "give a path that is not a symbolic link loop",
           errno.EACCES: "give a path this user may use", errno.EPERM: "give a path this user may use"}


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


def write_file(path: str | Path, data: str | bytes, *, replace: bool = True) -> Path:
    """Writes `path` whole or not at all: a temporary beside it, fsynced, renamed over it. Missing parent folders
    are created (and removed again when the write fails). OutputRefused / ToolFailure in one line on failure, with
    nothing of this write left behind. replace=False: FileExistsError when `path` exists by then (a second writer
    was first; nothing is overwritten, and the caller says which parameter replaces it)."""
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
        if replace:
            os.replace(tmp, p)
            tmp = None
        else:
            os.link(tmp, p)  # fails rather than replace a file another writer put there meanwhile
        return p
    except FileExistsError:
        if replace:
            raise refusal(p, FileExistsError(errno.EEXIST, "File exists")) from None
        raise
    except OSError as exc:
        raise refusal(p, exc) from None
    finally:
        if tmp is not None:
            rmtree(tmp)
        if lock is not None:
            lock.release()
        if not os.path.lexists(p):
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
        """The temporary folder of a run named `name` in `out` (created when missing), or of `name-2`, `name-3`, ...
        where that name is taken (`reserve_name`); `final` is the name it got. Refused in one line when `out`
        cannot hold it (a file, read-only, full)."""
        parent = Path(os.path.abspath(out))
        _check_folder_parent(parent)
        created: list[Path] = []
        lock: Lock | None = None
        try:
            make_parents(parent, created)
            sweep_stale_partials(parent)
            with names_held(parent):  # the name chosen and the temporary that claims it, in one step
                final = parent / reserve_name(parent, name)
                lock, tmp = _temp_names(parent, final.name)
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
        """Renames the folder into place. Where `final` appeared meanwhile all the same (made by something that does
        not reserve names: a person, another program), the run is published under the next free name and
        ToolFailure names that folder."""
        try:
            try:
                rename_noreplace(self.path, self.final)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                with names_held(self.final.parent):
                    other = self.final.parent / reserve_name(self.final.parent, self.final.name)
                    rename_noreplace(self.path, other)
                self._lock.release()
                raise ToolFailure(f"{self.final} appeared while the run was measuring, made by something other "
                                  f"than a run of this project: the run is kept in {other}",
                                  {"path": str(self.final), "kept": str(other)}) from None
        except OSError as exc:
            raise refusal(self.final, exc, "publish") from None
        self._lock.release()
        return self.final

    def discard(self) -> None:
        rmtree(self.path)
        self._lock.release()


def _check_folder_parent(parent: Path) -> None:
    anc = parent
    while not os.path.lexists(anc) and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise OutputRefused(f"{parent}: cannot write into it ({anc} is a file, not a folder)", {"path": str(parent)})


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


@contextmanager
def names_held(parent: Path) -> Iterator[None]:
    """The name lock of the folder `parent` (an flock on the folder itself) for the block: the runs that choose
    a name in `parent` do it one at a time. OSError when `parent` cannot be opened."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # a file system without locks: names are then only as safe as a check can make them
            if exc.errno not in _NO_LOCKS:
                raise
        yield
    finally:
        os.close(fd)


def reserve_name(parent: Path, name: str) -> str:
    """`name`, or `name-2`, `name-3`, ... : the first that is neither an entry of `parent` nor claimed by a live
    run's temporary there (`.NAME.partial-...`, `.NAME.lock-...`). Call it with `names_held(parent)` and claim the
    name before leaving that block (a temporary of that name, or the folder itself)."""
    claimed = set()
    for entry in os.listdir(parent):
        m = NAME_RE.match(entry)
        if m is not None:
            claimed.add(m["name"])
    for k in range(1, 10_000):
        cand = name if k == 1 else f"{name}-{k}"
        if cand not in claimed and not os.path.lexists(parent / cand):
            return cand
    raise OutputRefused(f"{parent / name}: cannot find a free name for the run (tried {name}-2 to {name}-9999)",
                        {"path": str(parent / name)})


class HeldFolder:
    """A run folder written in place, held by an flock on the folder itself while its run writes it: a second run
    asked for the same folder is refused (`hold`), and a new one gets a name of its own (`reserve`)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def reserve(cls, out: str | Path, name: str, *, exact: bool = False) -> "HeldFolder":
        """A new folder `out/name` (or `name-2`, ... where that is taken; with `exact`, the folder `out/name`
        itself, new or not: `hold`), created and held. One line when `out` cannot hold it."""
        parent = Path(os.path.abspath(out))
        _check_folder_parent(parent)
        try:
            make_parents(parent, [])
            sweep_stale_partials(parent)
            with names_held(parent):
                if exact:
                    path = parent / name
                    if not os.path.lexists(path):
                        os.mkdir(path)
                else:
                    path = parent / reserve_name(parent, name)
                    os.mkdir(path)
                return cls.hold(path)
        except OSError as exc:
            raise refusal(parent / name, exc, "create") from None

    @classmethod
    def hold(cls, path: str | Path) -> "HeldFolder":
        """Holds an existing run folder; ToolFailure when another run (a live process) holds it."""
        p = Path(path)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # a link: the caller refuses it
        except OSError as exc:
            raise refusal(p, exc, "open") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                return cls(p, fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ToolFailure(f"{p} is being written by another run now: wait for it to end, or write a new "
                                  f"run folder", {"path": str(p)}) from None
            raise refusal(p, exc, "lock") from None
        return cls(p, fd)

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> "HeldFolder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def path_failure(exc: OSError) -> ToolFailure:
    """Any OSError on a path as one line naming the path (clipped), what the file system said and what to do:
    ToolFailure for a full disk or an I/O error, BadInput for the rest (a name over 255 bytes, no such file, no
    permission). The front ends' one mapping for an OSError that no call site turned into a failure of its own."""
    path = clip(os.fsdecode(exc.filename) if isinstance(exc.filename, (str, bytes)) else str(exc.filename), 200)
    why = _WHY.get(exc.errno or 0) or exc.strerror or str(exc)
    detail = {"path": path, "errno": errno.errorcode.get(exc.errno or 0, str(exc.errno))}
    if exc.errno in _NO_ROOM:
        return ToolFailure(f"{path}: {why}; free space on its disk (or fix the disk) and try again", detail)
    return BadInput(f"{path}: {why}; {_REMEDY.get(exc.errno or 0, 'give another path')}", detail)


__all__ = ["HeldFolder", "TempFile", "TempFolder", "names_held", "path_failure", "refusal", "reserve_name",
           "write_file"]
