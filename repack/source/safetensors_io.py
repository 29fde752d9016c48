"""Safetensors files read through memory maps and written by position, with no torch and no full-file loads.

Reading: the header is parsed and checked here (so a bad file gets a one-line error naming it), tensor bytes
are exposed as numpy views of a read-only memory map, and pages already processed are released with
``madvise(MADV_DONTNEED)`` so the resident set stays bounded whatever the checkpoint size.

Writing: the whole layout of an output shard (header, offsets) is known before any data is computed, so the
file is allocated up front (a full disk fails here, before the long part) and row blocks are written with
``os.pwrite`` at their final offsets, from several threads at once.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator


from tools.core import paths
from tools.core.paths import Within

from ..errors import RepackError, clip, core_refusals

if TYPE_CHECKING:
    import numpy as np

# safetensors dtype name -> (the numpy dtype that views its raw bytes, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "BF16": ("<u2", 2),  # bf16 is handled as raw 16-bit words
    "F16": ("<f2", 2),
    "F32": ("<f4", 4),
    "F64": ("<f8", 8),
    "I8": ("i1", 1),
    "U8": ("u1", 1),
    "I16": ("<i2", 2),
    "U16": ("<u2", 2),
    "I32": ("<i4", 4),
    "U32": ("<u4", 4),
    "I64": ("<i8", 8),
    "U64": ("<u8", 8),
    "BOOL": ("?", 1),
    "F8_E4M3": ("u1", 1),
    "F8_E5M2": ("u1", 1),
}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
PAGE = mmap.PAGESIZE


# The order safetensors' own writer lays tensors out in: larger element size first (its dtype enum order), then
# by name; with the header padded to 8 bytes every tensor then starts at a multiple of its element size.
_WRITE_RANK = {d: i for i, d in enumerate(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16",
                                           "I32", "U32", "F32", "F64", "I64", "U64"))}
MAX_JSON_DEPTH = 64  # the safetensors library's parser stops at 128; real headers and configs nest 4 deep


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a source file: where its bytes are and what they hold."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute offset of the first data byte in `file`
    nbytes: int
    ident: tuple[int, int, int] | None = field(default=None, compare=False)  # (device, inode, size) when read

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None
    data_start: int
    file_size: int
    ident: tuple[int, int, int] | None = None


def open_confined(path: Path, within: Within = ()) -> int:
    """tools.core.paths.open_confined, refusing with the library's error."""
    with core_refusals():
        return paths.open_confined(path, within)


def open_error(path: Path, e: OSError) -> RepackError:
    """The one-line message for a file that cannot be opened (a symlink loop is not "no such file")."""
    refused = paths.open_error(path, e)
    return RepackError(refused.message, refused.detail)


