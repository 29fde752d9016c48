"""Confine the paths that the MCP tools read or write to configured roots.

An agent passes paths as strings; every one is resolved (symlinks followed, `..` collapsed) and must land inside
a root of the right kind: "models" (checkpoints read and written, served models) or "evidence" (sweep results,
token records, reports). Relative paths resolve against the first root of their kind. Anything else is refused
with a one-line error naming the path and the roots, so the agent can retry with an allowed path.

The same rules hold where a file is opened (`open_confined`: checked on the open descriptor, so a link swapped
after a check cannot redirect the read) and where only a name is checked (`inside`).

Roots come from `--models-root` / `--evidence-root` on the server command line, else from the environment
(`GEMMA4_T4_MODELS_ROOTS`, `GEMMA4_T4_EVIDENCE_ROOTS`, os.pathsep-separated), else the project's own
`models/` and `evidence/` folders.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Sequence

from tools.core.errors import BadInput
from tools.core.root import PROJECT_ROOT
from tools.core.text import clip

Kind = Literal["models", "evidence"]
ENV = {"models": "GEMMA4_T4_MODELS_ROOTS", "evidence": "GEMMA4_T4_EVIDENCE_ROOTS"}
# A Hugging Face hub id such as "google/gemma-4-E2B-it": served by vLLM from its cache, not a path we open.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# Longest file name and path Linux file systems take (ext4, xfs, tmpfs): longer ones fail every system call with
# ENAMETOOLONG, so they are refused here, naming the argument, rather than as an OSError from somewhere later.
NAME_MAX, PATH_MAX = 255, 4096
# Where a file opened through open_confined may resolve: (what the folders are, for the message; the folders),
# one group after another, each of which must hold it.
Within = Sequence[tuple[str, Sequence[Path]]]


class PathNotAllowed(BadInput):
    """A path outside the configured roots (or otherwise unusable); the message says what to do, `detail` names
    the argument, the input (cut as in the message) and the problem for programs."""

    def __init__(self, message: str, what: str = "path", text: object = "", problem: str = "") -> None:
        super().__init__(message, {"argument": what, "input": clip(text), "problem": problem})


def _check_length(text: str, what: str) -> None:
    longest = max((len(os.fsencode(part)) for part in Path(text).parts), default=0)
    if longest > NAME_MAX or len(os.fsencode(text)) >= PATH_MAX:
        raise PathNotAllowed(f"{what} {clip(text)} is too long for a path (a name of {longest} bytes, at most "
                             f"{NAME_MAX}; {len(os.fsencode(text))} bytes in all, at most {PATH_MAX - 1}): give a "
                             f"shorter one", what, text, "too-long")


def _resolve(p: str | Path) -> Path:
    return Path(os.path.realpath(Path(p).expanduser()))


def inside(path: str | Path, folder: str | Path) -> bool:
    """`path` is `folder` or below it, by name (both as given: resolve them first where links matter)."""
    p, f = Path(path), Path(folder)
    return p == f or f in p.parents


def inside_any(path: str | Path, folders: Sequence[str | Path]) -> bool:
    return any(inside(path, f) for f in folders)


class FileRefused(BadInput):
    """A file of a checkpoint folder that is not read: missing, a loop or broken link, not a regular file, or a
    link out of the folders it must stay in. `detail` names the file and the problem."""


def open_error(path: Path, e: OSError) -> FileRefused:
    """The one-line message for a file that cannot be opened (a symlink loop is not "no such file")."""
    if e.errno == errno.ELOOP:
        why, code = "a symlink loop (the link points, directly or through others, back to itself)", "symlink-loop"
    elif e.errno == errno.ENOENT and os.path.islink(path):
        why, code = "a broken symlink (its target does not exist)", "broken-symlink"
    elif e.errno == errno.ENOENT:
        why, code = "no such file", "missing"
    else:
        why, code = f"cannot read ({e.strerror or e})", "unreadable"
    return FileRefused(f"{clip(path)}: {why}; fix the checkpoint folder or re-download it",
                       {"file": clip(path), "problem": code})


def open_confined(path: Path, within: Within = ()) -> int:
    """Opens a regular file read-only. With `within`, the file actually opened must lie inside one folder of
    every group, checked on the open descriptor (so a link swapped after a check cannot redirect the read).

    The error never says where a link outside points: that would tell a client what lies outside its roots."""
    try:
        # O_NONBLOCK: opening a FIFO (or a link to one) would otherwise wait forever for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise open_error(path, e) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileRefused(f"{clip(path)}: not a regular file; pass a checkpoint whose shards are files",
                              {"file": clip(path), "problem": "not-a-file"})
        os.set_blocking(fd, True)
        if within:
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                real = os.path.realpath(path)
            for label, dirs in within:
                if not inside_any(real, dirs):
                    raise FileRefused(f"{clip(path)}: a link to a file outside {label}, which is not read; copy "
                                      f"the file itself into the checkpoint folder",
                                      {"file": clip(path), "problem": "outside"})
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_no_symlink_loop(path: str | Path, what: str = "folder") -> None:
    """Raises FileRefused when a symbolic link in `path` loops (the OS answers ELOOP, not 'no such file')."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FileRefused(f"{path}: symlink loop: a symbolic link on the way to the {what} points back into "
                              f"itself; fix or remove that link") from None


