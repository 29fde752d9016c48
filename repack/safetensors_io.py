"""Safetensors files read through memory maps and written by position, with no torch and no full-file loads.

Reading: the header is parsed and checked here (so a bad file gets a one-line error naming it), tensor bytes
are exposed as numpy views of a read-only memory map, and pages already processed are released with
``madvise(MADV_DONTNEED)`` so the resident set stays bounded whatever the checkpoint size.

Writing: the whole layout of an output shard (header, offsets) is known before any data is computed, so the
file is allocated up front (a full disk fails here, before the long part) and row blocks are written with
``os.pwrite`` at their final offsets, from several threads at once.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import RepackError

# safetensors dtype name -> (numpy dtype used to view the raw bytes, bytes per element)
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "BF16": (np.dtype("<u2"), 2),  # bf16 is handled as raw 16-bit words
    "F16": (np.dtype("<f2"), 2),
    "F32": (np.dtype("<f4"), 4),
    "F64": (np.dtype("<f8"), 8),
    "I8": (np.dtype("i1"), 1),
    "U8": (np.dtype("u1"), 1),
    "I16": (np.dtype("<i2"), 2),
    "U16": (np.dtype("<u2"), 2),
    "I32": (np.dtype("<i4"), 4),
    "U32": (np.dtype("<u4"), 4),
    "I64": (np.dtype("<i8"), 8),
    "U64": (np.dtype("<u8"), 8),
    "BOOL": (np.dtype("?"), 1),
    "F8_E4M3": (np.dtype("u1"), 1),
    "F8_E5M2": (np.dtype("u1"), 1),
}
NUMPY_TO_ST = {np.dtype("<f2"): "F16", np.dtype("<i4"): "I32", np.dtype("<i8"): "I64", np.dtype("<u2"): "BF16",
               np.dtype("<f4"): "F32"}
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a source file: where its bytes are and what they hold."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute offset of the first data byte in `file`
    nbytes: int

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


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parses and checks one safetensors header; raises RepackError naming the file on anything wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise RepackError(f"{path}: truncated safetensors file ({size} bytes, no header): re-download it")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise RepackError(f"{path}: corrupt or truncated safetensors header (says {n} bytes, file has "
                                  f"{size}): re-download it")
            raw = f.read(n)
    except OSError as e:
        raise RepackError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (ValueError, UnicodeDecodeError) as e:
        raise RepackError(f"{path}: corrupt safetensors header ({e}): re-download it") from None
    data_start = 8 + n
    data_len = size - data_start
    meta = header.pop("__metadata__", None)
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(int(d) for d in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError):
            raise RepackError(f"{path}: corrupt safetensors header entry for tensor {name}: re-download it") from None
        if dtype not in DTYPES:
            raise RepackError(f"{path}: tensor {name} has unsupported dtype {dtype!r} "
                              f"(supported: {', '.join(DTYPES)})")
        info = TensorInfo(name, dtype, shape, path, data_start + begin, end - begin)
        if any(d < 0 for d in shape) or begin < 0 or end < begin or info.numel * DTYPES[dtype][1] != end - begin:
            raise RepackError(f"{path}: tensor {name} has inconsistent offsets {begin}..{end} for {dtype} "
                              f"{list(shape)}: the file is corrupt, re-download it")
        if end > data_len:
            raise RepackError(f"{path}: tensor {name} ends at byte {data_start + end}, past the end of the file "
                              f"({size} bytes): the file is truncated, re-download it")
        tensors[name] = info
    return SafetensorsHeader(path, tensors, meta, data_start, size)


class MappedFile:
    """A read-only memory map of one source file, shared by the worker threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        self._mm = mmap.mmap(self._fd, size, access=mmap.ACCESS_READ) if size else None
        self._lock = threading.Lock()

    def view(self, info: TensorInfo, start: int = 0, length: int | None = None) -> np.ndarray:
        """The bytes [start, start+length) of a tensor's data as a uint8 array (no copy)."""
        if length is None:
            length = info.nbytes - start
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
        # Names sorted, as the safetensors library writes them; offsets contiguous from zero.
        for t in sorted(self.tensors, key=lambda t: t.name):
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
                raise write_error(self.path, e) from None
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
            raise write_error(path, e) from None


def write_error(path: Path, e: OSError) -> RepackError:
    import errno

    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RepackError(f"{path}: no space left on the device while writing the output; free some space "
                           f"or choose another output folder")
    return RepackError(f"{path}: write failed ({e.strerror or e})")


def iter_blocks(total: int, block: int) -> Iterator[tuple[int, int]]:
    for start in range(0, total, block):
        yield start, min(block, total - start)
