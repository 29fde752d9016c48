"""Atomic output folders: written under a temporary name next to the destination, published at the end.

What the user can rely on, in every window:
- The output is never a filesystem root, a protected folder (a configured root, the home or working folder) or
  a folder above one, never the source, inside it or above it. An existing output is replaced (--force) only
  when it is an empty folder or exactly a build this tool wrote (its repack-report.json lists every file in it).
- The new build is written into `.OUT.partial-PID-START-RAND` beside OUT (PID and START, the owner's process
  start time in ms, name the owner in messages). The owner holds an advisory lock (flock) on `.OUT.lock-PID-START-RAND`
  from before its folders exist until after they are gone; the kernel drops it however the owner ends, and in
  any PID namespace, so a lock that can be taken marks a dead build's leftovers. An error, Ctrl-C, SIGTERM or
  SIGHUP removes them; a SIGKILL or a crash leaves them, and the next build in that folder removes them. Nothing
  else is swept: not a folder named like a leftover without its lock file, a link, a mount point, nor the source
  or a protected folder (nor anything holding one or inside one).
- Publishing swaps the complete new folder with the old one in one step (Linux renameat2 RENAME_EXCHANGE), so
  OUT is always either the old build or the new one; the old one is then deleted from the temporary name.
  Where the file system cannot exchange, OUT is moved aside to `.OUT.old-PID-START-TOKEN` and the new folder
  renamed in; a crash in between is rolled back by the next build (the old build is renamed back).
  Signals are held for the few instructions of a swap, so the message printed afterwards ("not written" or
  "written") is true.
- Builds in other threads (a server's jobs) stop at their next block once `cleanup_own_partials()` is called,
  and that function removes whatever temporary folders this process still owns: call it at process exit.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import platform
import re
import secrets
import shutil
import signal
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from .errors import RepackError

REPORT = "repack-report.json"
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "i686": 353, "i386": 353, "armv7l": 382, "ppc64le": 357,
                  "s390x": 347, "riscv64": 276}
_NAME_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old|lock)-(?P<pid>\d+)-(?P<start>\d+)-(?P<rand>[0-9a-f]{8})$")


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM (or SIGHUP) arrives during a build; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class Stopped(RepackError):
    """Raised in a build once `cleanup_own_partials()` asked this process's builds to stop."""


def _step(name: str) -> None:
    """A named point of the publishing sequence; tests replace it to inject a failure or a signal there."""


# -- signals --------------------------------------------------------------------------------------------------

_defer_depth = 0
_pending: int | None = None


def _signal_exception(signum: int) -> KeyboardInterrupt:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def _on_signal(signum: int, frame: object) -> None:
    global _pending
    if _defer_depth:
        _pending = signum  # raised when the swap in progress is over
        return
    raise _signal_exception(signum)


@contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """In the main thread: SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt / Terminated (held back during a
    swap). Elsewhere (a worker thread) a no-op: Python runs signal handlers in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)  # type: ignore[arg-type]


@contextmanager
def _signals_held() -> Iterator[None]:
    global _defer_depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _defer_depth += 1
    try:
        yield
    finally:
        _defer_depth -= 1
        if _defer_depth == 0 and _pending is not None:
            signum, _pending = _pending, None
            raise _signal_exception(signum)


# -- process identity ----------------------------------------------------------------------------------------

def _start_ms(pid: int) -> int | None:
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


def _own_id() -> tuple[int, int]:
    global _own
    pid = os.getpid()
    if _own is None or _own[0] != pid:  # recomputed in a forked child
        _own = (pid, _start_ms(pid) or int(time.time() * 1000))
    return _own


# -- paths ----------------------------------------------------------------------------------------------------

def check_no_symlink_loop(path: str | Path, what: str = "folder") -> None:
    """Raises RepackError when a symbolic link in `path` loops (the OS answers ELOOP, not 'no such file')."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RepackError(f"{path}: symlink loop: a symbolic link on the way to the {what} points back into "
                              f"itself; fix or remove that link") from None


def resolve_output(out: str | Path) -> Path:
    """The folder the kernel would create for OUT (where a build is written, what messages should name): its
    parent resolved as the kernel walks it (a `..` after a symbolic link leads out of the link's target, not back
    beside the link, so nothing is collapsed as text); the last component is kept as given."""
    s = os.fspath(out)
    if not os.path.isabs(s):
        s = os.path.join(os.getcwd(), s)
    head, name = os.path.split(s.rstrip("/") or "/")
    if name in ("", ".", ".."):
        return Path(os.path.realpath(s))
    return Path(os.path.realpath(head)) / name


