"""What a build scheme is: the interface every scheme module implements, and the report section it fills.

A scheme is a class (never instantiated, like compressed-tensors' compressors) with:

- ``name`` and ``tables``: its registry name and which tables of the build it quantizes itself; a table it does
  not take but the options ask to quantize (the int4 embeddings of a W8A8 build) goes to ``tables_via``;
- ``quantize_blocks`` / ``dequantize_blocks``: the numeric core, side by side, over ``(n_blocks, block_size)``
  arrays of bf16 words (as llama.cpp's gguf-py quants do);
- ``outputs`` / ``constants`` / ``quantize_rows``: the tensors it writes per module, and one row block of a
  source tensor turned into those tensors' rows plus statistics;
- ``decode``: the stored tensors of one module back to float64 values (what a loader computes);
- ``config_group``: its compressed-tensors ``config_groups`` entry for the tables it quantized;
- ``Stats`` (merged across row blocks and tensors), ``record`` and ``check_block``: its report columns and the
  stop it calls on a block it cannot encode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

from ..errors import unknown_scheme
from .report import RepackReport


class SchemeOptions(Protocol):
    """What a scheme reads of the build options (repack.params.BuildOptions): the target's arithmetic, the
    objective the scales are chosen by, the stored scale dtype and the other dtype's sample for the report."""

    target_dtype: str | None
    objective: str
    scale_dtype: str | None
    other_dtype_sample: int


def bf16_to_float(words: np.ndarray) -> np.ndarray:
    """Raw bf16 words (uint16) -> their exact float32 values."""
    return (words.astype(np.uint32) << 16).view(np.float32)


@dataclass(frozen=True)
class Output:
    """One tensor a scheme writes per quantized module: ``key`` addresses it inside the build, ``suffix`` is
    appended to the module name (``weight_packed``), rows of the source map to equal slices of its bytes."""

    key: str
    suffix: str
    dtype: str          # safetensors dtype
    shape: tuple[int, ...]
    nbytes: int


class SchemeStats(Protocol):
    def merge(self, other: Any) -> None: ...

    def columns(self) -> dict[str, Any]: ...


