"""Swap for hosts with less RAM than the checkpoint (the article's 7.8 GB VM loads a 10.2 GB file with 16 GiB swap).

`ensure_swap` creates and enables the configured swapfile when it is not on (root needed; idempotent);
`swap_report` says what is on. Nothing here enables swap implicitly: `start` only refuses and points here.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tools.serving.config import ServeConfig
from tools.core.errors import ToolFailure

PROC_SWAPS = Path("/proc/swaps")


@dataclass
class SwapArea:
    path: str
    kind: str
    size_kib: int
    used_kib: int


@dataclass
class SwapReport:
    total_bytes: int
    used_bytes: int
    ram_bytes: int
    areas: list[SwapArea] = field(default_factory=list)
    configured: str = ""
    configured_active: bool = False
    action: str = "none"            # none | created | enabled
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def active_areas(proc_swaps: Path = PROC_SWAPS) -> list[SwapArea]:
    """The swap areas the kernel has on (/proc/swaps)."""
    try:
        lines = proc_swaps.read_text().splitlines()[1:]
    except OSError:
        return []
    areas = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 4:
            areas.append(SwapArea(path=parts[0].replace("\\040", " "), kind=parts[1], size_kib=int(parts[2]),
                                  used_kib=int(parts[3])))
    return areas


def swap_report(cfg: ServeConfig, *, proc_swaps: Path = PROC_SWAPS, action: str = "none") -> SwapReport:
    areas = active_areas(proc_swaps)
    sm = psutil.swap_memory()
    target = os.path.realpath(cfg.swapfile)
    active = any(os.path.realpath(a.path) == target for a in areas)
    total = sum(a.size_kib for a in areas) * 1024 if areas else int(sm.total)
    msg = (f"swap on: {total / 2**30:.1f} GiB in {len(areas)} area(s)" if total
           else "no swap is on")
    msg += f"; {cfg.swapfile} is {'on' if active else 'not on'}"
    return SwapReport(total_bytes=total, used_bytes=int(sm.used), ram_bytes=int(psutil.virtual_memory().total),
                      areas=areas, configured=cfg.swapfile, configured_active=active, action=action, message=msg)


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True)
    if r.returncode != 0:
        raise ToolFailure(f"{' '.join(argv)} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")


def ensure_swap(cfg: ServeConfig, *, proc_swaps: Path = PROC_SWAPS) -> SwapReport:
    """Creates (when missing) and enables `cfg.swapfile` of `cfg.swap_size_gib` GiB. Idempotent; needs root."""
    report = swap_report(cfg, proc_swaps=proc_swaps)
    if report.configured_active:
        return report
    if os.geteuid() != 0:
        raise ToolFailure(f"enabling swap needs root: run `sudo ./vllm-t4 swap` (creates {cfg.swapfile}, "
                          f"{cfg.swap_size_gib} GiB)")
    path = Path(cfg.swapfile)
    action = "enabled"
    if not path.exists():
        if not path.parent.is_dir():
            raise ToolFailure(f"folder {path.parent} of SWAPFILE does not exist; set SWAPFILE in tpu.env")
        free = psutil.disk_usage(str(path.parent)).free
        need = cfg.swap_size_gib * 2**30
        if free < need:
            raise ToolFailure(f"{path.parent} has {free / 2**30:.1f} GiB free, SWAP_SIZE_GIB={cfg.swap_size_gib} "
                              "needs more; free space or set SWAPFILE/SWAP_SIZE_GIB in tpu.env")
        try:
            # fallocate is instant; dd is the fallback for filesystems whose swap rejects preallocated extents.
            try:
                _run(["fallocate", "-l", f"{cfg.swap_size_gib}G", str(path)])
            except (ToolFailure, FileNotFoundError):
                path.unlink(missing_ok=True)
                _run(["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={cfg.swap_size_gib * 1024}"])
            os.chmod(path, 0o600)
            _run(["mkswap", str(path)])
        except BaseException:
            path.unlink(missing_ok=True)  # nothing half written
            raise
        action = "created"
    _run(["swapon", str(path)])
    return swap_report(cfg, proc_swaps=proc_swaps, action=action)
