"""GPU memory through NVML: per GPU and per process, marking the processes of the vLLM server we started; and
the host memory of a server's processes (`host_memory`), which is where the weights live on vLLM's CPU backend.

NVML comes from the `pynvml` module of the `nvidia-ml-py` package. On a machine without an NVIDIA driver
(development boxes, CI, vLLM's CPU backend) `vram_status()` returns a result that says so instead of raising,
so callers can always show it.

vLLM's GPU memory belongs to its engine-core child process, not to the API server pid that the state file
records: the server is therefore identified by its whole process tree and process group (`server_pids`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

MIB = 1024 * 1024


class GpuProcess(BaseModel):
    pid: int
    name: str | None = Field(None, description="Process name from the OS, when it can be read")
    used_mib: int | None = Field(None, description="GPU memory of this process; null when NVML does not report it")
    is_vllm_server: bool = Field(False, description="True for the vLLM server this project started (API server "
                                                    "or its engine-core child)")
    instance: str | None = Field(None, description="The named instance (or 'default') this process serves")


class GpuInfo(BaseModel):
    index: int
    name: str
    total_mib: int
    used_mib: int
    free_mib: int
    utilization_gpu_pct: int | None = Field(None, description="GPU busy percentage over NVML's last sample")
    utilization_mem_pct: int | None = None
    processes: list[GpuProcess] = Field(default_factory=list)


class HostMemory(BaseModel):
    instance: str
    pids: list[int] = Field(description="The server's processes: its tree and process group")
    rss_mib: float = Field(description="Resident memory summed over the processes (shared pages in each)")
    pss_mib: float | None = Field(None, description="Proportional set size summed over the processes whose "
                                                    "/proc/PID/smaps_rollup is readable (shared pages split)")
    pss_pids: int = Field(0, description="How many of the processes the PSS sum covers")
    weights_mib: float | None = Field(None, description="The served checkpoint's *.safetensors on disk")
    method: str = Field(description="How the figures were read")

    def line(self) -> str:
        pss = f", PSS {self.pss_mib:.0f} MiB" if self.pss_mib is not None else ""
        weights = f", weights {self.weights_mib:.1f} MiB on disk" if self.weights_mib is not None else ""
        return f"{self.instance}: RSS {self.rss_mib:.0f} MiB{pss} over {len(self.pids)} processes{weights}"


def _weights_mib(model: str | None) -> float | None:
    """The bytes of a local checkpoint's safetensors (a hub id, or no folder: None)."""
    folder = Path(model) if model else None
    if folder is None or not folder.is_dir():
        return None
    return round(sum(f.stat().st_size for f in folder.glob("*.safetensors") if f.is_file()) / MIB, 2)


def _pss_kib(pid: int, proc: Path) -> int | None:
    try:
        text = (proc / str(pid) / "smaps_rollup").read_text()
    except OSError:  # not Linux, an older kernel, or another user's process
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return None


def host_memory(instance: str, pids: set[int] | list[int], model: str | None = None, *,
                process: Any = None, proc: Path = Path("/proc")) -> HostMemory:
    """The host memory of a server's processes (`pids`: tree and group, see server_process_pids): RSS from
    psutil, PSS from /proc/PID/smaps_rollup where readable, and the weights of `model` on disk beside them.
    `process` replaces psutil.Process (tests stand in a process tree)."""
    if process is None:
        import psutil

        process, gone = psutil.Process, psutil.Error
    else:
        gone = Exception
    rss = 0
    pss: list[int] = []
    alive: list[int] = []
    for pid in sorted(set(pids)):
        try:
            rss += int(process(pid).memory_info().rss)
        except gone:  # ended between listing and reading: not part of the server any more
            continue
        alive.append(pid)
        kib = _pss_kib(pid, proc)
        if kib is not None:
            pss.append(kib)
    method = "psutil memory_info().rss" + (" + /proc/PID/smaps_rollup Pss" if pss else "")
    return HostMemory(instance=instance, pids=alive, rss_mib=round(rss / MIB, 2),
                      pss_mib=round(sum(pss) / 1024, 2) if pss else None, pss_pids=len(pss),
                      weights_mib=_weights_mib(model), method=method + ", summed over the server's processes")