def loads_json(raw: bytes | str, what: str) -> Any:
    """json.loads for untrusted text: UTF-8 only, nesting limited (deep nesting would overflow the stack in the
    parser or in every later copy), errors as one RepackError line."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
        value = json.loads(text)
    except RecursionError:
        raise RepackError(f"{what}: nested too deeply to be valid; re-download it",
                          {"file": what, "problem": "too-deep"}) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RepackError(f"{what}: not valid JSON ({clip(e, 120)}); re-download it",
                          {"file": what, "problem": "bad-json"}) from None
    stack = [(value, 1)]
    while stack:  # iterative: a recursive walk would hit the very limit it checks
        v, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise RepackError(f"{what}: nested more than {MAX_JSON_DEPTH} levels deep; re-download it",
                              {"file": what, "problem": "too-deep"})
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)
    return value


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def read_header(path: str | Path, within: Within = ()) -> SafetensorsHeader:
    """Parses and checks one safetensors header as the format defines it; raises RepackError naming the file
    (and tensor) on anything the safetensors library would refuse, so a corrupt file never becomes a build.

    The rules: every entry has a known dtype, a shape of non-negative integers and two data offsets; dtype size
    times element count equals the offset span; sorted by offset (header order is free), the tensors run
    contiguously from 0 and end exactly at the end of the file, so none overlaps, none lies out of bounds and
    no byte is unaccounted for."""
    path = Path(path)
    p = clip(path)
    raw, size, ident = _read_raw_header(path, within)
    header = _parse_header(raw, p)
    data_start = 8 + len(raw)
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise RepackError(f"{p}: corrupt safetensors header (__metadata__ must map names to strings): "
                          f"re-download it", {"file": p, "problem": "bad-header"})
    tensors = {name: _tensor_entry(name, entry, path, data_start, size, ident) for name, entry in header.items()}
    _check_contiguous(tensors, p, data_start, size - data_start)
    return SafetensorsHeader(path, tensors, meta, data_start, size, ident)


def _read_raw_header(path: Path, within: Within) -> tuple[bytes, int, tuple[int, int, int]]:
    """The header's JSON bytes, the file size and the file's (device, inode, size)."""
    p = clip(path)
    fd = open_confined(path, within)
    try:
        st = os.fstat(fd)
        size = st.st_size
        with os.fdopen(fd, "rb", closefd=False) as f:
            head = f.read(8)
            if len(head) < 8:
                raise RepackError(f"{p}: truncated safetensors file ({size} bytes, no header): re-download it",
                                  {"file": p, "problem": "truncated"})
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise RepackError(f"{p}: corrupt or truncated safetensors header (says {n} bytes, file has "
                                  f"{size}): re-download it", {"file": p, "problem": "truncated"})
            raw = f.read(n)
    except OSError as e:
        raise open_error(path, e) from None
    finally:
        os.close(fd)
    return raw, size, (st.st_dev, st.st_ino, size)


def _parse_header(raw: bytes, p: str) -> dict[str, Any]:
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except RecursionError:
        raise RepackError(f"{p}: corrupt safetensors header (nested too deeply): re-download it",
                          {"file": p, "problem": "bad-header"}) from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RepackError(f"{p}: corrupt safetensors header ({clip(e, 120)}): re-download it",
                          {"file": p, "problem": "bad-header"}) from None
    return header


def _corrupt(p: str, name: str, why: str, code: str) -> RepackError:
    return RepackError(f"{p}: tensor {clip(name)} {why}: the file is corrupt, re-download it",
                       {"file": p, "tensor": clip(name), "problem": code})


def _tensor_entry(name: str, entry: Any, path: Path, data_start: int, size: int,
                  ident: tuple[int, int, int]) -> TensorInfo:
    """One header entry checked on its own: its fields, its dtype, its size and that it lies inside the file."""
    p = clip(path)
    if not isinstance(entry, dict):
        raise _corrupt(p, name, "has a corrupt header entry", "bad-entry")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(_uint(d) for d in shape) and isinstance(offsets, list)
            and len(offsets) == 2 and all(_uint(o) for o in offsets) and isinstance(dtype, str)):
        raise _corrupt(p, name, "has a corrupt header entry (dtype, shape and data_offsets must be a string, "
                                "non-negative integers and two offsets)", "bad-entry")
    if dtype not in DTYPES:
        raise RepackError(f"{p}: tensor {clip(name)} has unsupported dtype {clip(repr(dtype), 40)} "
                          f"(supported: {', '.join(DTYPES)})",
                          {"file": p, "tensor": clip(name), "problem": "dtype"})
    begin, end = offsets
    info = TensorInfo(name, dtype, tuple(shape), path, data_start + begin, end - begin, ident)
    if end < begin or info.numel * DTYPES[dtype][1] != end - begin:
        raise _corrupt(p, name, f"has inconsistent offsets {begin}..{end} for {dtype} {clip(shape, 80)}", "size")
    if end > size - data_start:
        raise RepackError(f"{p}: tensor {clip(name)} ends at byte {data_start + end}, past the end of the file "
                          f"({size} bytes): the file is truncated, re-download it",
                          {"file": p, "tensor": clip(name), "problem": "truncated"})
    return info


def _check_contiguous(tensors: dict[str, TensorInfo], p: str, data_start: int, data_len: int) -> None:
    """Sorted by offset, the tensors run contiguously from data byte 0 to the end of the file."""
    pos, last = 0, None
    for info in sorted(tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        begin = info.offset - data_start
        if begin < pos:
            raise _corrupt(p, info.name, f"overlaps tensor {clip(last, 100)} (bytes {begin}..{begin + info.nbytes} "
                                         f"of the data, which runs to {pos} before it)", "overlap")
        if begin > pos:
            raise _corrupt(p, info.name, f"starts at data byte {begin}, leaving {begin - pos} bytes unaccounted "
                                         f"for before it (tensors must be contiguous from byte 0)", "gap")
        pos, last = begin + info.nbytes, info.name
    if pos != data_len:
        after = f"after tensor {clip(last)}" if last is not None else "and no tensor"
        raise RepackError(f"{p}: {data_len - pos} trailing bytes {after} (the data must end at the end of the "
                          f"file): the file is corrupt, re-download it",
                          {"file": p, "tensor": clip(last) if last is not None else None, "problem": "trailing"})


class MappedFile:
    """A read-only memory map of one source file, shared by the worker threads.

    With `ident` (from the header read), a file replaced since then is refused rather than read with offsets
    that belong to another file."""

    def __init__(self, path: Path, ident: tuple[int, int, int] | None = None) -> None:
        self.path = path
        self._fd = open_confined(path)
        st = os.fstat(self._fd)
        size = st.st_size
        if ident is not None and (st.st_dev, st.st_ino, size) != ident:
            os.close(self._fd)
            raise RepackError(f"{clip(path)}: changed since its header was read (replaced or resized during the "
                              f"build); run the build again on a checkpoint nobody is modifying",
                              {"file": clip(path), "problem": "changed"})
        self._mm = mmap.mmap(self._fd, size, access=mmap.ACCESS_READ) if size else None
        self._lock = threading.Lock()

    def view(self, info: TensorInfo, start: int = 0, length: int | None = None) -> np.ndarray:
        """The bytes [start, start+length) of a tensor's data as a uint8 array (no copy)."""
        if length is None:
            length = info.nbytes - start
        import numpy as np  # only a build views tensors; the checks before it read headers alone

        return np.frombuffer(self._mm, dtype=np.uint8, count=length, offset=info.offset + start)

    def release(self, info: TensorInfo, start: int, length: int) -> None:
        """Drops the pages of a processed range from this process's resident set (they stay in page cache)."""
        if self._mm is None or not hasattr(self._mm, "madvise"):
            return
        a = info.offset + start
        lo = (a + PAGE - 1) // PAGE * PAGE
        hi = (a + length) // PAGE * PAGE
        if hi > lo:
            try:
                self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            except (OSError, ValueError):
                pass  # only a memory-use optimisation

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a view is still alive somewhere; the map goes when it does
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# ---------------------------------------------------------------------------------------------------------
# Writing


