"""A stand-in NVML (pynvml's functions vram_status calls) for one or more GPUs: the only thing in the suite that is
mocked is the GPU."""

from __future__ import annotations

from types import SimpleNamespace

from tools.gpu.vram import MIB


class StandInNvmlError(Exception):
    pass


class StandInNvml:
    """Implements the pynvml functions vram_status calls, for one or more stand-in GPUs."""

    def __init__(self, gpus: list[dict], *, init_error: Exception | None = None, driver: bytes | str = "550.54.15"):
        self.gpus = gpus
        self.init_error = init_error
        self.driver = driver
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self):
        self.init_calls += 1
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self):
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])

    def nvmlDeviceGetUtilizationRates(self, h):
        if h.get("util") is None:
            raise StandInNvmlError("Not Supported")
        return SimpleNamespace(gpu=h["util"], memory=h["util"] // 2)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.get("compute", [])]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in h.get("graphics", [])]

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return h.get("cc", (7, 5))


T4_TOTAL = 15360 * MIB
