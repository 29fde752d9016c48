"""Atomic output folders: written under a temporary name next to the destination, renamed at the end.

An error, Ctrl-C or SIGTERM removes the temporary folder, so neither the output nor a partial folder is left
behind; an existing output is replaced only after the new one is complete.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .errors import RepackError


class Terminated(KeyboardInterrupt):
    """Raised in the main thread when SIGTERM (or SIGHUP) arrives during a build."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(f"signal {signum}")


def check_destination(out: Path, force: bool, src: Path | None = None) -> None:
    if src is not None and out.resolve() == src.resolve():
        raise RepackError(f"{out}: the output folder is the source folder; choose another output folder")
    if src is not None and src.resolve() in out.resolve().parents:
        raise RepackError(f"{out}: the output folder is inside the source folder; choose another output folder")
    if out.exists() and not force:
        raise RepackError(f"{out}: already exists; pass --force to replace it")


@contextmanager
def atomic_directory(out: Path, force: bool) -> Iterator[Path]:
    out = Path(out)
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
    except OSError as e:
        raise RepackError(f"{out}: cannot create the output folder ({e.strerror or e})") from None
    handlers: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            handlers[sig] = signal.signal(sig, _raise_terminated)
    try:
        yield tmp
        if out.exists() or out.is_symlink():
            if not force:
                raise RepackError(f"{out}: appeared while building; pass --force to replace it")
            trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.rename(out, trash / "old")
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for sig, h in handlers.items():
            signal.signal(sig, h)  # type: ignore[arg-type]
