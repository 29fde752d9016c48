"""Real tmpfs mounts for the output tests (read-only and full places): whether this machine lets the suite mount
(it runs as root where CI does), and the helpers on a mounted place. The `mounts` fixture is conftest.py's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


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