# the longest temporary name is `.NAME.partial-PID-START-RAND`: PID up to 7 digits (Linux's pid_max is at most
# 2**22), START 13 (milliseconds since 1970 until the year 2286), RAND 8
_TEMP_EXTRA = len(".") + len(".partial-") + 7 + 1 + 13 + 1 + 8


def existing_ancestor(p: Path) -> Path:
    """The nearest folder above `p` that exists: the file system a build of `p` will be written on."""
    p = p.parent
    while not os.path.exists(p) and p != p.parent:
        p = p.parent
    return p


def _check_name_length(out: str | Path, t: Path) -> None:
    """Refuses an output name too long to be written under its temporary name, before anything is touched."""
    try:
        limit = os.pathconf(existing_ancestor(t), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    n = len(os.fsencode(t.name))
    if n + _TEMP_EXTRA > limit:
        raise RepackError(f"{out}: the output folder's name is {n} bytes, too long: a build writes it first under a "
                          f"temporary name {_TEMP_EXTRA} bytes longer, and this file system allows {limit} bytes per "
                          f"name; choose a name of at most {limit - _TEMP_EXTRA} bytes")


def _inside(a: Path, b: Path) -> bool:
    """a is b or below it."""
    return a == b or b in a.parents


def _listing_reason(out: Path) -> str | None:
    """None when OUT may be replaced: an empty folder or exactly a build this tool wrote; else why not."""
    if out.is_symlink():
        return "it is a symbolic link"
    if not out.is_dir():
        return "it is not a folder"
    try:
        names = sorted(os.listdir(out))
    except OSError as e:
        return f"it cannot be listed ({e.strerror or e})"
    if not names:
        return None
    rep = out / REPORT
    if REPORT not in names:
        return f"it holds {names[0]!r} and no {REPORT}, so it is not a build this tool wrote"
    try:
        files = json.loads(rep.read_text()).get("files")
    except (OSError, ValueError, UnicodeDecodeError, AttributeError):
        files = None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return f"its {REPORT} has no file list (an older or foreign report)"
    extra = sorted(set(names) - set(files))
    if extra:
        return f"it holds {extra[0]!r}, which its {REPORT} does not list"
    for n in names:
        st = os.lstat(out / n)
        if not (st.st_mode & 0o170000 == 0o100000):
            return f"{n!r} in it is not a regular file"
    return None


def check_destination(out: str | Path, force: bool, src: str | Path | None = None,
                      protected_roots: Iterable[str | Path] = (), src_files: Iterable[str | Path] = ()) -> None:
    """Refuses (RepackError, nothing touched) an output that a build must not write or replace."""
    out = Path(out)
    check_no_symlink_loop(out, "output folder")
    t = resolve_output(out)
    real = Path(os.path.realpath(t))
    if t == t.parent or real == real.parent:
        raise RepackError(f"{out}: the output folder is the file system root; choose a new folder")
    _check_name_length(out, t)
    for root in protected_roots:
        r = Path(os.path.realpath(root))
        if _inside(r, real) or _inside(r, t):
            what = "that folder" if r == real else f"{r}, which lies inside it"
            raise RepackError(f"{out}: the output folder would replace {what} (a root, the home or the working "
                              f"folder, never an output); choose a new folder inside it")
    if src is not None:
        s = Path(os.path.realpath(src))
        for o in {t, real}:
            if o == s:
                raise RepackError(f"{out}: the output folder is the source folder; choose another output folder")
            if _inside(o, s):
                raise RepackError(f"{out}: the output folder is inside the source folder; choose another output "
                                  f"folder")
            if _inside(s, o):
                raise RepackError(f"{out}: the output folder is above the source folder {src}; choose another "
                                  f"output folder")
    for f in src_files:
        r = Path(os.path.realpath(f))
        if _inside(r, real) or _inside(r, t):
            raise RepackError(f"{out}: the source file {f} lies inside the output folder (a symbolic link into "
                              f"it); choose another output folder")
    if os.path.lexists(t):
        if not force:
            raise RepackError(f"{out}: already exists; pass --force to replace it")
        reason = _listing_reason(t)
        if reason:
            raise RepackError(f"{out}: --force replaces only an empty folder or a build this tool wrote, and "
                              f"{reason}; move it away yourself or choose another output folder")


# -- temporary folders, their owners and their recovery ------------------------------------------------------

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
    m = _NAME_RE.match(p.name)
    if m is None:
        return None
    token = f"{m['pid']}-{m['start']}-{m['rand']}"
    return Leftover(p, m["name"], m["kind"], int(m["pid"]), int(m["start"]), token)


class _Lock:
    """A build's hold on its lock file (see the module's docstring)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def create(cls, path: Path) -> "_Lock | None":
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
    return any(_inside(k, p) or _inside(p, k) for k in keep)


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
        want = stat.S_ISREG if lo.kind == "lock" else stat.S_ISDIR
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


def _settle(parent: Path, name: str, token: str) -> list[Path]:
    """Brings one build's swap to rest: an old build moved aside comes back if OUT is missing (roll back) and is
    deleted if OUT is there; the temporary folder is deleted. Returns what was deleted."""
    removed = []
    out, tmp, old = parent / name, parent / f".{name}.partial-{token}", parent / f".{name}.old-{token}"
    if os.path.lexists(old):
        if not os.path.lexists(out):
            try:
                _rename_noreplace(old, out)
            except OSError:
                pass  # the old build stays under its temporary name: it is the only copy
        else:
            _rmtree(old)
            removed.append(old)
    if os.path.lexists(tmp):
        _rmtree(tmp)
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
            removed = _settle(folder, name, token)
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


def _rmtree(p: Path) -> None:
    if p.is_symlink():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


def _du(p: Path) -> int:
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


# -- this process's builds -----------------------------------------------------------------------------------

_live_lock = threading.RLock()  # re-entrant: cleanup_own_partials may run in a signal handler
_live: dict[Path, tuple[Path, str, str, _Lock]] = {}  # temporary folder -> (parent, output name, token, lock)
_stop = threading.Event()


def check_stopped(out: str | Path | None = None) -> None:
    """Raises Stopped once cleanup_own_partials() was called; builds call it between blocks."""
    if _stop.is_set():
        what = f"{out} was" if out is not None else "the output was"
        raise Stopped(f"stopped because the process is exiting; {what} not written")


def cleanup_own_partials(wait_s: float = 5.0) -> list[str]:
    """For a process that is about to exit (an atexit hook, a SIGTERM handler): asks every build of this process
    to stop, waits up to `wait_s` for them to remove their own temporary folders, then removes (or rolls back)
    what is left. New builds in this process fail from now on. Returns the folders removed here."""
    _stop.set()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with _live_lock:
            if not _live:
                break
        time.sleep(0.02)
    with _live_lock:
        left = list(_live.values())
    removed = []
    for parent, name, token, lock in left:
        removed += [str(p) for p in _settle(parent, name, token)]
        lock.release()
    return removed


# -- renames --------------------------------------------------------------------------------------------------

_libc = None


def _renameat2(src: Path, dst: Path, flags: int) -> None:
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


_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


def _rename_noreplace(src: Path, dst: Path) -> None:
    """rename(2) that fails with EEXIST if dst exists (plain rename would replace an empty folder)."""
    try:
        _renameat2(src, dst, RENAME_NOREPLACE)
        return
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


# -- the context manager -------------------------------------------------------------------------------------

def _make_parents(parent: Path, created: list[Path]) -> None:
    """Creates the missing folders above OUT (with the umask's mode), adding each to `created` (deepest last)."""
    missing = []
    p = parent
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
            created.append(d)
        except FileExistsError:
            pass


def _remove_parents(created: list[Path]) -> None:
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            break  # not empty any more: someone else uses it


def _make_temp(parent: Path, name: str) -> tuple[Path, str, _Lock]:
    pid, start = _own_id()
    for _ in range(100):
        token = f"{pid}-{start}-{secrets.token_hex(4)}"
        lock = _Lock.create(parent / f".{name}.lock-{token}")  # first: a folder never exists unlocked
        if lock is None:
            continue
        tmp = parent / f".{name}.partial-{token}"
        try:
            os.mkdir(tmp)  # mode 0o777 less the umask, like any folder the user creates (mkdtemp would give 0700)
            return tmp, token, lock
        except BaseException as e:
            lock.release()
            if isinstance(e, FileExistsError):
                continue
            raise
    raise RepackError(f"{parent}: cannot find a free temporary name for {name}")


class _Publish:
    def __init__(self) -> None:
        self.published = False


@contextmanager
def atomic_directory(out: str | Path, force: bool) -> Iterator[Path]:
    """Yields an empty temporary folder beside OUT; publishes it as OUT when the block ends without error.

    On any exception (including KeyboardInterrupt, Terminated, Stopped or a cancelled job's exception) the
    temporary folder and the parent folders this call created are removed and OUT is left as it was. If the
    exception comes after OUT was published, it carries `written = OUT` so a caller can say so."""
    shown = Path(out)
    t = resolve_output(shown)
    parent, name = t.parent, t.name
    state = _Publish()
    with signals_as_exceptions():
        created: list[Path] = []
        tmp: Path | None = None
        lock: _Lock | None = None
        token = ""
        try:
            check_stopped(shown)
            with _signals_held():  # no window where a folder exists but is not yet ours to remove
                try:
                    _make_parents(parent, created)
                    tmp, token, lock = _make_temp(parent, name)
                except OSError as e:
                    raise RepackError(f"{shown}: cannot create the output folder ({e.strerror or e})") from None
                with _live_lock:
                    _live[tmp] = (parent, name, token, lock)
            yield tmp
            check_stopped(shown)
            _publish(tmp, token, t, shown, force, state)
        except BaseException as exc:
            if tmp is not None:
                _settle(parent, name, token)
            _forget(tmp, lock)  # before the parents: the lock file is in the innermost one
            if state.published:
                exc.written = str(shown)  # type: ignore[attr-defined]
            else:
                _remove_parents(created)
            raise
        finally:
            _forget(tmp, lock)


def _forget(tmp: Path | None, lock: _Lock | None) -> None:
    """A build's folders are settled: it is no longer this process's to clean up, and its lock goes."""
    if tmp is not None:
        with _live_lock:
            _live.pop(tmp, None)
    if lock is not None:
        lock.release()


def _publish(tmp: Path, token: str, t: Path, shown: Path, force: bool, state: _Publish) -> None:
    _step("publish")
    if not os.path.lexists(t):
        try:
            with _signals_held():
                _rename_noreplace(tmp, t)
                state.published = True
                _step("published")
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise RepackError(f"{shown}: cannot publish the build ({e.strerror or e})") from None
            if not force:
                raise RepackError(f"{shown}: another build wrote it while this one ran; this build was "
                                  f"discarded (pass --force to replace it)") from None
    if not force:
        raise RepackError(f"{shown}: another build wrote it while this one ran; this build was discarded "
                          f"(pass --force to replace it)")
    reason = _listing_reason(t)
    if reason:
        raise RepackError(f"{shown}: changed while building and --force replaces only an empty folder or a build "
                          f"this tool wrote: {reason}; this build was discarded")
    try:
        with _signals_held():
            _renameat2(tmp, t, RENAME_EXCHANGE)
            state.published = True  # OUT is the new build; the old one is at the temporary name
            _step("exchanged")
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            raise RepackError(f"{shown}: cannot publish the build ({e.strerror or e})") from None
        _publish_journaled(tmp, t, shown, token, state)
        _step("replaced")
        return
    _rmtree(tmp)
    _step("replaced")


def _publish_journaled(tmp: Path, t: Path, shown: Path, token: str, state: _Publish) -> None:
    """Two renames where the file system cannot exchange: OUT to `.OUT.old-TOKEN`, the new build to OUT. A crash
    between them leaves both names, which the next build's sweep rolls back (see _settle)."""
    old = t.parent / f".{t.name}.old-{token}"
    with _signals_held():
        try:
            os.rename(t, old)
        except OSError as e:
            raise RepackError(f"{shown}: cannot move the old build aside ({e.strerror or e})") from None
        try:
            _step("old-aside")
            _rename_noreplace(tmp, t)
        except BaseException as e:
            try:
                _rename_noreplace(old, t)  # roll back; if OUT was taken meanwhile, _settle deletes the old one
                kept = "the old build was kept"
            except OSError:
                kept = f"the old build is in {old}"
            if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise RepackError(f"{shown}: another build wrote it while this one ran; this build was "
                                  f"discarded") from None
            if isinstance(e, OSError):
                raise RepackError(f"{shown}: cannot publish the build ({e.strerror or e}); {kept}") from None
            raise
        state.published = True
        _step("published")
    _rmtree(old)
