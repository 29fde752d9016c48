"""The machine as the serving tools see it (platform, compute capability, VRAM, host memory, cores), behind one
`Hardware` object so tests can stand in a T4."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import psutil

from tools.gpu import vram
from tools.serving.config import Platform


@dataclass
class Vram:
    used_mib: int
    total_mib: int
    utilization_pct: int | None = None
    process_mib: int | None = None  # what the server's process group holds, when NVML says

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Hardware:
    """The machine as the serving tools see it. Subclass and override to simulate a GPU in tests.

    GPUs are read through tools.gpu.vram, the project's one NVML reader, over every GPU the driver lists.
    """

    def platform(self) -> Platform:
        return "cuda" if self._capabilities() else "cpu"

    def compute_capability(self) -> tuple[int, int] | None:
        """The oldest GPU's: it decides whether the Turing attention clamp is needed."""
        caps = self._capabilities()
        return min(caps) if caps else None

    def vram(self, pids: list[int]) -> Vram | None:
        st = vram.vram_status(server_pids=set(pids))
        if not st.available or not st.gpus:
            return None
        utils = [g.utilization_gpu_pct for g in st.gpus if g.utilization_gpu_pct is not None]
        # vLLM's memory belongs to its engine subprocess, not the API server: the whole group is counted.
        return Vram(used_mib=sum(g.used_mib for g in st.gpus), total_mib=sum(g.total_mib for g in st.gpus),
                    utilization_pct=max(utils) if utils else None, process_mib=st.server_used_mib)

    def host_memory(self) -> tuple[int, int]:
        """(RAM bytes, swap bytes enabled)."""
        return int(psutil.virtual_memory().total), int(psutil.swap_memory().total)

    def gpu_count(self) -> int:
        """GPUs NVML lists (0 without a driver); a platform that reports CUDA has at least one."""
        return len(self._capabilities()) or (1 if self.platform() == "cuda" else 0)

    def cpu_cores(self) -> list[int]:
        """The cores this process may run on: what instances are bound to."""
        try:
            return sorted(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return list(range(os.cpu_count() or 1))

    _caps: list[tuple[int, int]] | None = None

    def _capabilities(self) -> list[tuple[int, int]]:
        if self._caps is None:
            self._caps = vram.compute_capabilities()
        return self._caps


__all__ = ["Hardware", "Vram"]
