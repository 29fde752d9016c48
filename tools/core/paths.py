"""Confine the paths that the MCP tools read or write to configured roots.

An agent passes paths as strings; every one is resolved (symlinks followed, `..` collapsed) and must land inside
a root of the right kind: "models" (checkpoints read and written, served models) or "evidence" (sweep results,
token records, reports). Relative paths resolve against the first root of their kind. Anything else is refused
with a one-line error naming the path and the roots, so the agent can retry with an allowed path.

Roots come from `--models-root` / `--evidence-root` on the server command line, else from the environment
(`GEMMA4_T4_MODELS_ROOTS`, `GEMMA4_T4_EVIDENCE_ROOTS`, os.pathsep-separated), else the project's own
`models/` and `evidence/` folders.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tools.core.root import PROJECT_ROOT
from tools.core.text import clip

Kind = Literal["models", "evidence"]
ENV = {"models": "GEMMA4_T4_MODELS_ROOTS", "evidence": "GEMMA4_T4_EVIDENCE_ROOTS"}
# A Hugging Face hub id such as "google/gemma-4-E2B-it": served by vLLM from its cache, not a path we open.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# Longest file name and path Linux file systems take (ext4, xfs, tmpfs): longer ones fail every system call with
# ENAMETOOLONG, so they are refused here, naming the argument, rather than as an OSError from somewhere later.
NAME_MAX, PATH_MAX = 255, 4096



class PathNotAllowed(ValueError):
    """A path outside the configured roots (or otherwise unusable); the message says what to do, `detail` names
    the argument, the input (cut as in the message) and the problem for programs."""

    def __init__(self, message: str, what: str = "path", text: object = "", problem: str = "") -> None:
        super().__init__(message)
        self.detail = {"argument": what, "input": clip(text), "problem": problem}


def _check_length(text: str, what: str) -> None:
    longest = max((len(os.fsencode(part)) for part in Path(text).parts), default=0)
    if longest > NAME_MAX or len(os.fsencode(text)) >= PATH_MAX:
        raise PathNotAllowed(f"{what} {clip(text)} is too long for a path (a name of {longest} bytes, at most "
                             f"{NAME_MAX}; {len(os.fsencode(text))} bytes in all, at most {PATH_MAX - 1}): give a "
                             f"shorter one", what, text, "too-long")


def _resolve(p: str | Path) -> Path:
    return Path(os.path.realpath(Path(p).expanduser()))


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
        if not any(resolved == r or r in resolved.parents for r in roots):
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
        from repack.checkpoint import check_files
        from repack.errors import RepackError

        try:
            check_files(folder, self.models)
        except RepackError as exc:
            raise PathNotAllowed(f"{what} {clip(text)}: {exc}", what, text, "links-out") from None
        return folder
