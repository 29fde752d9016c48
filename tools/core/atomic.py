"""Atomic output folders: written under a temporary name next to the destination, published at the end.

What the user can rely on, in every window:
- The output is never a filesystem root, a protected folder (a configured root, the home or working folder) or
  a folder above one, never the source, inside it or above it. An existing output is replaced (force) only
  when it is an empty folder or exactly an output this tool wrote (its REPORT, repack-report.json, lists every
  file in it).
- The new output is written into `.OUT.partial-PID-START-RAND` beside OUT, its owner holding the lock of
  `.OUT.lock-PID-START-RAND` (tools.core.atomic_leftovers: the names, the owner's identity and the sweep of dead
  owners' leftovers). An error, Ctrl-C, SIGTERM or SIGHUP removes them; a SIGKILL or a crash leaves them, and the
  next build in that folder removes them.
- Publishing swaps the complete new folder with the old one in one step (Linux renameat2 RENAME_EXCHANGE), so
  OUT is always either the old build or the new one; the old one is then deleted from the temporary name.
  Where the file system cannot exchange, OUT is moved aside to `.OUT.old-PID-START-TOKEN` and the new folder
  renamed in; a crash in between is rolled back by the next build (the old build is renamed back).
  Signals are held for the few instructions of a swap, so the message printed afterwards ("not written" or
  "written") is true.
- Builds in other threads (a server's jobs) stop at their next block once `cleanup_own_partials()` is called,
  and that function removes whatever temporary folders this process still owns: call it at process exit.

Refusals raise OutputRefused (bad input, with the parameter that fixes it marked: tools.core.errors.param).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from tools.core import atomic_renames as renames
from tools.core.atomic_leftovers import TEMP_EXTRA, Lock, own_id, rmtree, settle
from tools.core.errors import BadInput, param
from tools.core.paths import check_no_symlink_loop, inside

REPORT = "repack-report.json"


class OutputRefused(BadInput):
    """An output folder that may not be written or replaced, or one that could not be published."""


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM (or SIGHUP) arrives during a build; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


class Stopped(BadInput):
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
    swap), except those the process inherited as ignored. Elsewhere (a worker thread) a no-op: Python runs signal handlers in the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # A signal the process was started with ignored stays ignored (the POSIX convention: `cmd &` in a script
    # ignores SIGINT, nohup SIGHUP), so such a command runs on through it.
    saved = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
             if signal.getsignal(s) is not signal.SIG_IGN}
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


# -- paths ----------------------------------------------------------------------------------------------------

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
    if n + TEMP_EXTRA > limit:
        raise OutputRefused(f"{out}: the output folder's name is {n} bytes, too long: a build writes it first under a "
                            f"temporary name {TEMP_EXTRA} bytes longer, and this file system allows {limit} bytes per "
                            f"name; choose a name of at most {limit - TEMP_EXTRA} bytes")


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
    """Refuses (OutputRefused, nothing touched) an output that a build must not write or replace."""
    out = Path(out)
    check_no_symlink_loop(out, "output folder")
    t = resolve_output(out)
    real = Path(os.path.realpath(t))
    if t == t.parent or real == real.parent:
        raise OutputRefused(f"{out}: the output folder is the file system root; choose a new folder")
    _check_name_length(out, t)
    for root in protected_roots:
        r = Path(os.path.realpath(root))
        if inside(r, real) or inside(r, t):
            what = "that folder" if r == real else f"{r}, which lies inside it"
            raise OutputRefused(f"{out}: the output folder would replace {what} (a root, the home or the working "
                                f"folder, never an output); choose a new folder inside it")
    if src is not None:
        s = Path(os.path.realpath(src))
        for o in {t, real}:
            if o == s:
                raise OutputRefused(f"{out}: the output folder is the source folder; choose another output folder")
            if inside(o, s):
                raise OutputRefused(f"{out}: the output folder is inside the source folder; choose another output "
                                    f"folder")
            if inside(s, o):
                raise OutputRefused(f"{out}: the output folder is above the source folder {src}; choose another "
                                    f"output folder")
    for f in src_files:
        r = Path(os.path.realpath(f))
        if inside(r, real) or inside(r, t):
            raise OutputRefused(f"{out}: the source file {f} lies inside the output folder (a symbolic link into "
                                f"it); choose another output folder")
    if os.path.lexists(t):
        if not force:
            raise OutputRefused(f"{out}: already exists; pass {param('force', True)} to replace it", field="force")
        reason = _listing_reason(t)
        if reason:
            raise OutputRefused(f"{out}: {param('force', True)} replaces only an empty folder or a build this tool "
                                f"wrote, and {reason}; move it away yourself or choose another output folder",
                                field="force")


# -- this process's builds -----------------------------------------------------------------------------------

_live_lock = threading.RLock()  # re-entrant: cleanup_own_partials may run in a signal handler
_live: dict[Path, tuple[Path, str, str, Lock]] = {}  # temporary folder -> (parent, output name, token, lock)
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
        removed += [str(p) for p in settle(parent, name, token)]
        lock.release()
    return removed


# -- the context manager -------------------------------------------------------------------------------------

def make_parents(parent: Path, created: list[Path]) -> None:
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


def remove_parents(created: list[Path]) -> None:
    """Removes the folders make_parents created, deepest first, while they are empty."""
    for d in reversed(created):
        try:
            os.rmdir(d)
        except OSError:
            break  # not empty any more: someone else uses it


def _make_temp(parent: Path, name: str) -> tuple[Path, str, Lock]:
    pid, start = own_id()
    for _ in range(100):
        token = f"{pid}-{start}-{secrets.token_hex(4)}"
        lock = Lock.create(parent / f".{name}.lock-{token}")  # first: a folder never exists unlocked
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
    raise OutputRefused(f"{parent}: cannot find a free temporary name for {name}")


class _Publish:
    def __init__(self) -> None:
        self.published = False


@contextmanager
def atomic_directory(out: str | Path, force: bool, *, only_empty: bool = False) -> Iterator[Path]:
    """Yields an empty temporary folder beside OUT; publishes it as OUT when the block ends without error.
    `force` replaces an empty folder or a build this tool wrote; with `only_empty`, an empty folder only (what
    a writer that makes no repack build, such as a fetch, may replace).

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
        lock: Lock | None = None
        token = ""
        try:
            check_stopped(shown)
            with _signals_held():  # no window where a folder exists but is not yet ours to remove
                try:
                    make_parents(parent, created)
                    tmp, token, lock = _make_temp(parent, name)
                except OSError as e:
                    raise OutputRefused(f"{shown}: cannot create the output folder ({e.strerror or e})") from None
                with _live_lock:
                    _live[tmp] = (parent, name, token, lock)
            yield tmp
            check_stopped(shown)
            _publish(tmp, token, t, shown, force, state, only_empty)
        except BaseException as exc:
            if tmp is not None:
                settle(parent, name, token)
            _forget(tmp, lock)  # before the parents: the lock file is in the innermost one
            if state.published:
                exc.written = str(shown)  # type: ignore[attr-defined]
            else:
                remove_parents(created)
            raise
        finally:
            _forget(tmp, lock)