def folder_dirs(real: Path) -> list[Path]:
    """The folders a checkpoint's files may resolve into: the folder itself, and for a Hugging Face cache
    snapshot (models--OWNER--NAME/snapshots/REV, whose files link to ../../blobs) that repository's blobs."""
    dirs = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        dirs.append(real.parent.parent / "blobs")
    return dirs


def confinement(src: str | Path, roots: Sequence[str | Path] | None = None) -> Within:
    """Where a checkpoint's files may resolve: inside the folder (a hub cache snapshot's blobs included) and, when
    roots are given, inside one of them too."""
    within: list[tuple[str, Sequence[Path]]] = [("the checkpoint folder", folder_dirs(Path(os.path.realpath(src))))]
    if roots:
        within.append(("the allowed roots", [Path(os.path.realpath(r)) for r in roots]))
    return tuple(within)


def folder_files(folder: Path, within: Within, wanted: Callable[[str], bool] = lambda name: True) -> list[Path]:
    """The files directly in `folder` whose names are `wanted` (hidden ones and folders aside), each opened through
    open_confined: a symlink loop, a broken link or a link outside `within` is refused."""
    out = []
    try:
        names = sorted(folder.iterdir())
    except OSError as e:  # a folder that can be searched but not listed (mode 311): its config reads, this fails
        raise FileRefused(f"{clip(folder)}: cannot list the folder ({e.strerror or e}); make it readable or copy "
                          f"the checkpoint to a folder you can read", {"file": clip(folder), "problem": "unlistable"}
                          ) from None
    for p in names:
        if p.name.startswith(".") or not wanted(p.name) or not (p.is_symlink() or p.is_file()):
            continue
        if p.is_symlink() and p.is_dir():
            continue
        os.close(open_confined(p, within))
        out.append(p)
    return out


def check_folder_files(src: str | Path, roots: Sequence[str | Path] | None = None) -> None:
    """Every file a server would load from the checkpoint folder `src` (config, weights, tokenizer, templates)
    passes the checks a repack's reads apply; raises FileRefused naming the first that does not.

    For callers that hand the folder to another reader (vLLM): it follows links wherever they lead."""
    folder_files(Path(src), confinement(src, roots))