class VramStatus(BaseModel):
    available: bool = Field(description="False without an NVIDIA driver (NVML)")
    reason: str | None = None
    driver_version: str | None = None
    gpus: list[GpuInfo] = Field(default_factory=list)
    server_pids: list[int] = Field(default_factory=list)  # the vLLM servers' processes: trees and groups
    server_used_mib: int | None = Field(None, description="GPU memory of the servers' processes")
    host: list[HostMemory] = Field(default_factory=list, description="Per instance: host memory (RSS, PSS), "
                                                                     "weights on disk")

    def summary_line(self) -> str:
        hosts = [h.line() for h in self.host]
        if not self.available:
            return "; ".join([f"No NVIDIA GPU: {self.reason}", *hosts])
        parts = []
        for g in self.gpus:
            parts.append(f"GPU{g.index} {g.name}: {g.used_mib} MiB used / {g.total_mib} MiB "
                         f"({g.free_mib} MiB free), {g.utilization_gpu_pct if g.utilization_gpu_pct is not None else '?'} % busy")
        if self.server_used_mib is not None:
            parts.append(f"vLLM server: {self.server_used_mib} MiB")
        return "; ".join([*parts, *hosts]) if parts else "; ".join(["NVML answered but reports no GPU", *hosts])


def _text(value: Any) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode(errors="replace") if isinstance(value, (bytes, bytearray)) else str(value)


def server_process_pids(pid: int | None) -> set[int]:
    """The server pid, its descendants and the members of its process group (vLLM's engine core is a child)."""
    if not pid:
        return set()
    import psutil

    pids: set[int] = set()
    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return pids
    pids.add(pid)
    try:
        pids.update(child.pid for child in root.children(recursive=True))
    except psutil.Error:
        pass
    # The server is launched in its own session/process group: collect that group as well, which also
    # catches engine processes re-parented after a crash of an intermediate process.
    try:
        pgid = os.getpgid(pid)
    except OSError:
        pgid = None
    if pgid is not None and pgid == pid:
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == pgid:
                    pids.add(proc.pid)
            except OSError:
                continue
    return pids


def _process_name(pid: int) -> str | None:
    try:
        import psutil

        return psutil.Process(pid).name()
    except Exception:  # gone, or not ours to read: the name is informational only
        return None


def _load_nvml() -> Any:
    import pynvml

    return pynvml