def _forget(tmp: Path | None, lock: Lock | None) -> None:
    """A build's folders are settled: it is no longer this process's to clean up, and its lock goes."""
    if tmp is not None:
        with _live_lock:
            _live.pop(tmp, None)
    if lock is not None:
        lock.release()


def _publish(tmp: Path, token: str, t: Path, shown: Path, force: bool, state: _Publish,
             only_empty: bool = False) -> None:
    _step("publish")
    if not os.path.lexists(t):
        try:
            with _signals_held():
                renames.rename_noreplace(tmp, t)
                state.published = True
                _step("published")
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise OutputRefused(f"{shown}: cannot publish the build ({e.strerror or e})") from None
            if not force:
                raise OutputRefused(f"{shown}: another build wrote it while this one ran; this build was "
                                    f"discarded (pass {param('force', True)} to replace it)") from None
    if not force:
        raise OutputRefused(f"{shown}: another build wrote it while this one ran; this build was discarded "
                            f"(pass {param('force', True)} to replace it)")
    reason = _listing_reason(t)
    if only_empty and not reason and os.listdir(t):  # a build's report is no mark of this writer
        reason = "it is a build, not an empty folder"
    if reason:
        what = "an empty folder" if only_empty else "an empty folder or a build this tool wrote"
        raise OutputRefused(f"{shown}: changed while building and {param('force', True)} replaces only {what}: "
                            f"{reason}; this build was discarded")
    try:
        with _signals_held():
            renames.renameat2(tmp, t, renames.RENAME_EXCHANGE)
            state.published = True  # OUT is the new build; the old one is at the temporary name
            _step("exchanged")
    except OSError as e:
        if e.errno not in renames.UNSUPPORTED:
            raise OutputRefused(f"{shown}: cannot publish the build ({e.strerror or e})") from None
        _publish_journaled(tmp, t, shown, token, state)
        _step("replaced")
        return
    rmtree(tmp)
    _step("replaced")


def _publish_journaled(tmp: Path, t: Path, shown: Path, token: str, state: _Publish) -> None:
    """Two renames where the file system cannot exchange: OUT to `.OUT.old-TOKEN`, the new build to OUT. A crash
    between them leaves both names, which the next build's sweep rolls back (see atomic_leftovers.settle)."""
    old = t.parent / f".{t.name}.old-{token}"
    with _signals_held():
        try:
            os.rename(t, old)
        except OSError as e:
            raise OutputRefused(f"{shown}: cannot move the old build aside ({e.strerror or e})") from None
        try:
            _step("old-aside")
            renames.rename_noreplace(tmp, t)
        except BaseException as e:
            try:
                renames.rename_noreplace(old, t)  # roll back; if OUT was taken meanwhile, settle deletes it
                kept = "the old build was kept"
            except OSError:
                kept = f"the old build is in {old}"
            if isinstance(e, OSError) and e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise OutputRefused(f"{shown}: another build wrote it while this one ran; this build was "
                                    f"discarded") from None
            if isinstance(e, OSError):
                raise OutputRefused(f"{shown}: cannot publish the build ({e.strerror or e}); {kept}") from None
            raise
        state.published = True
        _step("published")
    rmtree(old)
