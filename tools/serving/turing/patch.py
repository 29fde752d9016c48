"""The Turing clamp for vLLM's Triton unified attention (Tesla T4, compute capability 7.5).

Gemma 4's 512-wide attention heads make `kernel_unified_attention` ask for up to 96 KiB of shared memory
against Turing's 64 KiB ("out of resource: shared memory, Required: 98304, Hardware limit: 65536"). The clamp
goes right after vLLM's tile-size decision (found by what the code does: tools.serving.turing.decision): on a
device of capability < 8, halve each decided TILE_SIZE, whatever the decision returned (32, 64, ...; never below
16), while (BLOCK_M + 2*TILE) * head_size * element_size exceeds SHARED_BYTES, and launch with num_stages=1.
Devices of capability >= 8 run the file's original code path.

When the decision itself already fits Turing at head 512 (an upstream fix such as vLLM PR #39018), the clamp is
not needed and nothing is written. A file without a decision the clamp understands is refused, untouched (by
check too: such a file is not "not applied", it is one the clamp cannot go in).
The original file is backed up next to it, with a record of its hash and of the patched file's: revert restores
the backup only to exactly that patched file, and otherwise removes the marked block (an upgraded vLLM's code is
never replaced by an older backup). Applying twice, checking and reverting are safe, at once too: apply and revert
hold a lock beside the file (its name + LOCK_SUFFIX, removed on release) from their read to their last write, and
the backup is the very bytes the patch was made from, so a second apply never backs up the first one's output.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import stat
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from tools.core.atomic_files import write_file
from tools.core.errors import BadInput, ToolFailure, op, param
from tools.serving.records.files import flocked, read_small
from tools.serving.turing.decision import (ClampRefused, Decision, DecisionNotRun, decided_tiles_bounded,
                                           find_decision)

RELATIVE_PATH = Path("v1/attention/ops/triton_unified_attention.py")
BEGIN_MARK = "# >>> gemma4-t4 turing clamp (patch_triton_turing.py) >>>"
END_MARK = "# <<< gemma4-t4 turing clamp <<<"
BACKUP_SUFFIX = ".gemma4-t4.orig"
RECORD_SUFFIX = ".gemma4-t4.orig.json"
LOCK_SUFFIX = ".gemma4-t4.lock"
LOCK_WAIT_S = 120.0  # an apply takes well under a second; a holder this long is stuck
MIN_TILE = 16
# Turing's 65536 bytes per block, less headroom for what else the kernel keeps in shared memory.
SHARED_BYTES = 60000
TURING_SHARED = 65536
GEMMA4_HEAD = 512  # Gemma 4's global attention layers
BLOCK_M = 16  # vLLM's BLOCK_M for up to 16 query heads per KV head (Gemma 4 E2B: 8)


@dataclass
class PatchStatus:
    target: str
    applied: bool
    backup: str | None
    message: str
    needed: bool = True  # False: this vLLM's own tile decision already fits Turing's shared memory

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shared_bytes(tile: int, head_size: int, element_size: int, block_m: int = BLOCK_M) -> int:
    """The clamp's estimate of a launch's shared memory: the Q block and one K and one V tile."""
    return (block_m + 2 * tile) * head_size * element_size


def clamp_block(d: Decision) -> str:
    i = d.indent
    rows = [BEGIN_MARK,
            "# Turing (sm_7x) has 64 KiB of shared memory per block; head_size 512 tiles need up to 96 KiB.",
            "_gemma4_t4_cap = current_platform.get_device_capability()",
            "if _gemma4_t4_cap is not None and _gemma4_t4_cap.major < 8:",
            f"    _gemma4_t4_elem = {d.element}"]
    for t in d.tiles:
        rows += [f"    while {t} > {MIN_TILE} and ({d.block_m} + 2 * {t}) * {d.head} * _gemma4_t4_elem > {SHARED_BYTES}:",
                 f"        {t} //= 2"]
    rows += [f"    {d.stages} = 1", END_MARK]
    return "".join(f"{i}{r}\n" for r in rows)


def patched_text(text: str, d: Decision) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(lines[:d.after_line]) + clamp_block(d) + "".join(lines[d.after_line:])


def installed_target() -> Path:
    """The file in the vLLM this interpreter imports (found without importing vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise ToolFailure("vLLM is not installed in this Python; run ./setup.sh, or pass --target FILE")
    return Path(list(spec.submodule_search_locations)[0]) / RELATIVE_PATH


def _target(target: str | Path | None) -> Path:
    if target == "":  # Path("") is ".", which would be answered as a directory the caller never named
        raise BadInput(f"the {param('target')} given is empty: give the Triton unified attention file to patch, or "
                       "none for the installed vLLM's", field="target")
    path = Path(target) if target is not None else installed_target()
    for suffix in (BACKUP_SUFFIX, RECORD_SUFFIX):  # the patch's own files beside a target: never targets
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            original = path.with_name(path.name[:-len(suffix)])
            raise BadInput(f"{path} is the patch's {'backup' if suffix == BACKUP_SUFFIX else 'record'} of "
                           f"{original}, not a file to patch: pass {param('target', str(original))}",
                           field="target")
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(f"{path} is a symbolic link loop, not a file: give the Python file to patch") from None
        if exc.errno != errno.ENOENT:
            raise BadInput(f"{path} cannot be read ({exc.strerror}): give a readable Python file") from None
        what = "a broken symbolic link" if path.is_symlink() else "does not exist"
        if target is not None:  # the caller's --target: theirs to fix
            raise BadInput(f"{path} {what}: give the Triton unified attention file to patch") from None
        raise ToolFailure(f"{path} {what}; this vLLM has no Triton unified attention to patch") from None
    if not stat.S_ISREG(mode):
        what = ("a directory" if stat.S_ISDIR(mode) else "a named pipe (fifo)" if stat.S_ISFIFO(mode)
                else "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        raise BadInput(f"{path} is {what}, not a file: give the Python file to patch")
    if path.is_symlink():
        # The patch is written by replacing the file (never half written): through a link, that replaces the link
        # with a patched copy and leaves the file vLLM imports, and its backup and lock, elsewhere. Refused, so
        # the file itself is named.
        resolved = path.resolve()
        why = f"{path} is a symbolic link to {resolved}, which the patch would leave unpatched"
        if target is not None:
            raise BadInput(f"{why}: pass {param('target', str(resolved))} instead", field="target")
        raise ToolFailure(f"{why}: run {op('patch_turing', target=str(resolved))}")
    return path


def _read_bytes(path: Path) -> tuple[bytes, str]:
    """The module's bytes and their text, from one read; a file that is not UTF-8 (or cannot be read) is refused
    before anything is written."""
    try:
        data = path.read_bytes()
        return data, data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path} is not UTF-8 text (byte {exc.start}): not a Python module vLLM ships; "
                       "give the Triton unified attention file") from None
    except OSError as exc:
        raise BadInput(f"{path} cannot be read ({exc.strerror}): give a readable Python file") from None