@dataclass
class OutTensor:
    """A tensor of an output shard: its final name, type, shape and (once laid out) absolute file offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int = -1


@dataclass
class OutShard:
    filename: str
    tensors: list[OutTensor] = field(default_factory=list)
    hardlink_from: Path | None = None  # an unchanged source shard reused as is
    size: int = 0

    def add(self, t: OutTensor) -> None:
        self.tensors.append(t)

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def layout(self, metadata: dict[str, str] | None = None) -> bytes:
        """Fixes every tensor's offset and returns the header bytes (length prefix included)."""
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = metadata
        pos = 0
        # The safetensors writer's order (widest dtype first, then name): with the 8-byte-aligned data start,
        # every tensor begins at a multiple of its element size, so it can be viewed in place without a copy.
        for t in sorted(self.tensors, key=lambda t: (-_WRITE_RANK[t.dtype], t.name)):
            header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [pos, pos + t.nbytes]}
            t.offset = pos
            pos += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        start = 8 + len(raw)
        for t in self.tensors:
            t.offset += start
        self.size = start + pos
        return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """An output shard opened for positional writes from any thread."""

    def __init__(self, path: Path, shard: OutShard, metadata: dict[str, str] | None) -> None:
        self.path = path
        head = shard.layout(metadata)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _allocate(self.fd, shard.size, path)
            self.pwrite(head, 0)
        except BaseException:
            os.close(self.fd)
            raise

    def pwrite(self, data: bytes | memoryview | np.ndarray, offset: int) -> None:
        buf = memoryview(data).cast("B") if not isinstance(data, bytes) else data
        total = len(buf)
        done = 0
        while done < total:
            try:
                n = os.pwrite(self.fd, buf[done:], offset + done)
            except OSError as e:
                raise WriteError(self.path, e) from None
            done += n

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _allocate(fd: int, size: int, path: Path) -> None:
    """Reserves the file's blocks now, so a full disk is found before the work rather than at the end."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
    except OSError as e:
        if e.errno in (95, 22):  # EOPNOTSUPP / EINVAL: the file system cannot preallocate
            os.ftruncate(fd, size)
        else:
            raise WriteError(path, e) from None


class WriteError(RepackError):
    """A failed write of an output file: `path` and the OSError's `errno` let a caller name the file as the user
    knows it (a build writes under a temporary folder name)."""

    def __init__(self, path: Path, e: OSError) -> None:
        self.path, self.errno = Path(path), e.errno
        if self.no_space:
            super().__init__(f"{path}: no space left on the device while writing the output; free some space or "
                             f"choose another output folder")
        else:
            super().__init__(f"{path}: write failed ({e.strerror or e})")

    @property
    def no_space(self) -> bool:
        return self.errno in (errno.ENOSPC, errno.EDQUOT)


def iter_blocks(total: int, block: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, block):
        yield start, min(block, total - start)
