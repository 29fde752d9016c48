"""Free disk where a step will write (a path that may not exist yet)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from repack.atomic import existing_ancestor


def free_bytes(path: Path) -> tuple[Path, int]:
    """(the path measured, its filesystem's free bytes): `path`, or its nearest existing parent."""
    p = path if os.path.exists(path) else existing_ancestor(path)  # os.path.exists: a name too long is no error
    return p, shutil.disk_usage(p).free


__all__ = ["free_bytes"]
