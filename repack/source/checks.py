"""The repack's own checks before anything is written: the source folder, where the output may go, and the free
disk for what the build writes. `python -m repack build` runs check_source and check_disk before a build; the
deployment preflight calls the same functions (a refusal is one RepackError line naming the path and what to do,
with `detail` for programs). The build itself makes the same refusals again from exact sizes, and the output ones
after it has removed dead builds' leftovers beside OUT.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from tools.core.atomic import check_destination, existing_ancestor, resolve_output
from tools.core.errors import op
from tools.core.paths import check_no_symlink_loop, confinement
from tools.core.text import size_text

from ..errors import RepackError, core_refusals
from .checkpoint import check_source_folder, read_config

# The QAT source every build is made from; gated on the hub (the licence must be accepted once, with a token).
SOURCE_REPO = "google/gemma-4-E2B-it-qat-q4_0-unquantized"
# The article: a 2.64 GiB all-4-bit build out of a 10.27 GB source, so a repack writes ~27.6% of its source.
SOURCE_BYTES_ESTIMATE = 10_270_000_000
REPACK_RATIO = 2.64 * 2**30 / SOURCE_BYTES_ESTIMATE
# Headroom kept free beside what a step writes: logs, the HF cache's metadata, the filesystem's own reserve.
DISK_MARGIN_BYTES = 1 << 30


def protected_folders() -> list[Path]:
    """What a build run from a shell may never replace or wrap: the working folder and the home folder (and, as
    for every build, the file system root)."""
    folders = [Path.cwd()]
    try:
        folders.append(Path.home())
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        pass
    return folders


def check_source(source: str | Path) -> None:
    """A source the build can read: a folder with a config.json that is a JSON object of a Gemma 4 config.
    Raises RepackError."""
    source = Path(source)
    with core_refusals():
        check_no_symlink_loop(source, "source folder")
    try:
        os.lstat(source / "config.json")
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise RepackError(f"source checkpoint {source} has no config.json; fetch it with "
                              f"{op('fetch', repo_id=SOURCE_REPO, out=str(source))}, or fix the path",
                              {"file": str(source / "config.json"), "problem": "missing"}) from None
    # there but unusable (a loop, a broken link, not a file, a list instead of an object): named as the probe
    # and the build name it; the weights are the build's to judge (after it has swept dead builds' leftovers)
    check_source_folder(source)
    read_config(source, confinement(source))


def check_output(source: str | Path, out: str | Path, *, force: bool = False,
                 protected_roots: Iterable[str | Path] | None = None) -> None:
    """The refusals the build makes for OUT: the file system root, a protected folder (default: the working and
    the home folder, so `.`) or one above it, the source itself, inside it or above it, a name too long, an
    existing folder without force (or with force, one that is not an empty folder or a build this tool wrote).
    Raises RepackError."""
    roots = protected_folders() if protected_roots is None else list(protected_roots)
    with core_refusals():
        check_destination(out, force, source, roots)


@dataclass(frozen=True)
class DiskEstimate:
    """What a repack of `source` writes, and the room beside `out`."""

    path: Path          # the existing folder the output's file system is measured at
    free_bytes: int
    need_bytes: int     # the estimate, without the headroom
    margin_bytes: int = DISK_MARGIN_BYTES

    @property
    def enough(self) -> bool:
        return self.free_bytes >= self.need_bytes + self.margin_bytes

    def describe(self, what: str) -> str:
        return (f"{size_text(self.free_bytes)} free at {self.path}; {what} needs about {size_text(self.need_bytes)} + "
                f"{size_text(self.margin_bytes)} headroom")

    def detail(self) -> dict[str, object]:
        return {"free_bytes": self.free_bytes, "needed_bytes": self.need_bytes + self.margin_bytes,
                "path": str(self.path)}


def free_bytes(path: Path) -> tuple[Path, int]:
    """Free bytes on the filesystem that `path` (or its nearest existing parent) lives on."""
    p = path if os.path.exists(path) else existing_ancestor(path)  # (exists: a name too long is not an error)
    return p, shutil.disk_usage(p).free


def disk_estimate(source: str | Path, out: str | Path) -> DiskEstimate:
    """The repack's share of its source's safetensors (the all-4-bit build's ratio) against the free disk where
    OUT goes."""
    src = Path(source)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors") if f.is_file())
    at, free = free_bytes(resolve_output(out).parent)
    return DiskEstimate(at, free, int(size * REPACK_RATIO))


def check_disk(source: str | Path, out: str | Path) -> None:
    """Free disk beside OUT for a repack of SOURCE plus headroom. Raises RepackError."""
    est = disk_estimate(source, out)
    if not est.enough:
        short = est.need_bytes + est.margin_bytes - est.free_bytes
        raise RepackError(f"{est.describe(f'a repack of {Path(source).name} into {resolve_output(out)}')}; free "
                          f"{size_text(short)} on {est.path} or write elsewhere", {**est.detail(), "problem": "no-room"})


__all__ = ["DISK_MARGIN_BYTES", "REPACK_RATIO", "SOURCE_BYTES_ESTIMATE", "SOURCE_REPO", "DiskEstimate", "check_disk",
           "check_output", "check_source", "disk_estimate", "free_bytes", "protected_folders"]