def vram_status(*, server_pid: int | None = None, server_pids: set[int] | None = None,
                nvml: Any = None, owners: dict[int, str] | None = None) -> VramStatus:
    """Read every GPU's memory and processes through NVML.

    `server_pid` is the vLLM API server's pid (its process tree is collected); `server_pids` may give the set
    directly. `owners` maps the pids of every running instance to its name (their processes are marked with it).
    `nvml` replaces the `pynvml` module (tests inject a fake); it needs the pynvml function names.
    """
    owners = owners or {}
    pids = set(server_pids or ()) | server_process_pids(server_pid) | set(owners)
    try:
        nv = nvml if nvml is not None else _load_nvml()
    except ImportError as exc:
        return VramStatus(available=False, reason=f"pynvml is not installed ({exc}); pip install nvidia-ml-py",
                          server_pids=sorted(pids))
    try:
        nv.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound / DriverNotLoaded: a machine without the driver
        return VramStatus(available=False, reason=f"NVML unavailable: {exc}", server_pids=sorted(pids))
    try:
        try:
            driver = _text(nv.nvmlSystemGetDriverVersion())
        except Exception:
            driver = None
        gpus: list[GpuInfo] = []
        server_total: int | None = None
        for index in range(int(nv.nvmlDeviceGetCount())):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = nv.nvmlDeviceGetUtilizationRates(handle)
                util_gpu, util_mem = int(util.gpu), int(util.memory)
            except Exception:  # not supported on some boards / MIG slices
                util_gpu = util_mem = None
            procs: dict[int, GpuProcess] = {}
            for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                fn = getattr(nv, getter, None)
                if fn is None:
                    continue
                try:
                    entries = fn(handle) or []
                except Exception:
                    continue
                for entry in entries:
                    pid = int(entry.pid)
                    used = getattr(entry, "usedGpuMemory", None)
                    used_mib = None if used is None else int(used) // MIB
                    if pid in procs:  # listed as compute and graphics: keep what was reported
                        if procs[pid].used_mib is None:
                            procs[pid].used_mib = used_mib
                        continue
                    procs[pid] = GpuProcess(pid=pid, name=_process_name(pid), used_mib=used_mib,
                                            is_vllm_server=pid in pids, instance=owners.get(pid))
            for p in procs.values():
                if p.is_vllm_server and p.used_mib is not None:
                    server_total = (server_total or 0) + p.used_mib
            gpus.append(GpuInfo(index=index, name=_text(nv.nvmlDeviceGetName(handle)),
                                total_mib=int(mem.total) // MIB, used_mib=int(mem.used) // MIB,
                                free_mib=int(mem.free) // MIB, utilization_gpu_pct=util_gpu,
                                utilization_mem_pct=util_mem, processes=sorted(procs.values(), key=lambda p: p.pid)))
        return VramStatus(available=True, driver_version=driver, gpus=gpus, server_pids=sorted(pids),
                          server_used_mib=server_total)
    except Exception as exc:
        return VramStatus(available=False, reason=f"NVML error: {exc}", server_pids=sorted(pids))
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


def compute_capabilities(*, nvml: Any = None) -> list[tuple[int, int]]:
    """(major, minor) of every GPU NVML lists; empty on a machine without an NVIDIA driver."""
    try:
        nv = nvml if nvml is not None else _load_nvml()
        nv.nvmlInit()
    except Exception:  # no library, no driver: a machine without a GPU
        return []
    try:
        caps = []
        for index in range(int(nv.nvmlDeviceGetCount())):
            major, minor = nv.nvmlDeviceGetCudaComputeCapability(nv.nvmlDeviceGetHandleByIndex(index))
            caps.append((int(major), int(minor)))
        return caps
    except Exception:
        return []
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass


class GpuBandwidth(BaseModel):
    index: int
    name: str
    bus_width_bits: int
    max_memory_clock_mhz: int
    bytes_per_s: float = Field(description="bus width x max memory clock x 2 (double data rate) / 8")
    method: str


def memory_bandwidth(index: int = 0, *, nvml: Any = None) -> GpuBandwidth | None:
    """The peak memory bandwidth of GPU `index` from NVML: bus width x maximum memory clock x 2 for double data
    rate (the T4: 256 bit x 5001 MHz x 2 / 8 = 320 GB/s). None on a machine without an NVIDIA driver or GPU."""
    try:
        nv = nvml if nvml is not None else _load_nvml()
        nv.nvmlInit()
    except Exception:  # no library, no driver: a machine without a GPU
        return None
    try:
        if index >= int(nv.nvmlDeviceGetCount()):
            return None
        handle = nv.nvmlDeviceGetHandleByIndex(index)
        bits = int(nv.nvmlDeviceGetMemoryBusWidth(handle))
        mhz = int(nv.nvmlDeviceGetMaxClockInfo(handle, nv.NVML_CLOCK_MEM))
        name = _text(nv.nvmlDeviceGetName(handle))
    except Exception:  # a board or driver without these queries
        return None
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
    return GpuBandwidth(index=index, name=name, bus_width_bits=bits, max_memory_clock_mhz=mhz,
                        bytes_per_s=bits * mhz * 1e6 * 2 / 8,
                        method=f"NVML: {bits}-bit bus x {mhz} MHz max memory clock x 2 (double data rate) / 8")
