"""Real tmpfs mounts for the output tests (read-only and full places): whether this machine lets the suite mount
(it runs as root where CI does), and the helpers on a mounted place. The `mounts` fixture is conftest.py's."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

from tools.core import atomic_files


def can_mount() -> bool:
    if os.geteuid() != 0:
        return False
    probe = Path(f"/tmp/.hostile-mount-probe-{os.getpid()}")
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(probe)],
                            capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    except OSError:
        return False
    finally:
        probe.rmdir()


MOUNT = can_mount()


def fill(place: Path) -> None:
    """Fills the file system at `place` (a small tmpfs) to its last block."""
    fd = os.open(place / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.is_dir() else []


def inject_write_error(monkeypatch, code: int) -> None:
    """The atomic writers' temporary files (and, for EROFS, run folders) fail with errno `code`: a full or
    read-only place where the suite cannot mount one."""
    real = os.open

    def failing(path, flags, *a, **kw):
        if ".partial-" in os.fspath(path):
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(atomic_files.os, "open", failing)
    if code == errno.EROFS:  # mkdir of a run folder on a read-only place
        real_mkdir = os.mkdir
        monkeypatch.setattr(atomic_files.os, "mkdir", lambda p, *a, **kw: (_ for _ in ()).throw(
            OSError(code, os.strerror(code), os.fspath(p))) if ".partial-" in os.fspath(p) else real_mkdir(p, *a, **kw))