def _read(path: Path) -> str:
    return _read_bytes(path)[1]


# The machine's, not the target's: the same folder takes the lock once space or the disk is back.
_MACHINE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.ENOMEM)


def _lock_refused(path: Path, lock: Path, exc: OSError) -> ToolFailure:
    """One line naming the target (the lock is only where it failed): its folder takes no lock file, which a folder
    of an installed vLLM does (ENOENT under /proc, a name too long once LOCK_SUFFIX is added, ...)."""
    why = f"{lock.name}: {exc.strerror or exc}"
    if exc.errno in _MACHINE_ERRNOS:
        return ToolFailure(f"{path}: its lock cannot be made beside it ({why}); free space or fix the disk, "
                           "then run this again")
    return BadInput(f"{path}: its lock cannot be made beside it ({why}): not a file of vLLM's this can patch; "
                    "give the Triton unified attention file")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Holds the patch's lock beside `path` (waiting up to LOCK_WAIT_S for another apply or revert); the lock file
    is removed on release, so the folder is left as it was found."""
    lock = path.with_name(path.name + LOCK_SUFFIX)
    deadline = time.monotonic() + LOCK_WAIT_S
    try:
        while (fh := flocked(lock)) is None:
            if time.monotonic() > deadline:
                raise ToolFailure(f"{lock} has been held by another patch_triton_turing.py for over "
                                  f"{LOCK_WAIT_S:.0f} s; let it finish, or end it, then run this again")
            time.sleep(0.05)
    except OSError as exc:
        if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise _lock_refused(path, lock, exc) from None
        fh = None  # a folder this user cannot write: what needs no write (not needed, not patched) still answers
    try:
        yield
    finally:
        if fh is not None:
            lock.unlink(missing_ok=True)  # still held: a waiter that opened it opens the new one (flocked)
            fh.close()


def _backup(path: Path) -> Path:
    return path.with_name(path.name + BACKUP_SUFFIX)


def _record(path: Path) -> Path:
    """The backup's record: its hash and the hash of the patched file made from it."""
    return path.with_name(path.name + RECORD_SUFFIX)


