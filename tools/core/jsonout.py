"""JSON as RFC 8259 allows it: a non-finite number (NaN, Infinity) has no JSON spelling, so it becomes null and
the object says which fields those were (`non_finite`), instead of Python's `Infinity` that strict parsers
refuse."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(data: Any, path: str = "", found: list[str] | None = None) -> Any:
    """`data` with every non-finite float replaced by None; the dotted paths replaced are appended to `found`."""
    if isinstance(data, float) and not math.isfinite(data):
        if found is not None:
            found.append(f"{path or '.'}={data}")
        return None
    if isinstance(data, dict):
        return {k: finite(v, f"{path}.{k}" if path else str(k), found) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite(v, f"{path}[{i}]", found) for i, v in enumerate(data)]
    return data


def dumps(data: Any, **kwargs: Any) -> str:
    """json.dumps that never writes NaN or Infinity: such values are null, and a top-level object lists them in
    `non_finite` (e.g. `["max_kld=inf"]`)."""
    found: list[str] = []
    clean = finite(json.loads(json.dumps(data, default=str)), found=found)
    if found and isinstance(clean, dict):
        clean["non_finite"] = found
    return json.dumps(clean, allow_nan=False, **kwargs)


def object_of(text: str | bytes) -> dict[str, Any]:
    """The JSON object `text` holds; {} when it holds none (not JSON, half written, or another kind of value)."""
    try:
        data = json.loads(text)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


__all__ = ["dumps", "finite", "object_of"]