class Scheme:
    name: ClassVar[str]
    summary: ClassVar[str]                    # one line for --help and the report
    tables: ClassVar[frozenset[str]]          # the report tables this scheme quantizes itself
    tables_via: ClassVar[str | None] = None   # the scheme for requested tables it does not take
    Stats: ClassVar[type]                     # a SchemeStats: what record() merges and the report shows

    @classmethod
    def quantize_blocks(cls, words: np.ndarray, options: "SchemeOptions") -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    @classmethod
    def dequantize_blocks(cls, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def outputs(cls, rows: int, cols: int, options: "SchemeOptions") -> list[Output]:
        raise NotImplementedError

    @classmethod
    def constants(cls, rows: int, cols: int) -> dict[str, np.ndarray]:
        """Tensors fixed by the shape alone (written once per module, not per row block)."""
        return {}

    @classmethod
    def quantize_rows(cls, words: np.ndarray, options: "SchemeOptions", row0: int
                      ) -> tuple[dict[str, np.ndarray], Any]:
        """bf16 words [n, cols] (rows row0.. of a tensor) -> {output key: its n rows, little-endian}, stats."""
        raise NotImplementedError

    @classmethod
    def decode(cls, tensors: dict[str, np.ndarray]) -> np.ndarray:
        """{suffix: stored array} of one module -> float64 weight [out, in]."""
        raise NotImplementedError

    @classmethod
    def config_group(cls, tables: list[str]) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def record(cls, report: "SchemeReport", table: str, stats: Any) -> None:
        """Adds a block's stats to `table`'s figures in the report (a section of the scheme's own columns)."""
        per = report.scheme_tables.setdefault(cls.name, {})
        if table not in per:
            per[table] = cls.Stats()
        per[table].merge(stats)

    @classmethod
    def check_block(cls, stats: Any, tensor: str, options: "SchemeOptions") -> None:
        """Raises the library's error when a block could not be encoded faithfully (nothing by default)."""


@dataclass
class ErrorStats:
    """Error of the decoded weights against the source values: the figures of a scheme whose values are not
    expected to be reproduced exactly. Sums are kept per block and added with fsum, so the report does not depend
    on the order the worker threads finish in."""

    values: int = 0
    nonfinite: int = 0          # NaN/inf source values: stored as 0, left out of the error sums
    max_abs_error: float = 0.0
    sq_err: list[float] = field(default_factory=list)
    sq_ref: list[float] = field(default_factory=list)
    first_nonfinite: tuple[int, int] | None = None  # (row, column) of the first NaN/inf source value

    @classmethod
    def of(cls, ref: np.ndarray, decoded: np.ndarray, row0: int = 0) -> "ErrorStats":
        finite = np.isfinite(ref)
        nonfinite = int(ref.size - np.count_nonzero(finite))
        first = None
        if nonfinite:
            r, c = np.argwhere(~finite)[0]
            first = (row0 + int(r), int(c))
            ref, decoded = np.where(finite, ref, 0.0), np.where(finite, decoded, 0.0)
        r = ref.astype(np.float64, copy=False).ravel()
        err = decoded.ravel() - r
        return cls(values=ref.size, nonfinite=nonfinite, first_nonfinite=first,
                   max_abs_error=float(max(err.max(initial=0.0), -err.min(initial=0.0))),
                   sq_err=[float(np.dot(err, err))], sq_ref=[float(np.dot(r, r))])

    def merge(self, o: "ErrorStats") -> None:
        if self.first_nonfinite is None:
            self.first_nonfinite = o.first_nonfinite
        self.values += o.values
        self.nonfinite += o.nonfinite
        self.max_abs_error = max(self.max_abs_error, o.max_abs_error)
        self.sq_err += o.sq_err
        self.sq_ref += o.sq_ref

    @property
    def rel_l2(self) -> float | None:
        ref = math.fsum(self.sq_ref)
        return math.sqrt(math.fsum(self.sq_err) / ref) if ref > 0 else None

    @property
    def snr_db(self) -> float | None:
        err, ref = math.fsum(self.sq_err), math.fsum(self.sq_ref)
        if ref <= 0:
            return None
        return math.inf if err == 0 else 10 * math.log10(ref / err)

    def columns(self) -> dict[str, Any]:
        snr = self.snr_db
        return {"values": self.values, "nonfinite_values": self.nonfinite,
                "max_abs_error": float(f"{self.max_abs_error:.6g}"),
                "rel_l2_error": None if self.rel_l2 is None else float(f"{self.rel_l2:.6g}"),
                "snr_db": None if snr is None or math.isinf(snr) else round(snr, 3)}


@dataclass
class SchemeReport(RepackReport):
    """The repack report plus the build scheme and, for schemes with figures of their own, a section per scheme
    with one row per table it quantized (the grid's exactness columns stay where they were)."""

    scheme: str = ""
    scheme_tables: dict[str, dict[str, Any]] = field(default_factory=dict)  # scheme -> table -> its Stats

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["scheme"] = self.scheme
        d["scheme_tables"] = {s: [{"name": t, **st.columns()} for t, st in tables.items()]
                              for s, tables in self.scheme_tables.items()}
        return d

    def format_table(self) -> str:
        lines = [super().format_table()]
        for s, tables in self.scheme_tables.items():
            rows = [{"table": t, **st.columns()} for t, st in tables.items()]
            if not rows:
                continue
            keys = list(rows[0])
            cells = [[_cell(r[k]) for k in keys] for r in rows]
            widths = [max(len(k), *(len(c[i]) for c in cells)) + 2 for i, k in enumerate(keys)]
            head = "".join(k.ljust(widths[0]) if i == 0 else k.rjust(widths[i]) for i, k in enumerate(keys))
            lines += ["", f"{s}: {_summary(s)}", head, "-" * len(head)]
            lines += ["".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row))
                      for row in cells]
            for r in rows:
                if r.get("nonfinite_values"):
                    lines.append(f"warning: {r['table']}: {r['nonfinite_values']:,} NaN/inf source values stored as 0")
        return "\n".join(lines)


def _summary(name: str) -> str:
    return get(name).summary


# -- the registry (filled by the package, which imports every scheme module) ------------------------------------

REGISTRY: dict[str, type[Scheme]] = {}


def register(cls: type[Scheme]) -> type[Scheme]:
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise ValueError(f"two build schemes are named {cls.name!r}")
    REGISTRY[cls.name] = cls
    return cls


def names() -> list[str]:
    return sorted(REGISTRY)


def get(name: str) -> type[Scheme]:
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise unknown_scheme(name, names()) from None


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


__all__ = ["REGISTRY", "ErrorStats", "Output", "Scheme", "SchemeOptions", "SchemeReport", "SchemeStats",
           "bf16_to_float", "get", "names", "register"]