def _marked(text: str) -> tuple[int, int] | None:
    """Line indexes of the one BEGIN and the END after it; None when there is no clamp; ValueError when damaged."""
    lines = [ln.strip() for ln in text.splitlines()]
    begins = [i for i, ln in enumerate(lines) if ln == BEGIN_MARK]
    ends = [i for i, ln in enumerate(lines) if ln == END_MARK]
    if not begins and not ends:
        return None
    if len(begins) != 1 or len(ends) != 1 or ends[0] < begins[0]:
        raise ValueError("damaged markers")
    return begins[0], ends[0]


def _without_clamp(text: str) -> str | None:
    """The text with the marked block removed; None when the markers are damaged."""
    try:
        marks = _marked(text)
    except ValueError:
        return None
    if marks is None:
        return text
    lines = text.splitlines(keepends=True)
    return "".join(lines[:marks[0]] + lines[marks[1] + 1:])


def needed(text: str, d: Decision) -> tuple[bool, list[int] | None, str | None]:
    """Whether the decision, run on a stand-in Turing device at head 512 (in a child process, bounded), picks tiles
    that overflow its shared memory. A decision that cannot be run to an answer counts as needing the clamp (it
    only acts when over); the third value then says why, in a few words."""
    try:
        tiles = decided_tiles_bounded(text, d.decision, GEMMA4_HEAD, 2, TURING_SHARED)
    except DecisionNotRun as exc:
        return True, None, str(exc)
    return any(shared_bytes(t, GEMMA4_HEAD, 2) > SHARED_BYTES for t in tiles), tiles, None


def _untested(why: str | None) -> str:
    return f" (its tile decision could not be tried on a stand-in Turing device: {why})" if why else ""


def _not_needed(path: Path, d: Decision, tiles: list[int] | None) -> PatchStatus:
    return PatchStatus(str(path), False, None, needed=False,
                       message=f"Turing clamp not needed in {path}: {d.decision} already picks tiles "
                               f"{'/'.join(map(str, tiles or []))} at head {GEMMA4_HEAD} on compute capability 7.5, "
                               "within its shared memory")


def check(target: str | Path | None = None) -> PatchStatus:
    path = _target(target)
    text = _read(path)
    backup = _backup(path)
    kept = str(backup) if backup.exists() else None
    original = _without_clamp(text)
    if original is None or original != text:
        try:
            applied = original is not None and patched_text(original, find_decision(original, path)) == text
        except ClampRefused:
            applied = False
        if applied:
            return PatchStatus(str(path), True, kept, f"Turing clamp applied in {path}")
        return PatchStatus(str(path), False, kept,
                           f"{path} holds a modified or partial Turing clamp; run --revert, then apply again")
    d = find_decision(text, path)  # ClampRefused: refused as apply refuses it, not "not applied"
    need, tiles, why = needed(text, d)
    if not need:
        return _not_needed(path, d, tiles)
    return PatchStatus(str(path), False, None, f"Turing clamp not applied in {path}{_untested(why)}")


def _write(path: Path, data: str | bytes, mode: int) -> None:
    write_file(path, data)  # never a half-written module
    os.chmod(path, mode)


def _sha256(data: str | bytes) -> str:
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