@dataclass(frozen=True)
class Roots:
    models: tuple[Path, ...] = field(default_factory=tuple)
    evidence: tuple[Path, ...] = field(default_factory=tuple)

    @classmethod
    def from_env(cls, models: list[str] | None = None, evidence: list[str] | None = None,
                 environ: dict[str, str] | None = None) -> "Roots":
        env = os.environ if environ is None else environ

        def pick(kind: Kind, given: list[str] | None) -> tuple[Path, ...]:
            raw = list(given or []) or [p for p in env.get(ENV[kind], "").split(os.pathsep) if p]
            if not raw:
                raw = [str(PROJECT_ROOT / kind)]
            return tuple(_resolve(p) for p in raw)

        return cls(models=pick("models", models), evidence=pick("evidence", evidence))

    def of(self, kind: Kind) -> tuple[Path, ...]:
        return self.models if kind == "models" else self.evidence

    def describe(self) -> dict[str, list[str]]:
        return {"models": [str(p) for p in self.models], "evidence": [str(p) for p in self.evidence]}

    def confine(self, path: str | Path, kind: Kind, *, must_exist: bool = False, what: str = "path") -> Path:
        """Resolve `path` and return it if it lies inside a `kind` root; raise PathNotAllowed otherwise.

        The message names the input as given (cut to SHOWN characters) and the roots, never where a symlink
        outside the roots points.
        """
        roots = self.of(kind)
        if not roots:
            raise PathNotAllowed(f"{what} {clip(path)}: no {kind} root is configured; start the server with "
                                 f"--{kind}-root DIR", what, path, "no-root")
        text = str(path).strip()
        if not text:
            raise PathNotAllowed(f"{what} is empty: give a path under {roots[0]}", what, text, "empty")
        if "\x00" in text:
            raise PathNotAllowed(f"{what} {clip(text)} contains a NUL character", what, text, "nul")
        _check_length(text, what)
        p = Path(text).expanduser()
        if not p.is_absolute():
            p = roots[0] / p
        try:
            resolved = _resolve(p)
        except (OSError, RuntimeError, ValueError):
            raise PathNotAllowed(f"{what} {clip(text)} cannot be resolved (a symlink loop?)", what, text,
                                 "unresolvable") from None
        if not inside_any(resolved, roots):
            allowed = ", ".join(str(r) for r in roots)
            raise PathNotAllowed(f"{what} {clip(text)} is outside the {kind} roots ({allowed}); use a path under "
                                 f"one of them or start the server with --{kind}-root", what, text, "outside-roots")
        if must_exist and not resolved.exists():
            raise PathNotAllowed(f"{what} {clip(text)} does not exist under the {kind} roots", what, text,
                                 "missing")
        return resolved

    def confine_model(self, model: str, *, what: str = "model", also_relative_to: tuple[Path, ...] = ()) -> str:
        """A model to serve: a local checkpoint folder under a models root, or a hub id passed through.

        A string of the hub-id form (`owner/name`) is a hub id only when it names no local folder: not under a
        models root (then it is that folder), and not relative to this process's working directory or to
        `also_relative_to` (where vLLM would look for it first) — such a folder outside the roots is refused.
        """
        text = model.strip()
        _check_length(text, what)
        if HUB_ID.match(text) and ".." not in text:
            for root in self.models:
                if (root / text).exists():
                    return str(self._checkpoint(self.confine(text if root == self.models[0] else root / text,
                                                             "models", must_exist=True, what=what), text, what))
            for base in (Path.cwd(), *also_relative_to):
                if (base / text).exists():
                    raise PathNotAllowed(f"{what} {clip(text)} names a local folder outside the models roots "
                                         f"({', '.join(map(str, self.models))}); give a folder under a models "
                                         f"root, or a hub id (owner/name) that is not a local path", what, text,
                                         "outside-roots")
            return text
        return str(self._checkpoint(self.confine(text, "models", must_exist=True, what=what), text, what))

    def _checkpoint(self, folder: Path, text: str, what: str) -> Path:
        """A model folder is a checkpoint (config.json), never a root itself, and its files pass the checks
        probe_checkpoint and repack_checkpoint make: vLLM follows a link in it wherever it leads."""
        if folder in self.models or not (folder / "config.json").is_file():
            raise PathNotAllowed(f"{what} {clip(text)} is not a checkpoint folder (no config.json, or a models "
                                 f"root itself); give the folder repack_checkpoint wrote", what, text,
                                 "not-a-checkpoint")
        try:
            check_folder_files(folder, self.models)
        except FileRefused as exc:
            raise PathNotAllowed(f"{what} {clip(text)}: {exc}", what, text, "links-out") from None
        return folder


__all__ = ["ENV", "HUB_ID", "NAME_MAX", "PATH_MAX", "FileRefused", "Kind", "PathNotAllowed", "Roots", "Within",
           "check_folder_files", "check_no_symlink_loop", "confinement", "folder_dirs", "folder_files", "inside",
           "inside_any", "open_confined", "open_error"]