def _drop(*paths: Path) -> None:
    for p in paths:
        if os.path.lexists(p):  # unlinking a missing file on a read-only file system says EROFS, not ENOENT
            p.unlink(missing_ok=True)


def apply(target: str | Path | None = None) -> PatchStatus:
    path = _target(target)
    with _locked(path):
        return _apply(path)


def _apply(path: Path) -> PatchStatus:
    original, text = _read_bytes(path)
    if _without_clamp(text) != text:
        status = check(path)
        if status.applied:
            return status
        raise BadInput(f"{path} holds a modified or partial Turing clamp; run --revert first")
    d = find_decision(text, path)  # ClampRefused: one line, nothing written
    need, tiles, why = needed(text, d)
    if not need:
        return _not_needed(path, d, tiles)
    backup, record = _backup(path), _record(path)
    mode = path.stat().st_mode & 0o7777
    patched = patched_text(text, d)
    # The backup is the bytes the patch is made from (read once, under the lock), never a second read.
    # Always this file's own backup: one kept from an earlier vLLM would bring that vLLM's code back on revert.
    # The record ties it to the patched file it becomes: revert trusts the backup only for exactly that file.
    _write(backup, original, mode)
    _write(record, json.dumps({"target": path.name, "backup_sha256": _sha256(original),
                               "patched_sha256": _sha256(patched)}, indent=1) + "\n", 0o644)
    _write(path, patched, mode)
    if not check(path).applied:  # pragma: no cover - guards against a broken clamp_block
        raise ToolFailure(f"{path}: the clamp was written but does not verify; restore {backup}")
    return PatchStatus(str(path), True, str(backup),
                       f"Turing clamp applied to {path} after {d.decision} sets {', '.join(d.tiles)} "
                       f"(original: {backup}){_untested(why)}")


def _untrusted(text: str, backup: Path, record: Path) -> str | None:
    """None when the backup is the original of exactly this patched text; else why it is not to be restored."""
    if not backup.is_file():
        return "there is no backup"
    try:
        text_of_record = read_small(record)  # never a link, a FIFO (which would hang) or /dev/zero read whole
        if text_of_record is None:
            raise ValueError("not a regular file of a record's size")
        rec = json.loads(text_of_record)
        recorded = (rec["backup_sha256"], rec["patched_sha256"])
    except (OSError, ValueError, TypeError, KeyError):
        return f"its record {record.name} is missing or damaged"
    try:
        data = backup.read_bytes()
    except OSError as exc:
        return f"it cannot be read ({exc.strerror})"
    if _sha256(data) != recorded[0]:
        return "it is not the file that was backed up (its hash differs from the record's)"
    if _without_clamp(data.decode("utf-8", errors="replace")) != data.decode("utf-8", errors="replace"):
        return "it holds the clamp itself (not the original)"
    if _sha256(text) != recorded[1]:
        return "this file is not the one patched from it (changed or upgraded since)"
    return None


def revert(target: str | Path | None = None) -> PatchStatus:
    path = _target(target)
    with _locked(path):
        return _revert(path)


def _revert(path: Path) -> PatchStatus:
    text = _read(path)
    backup, record = _backup(path), _record(path)
    mode = path.stat().st_mode & 0o7777
    if BEGIN_MARK not in text and END_MARK not in text:
        find_decision(text, path)  # ClampRefused: no attention module, nothing beside it touched (as apply)
        _drop(backup, record)
        return PatchStatus(str(path), False, None, f"{path} is not patched; nothing to revert")
    why = _untrusted(text, backup, record)
    if why is None:
        _write(path, backup.read_bytes(), mode)
        _drop(backup, record)
        return PatchStatus(str(path), False, None, f"restored {path} from its backup")
    original = _without_clamp(text)
    if original is None:
        raise BadInput(f"{path}: the clamp markers are damaged and its backup cannot be used ({why}); "
                       "reinstall vLLM")
    _write(path, original, mode)
    unused = f"; its backup {backup} was not used ({why}) and is removed" if backup.exists() else ""
    _drop(backup, record)
    return PatchStatus(str(path), False, None, f"removed the Turing clamp from {path}{unused}")
