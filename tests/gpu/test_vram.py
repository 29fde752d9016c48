"""vram_status against an injected stand-in NVML (the only thing in the suite that is mocked is the GPU)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from tests.helpers.stand_ins.nvml import T4_TOTAL, StandInNvml, StandInNvmlError
from tools.gpu.vram import MIB, server_process_pids, vram_status


def test_no_driver_is_a_result_not_an_exception():
    stand_in = StandInNvml([], init_error=StandInNvmlError("NVML Shared Library Not Found"))
    status = vram_status(nvml=stand_in)
    assert status.available is False
    assert "NVML Shared Library Not Found" in status.reason
    assert status.gpus == []
    assert "No NVIDIA GPU" in status.summary_line()


def test_real_pynvml_on_this_machine_never_raises():
    status = vram_status()
    # Either a real GPU answered or the result says why not; both are valid, an exception is not.
    assert status.available or status.reason


def test_t4_with_server_processes_marked_and_unreported_memory():
    # A "server" process with a child, as vLLM's API server and engine core are.
    server = subprocess.Popen([sys.executable, "-c",
                               "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)"],
                              start_new_session=True)
    try:
        deadline = time.time() + 20
        tree: set[int] = set()
        while time.time() < deadline:
            tree = server_process_pids(server.pid)
            if len(tree) >= 2:
                break
            time.sleep(0.1)
        assert server.pid in tree and len(tree) >= 2, tree
        engine_pid = max(tree - {server.pid})
        other_pid = os.getpid()
        stand_in = StandInNvml([{
            "name": b"Tesla T4", "total": T4_TOTAL, "used": 13581 * MIB, "util": 37,
            # the engine holds the memory; the API server shows up without a figure (None), plus another user
            "compute": [(engine_pid, 13300 * MIB), (server.pid, None), (other_pid, 200 * MIB)],
            "graphics": [(other_pid, None)],
        }], driver=b"550.54.15")
        status = vram_status(server_pid=server.pid, nvml=stand_in)
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    assert status.available and status.driver_version == "550.54.15"
    (gpu,) = status.gpus
    assert (gpu.name, gpu.total_mib, gpu.used_mib, gpu.free_mib) == ("Tesla T4", 15360, 13581, 15360 - 13581)
    assert (gpu.utilization_gpu_pct, gpu.utilization_mem_pct) == (37, 18)
    by_pid = {p.pid: p for p in gpu.processes}
    assert set(by_pid) == {engine_pid, server.pid, other_pid}
    assert by_pid[engine_pid].is_vllm_server and by_pid[engine_pid].used_mib == 13300
    assert by_pid[server.pid].is_vllm_server and by_pid[server.pid].used_mib is None
    assert not by_pid[other_pid].is_vllm_server and by_pid[other_pid].used_mib == 200
    assert status.server_used_mib == 13300  # unreported memory is not counted as zero-or-guess
    assert server.pid in status.server_pids and engine_pid in status.server_pids
    assert stand_in.shutdown_calls == stand_in.init_calls == 1
    assert "13581 MiB used / 15360 MiB" in status.summary_line()


def test_two_gpus_no_util_support_and_no_server():
    stand_in = StandInNvml([
        {"name": "Tesla T4", "total": T4_TOTAL, "used": 0, "util": None},
        {"name": "NVIDIA L4", "total": 23034 * MIB, "used": 500 * MIB, "util": 5, "compute": [(999999, None)]},
    ])
    status = vram_status(nvml=stand_in)
    assert [g.name for g in status.gpus] == ["Tesla T4", "NVIDIA L4"]
    assert status.gpus[0].utilization_gpu_pct is None
    assert status.gpus[1].processes[0].used_mib is None and not status.gpus[1].processes[0].is_vllm_server
    assert status.server_used_mib is None and status.server_pids == []


def test_nvml_failing_mid_read_is_reported():
    class Broken(StandInNvml):
        def nvmlDeviceGetMemoryInfo(self, h):
            raise StandInNvmlError("GPU is lost")

    stand_in = Broken([{"name": "Tesla T4", "total": T4_TOTAL, "used": 0}])
    status = vram_status(nvml=stand_in)
    assert not status.available and "GPU is lost" in status.reason
    assert stand_in.shutdown_calls == 1


@pytest.mark.parametrize("pid", [None, 0, 2 ** 22 + 12345])
def test_server_pids_of_missing_process_is_empty(pid):
    assert server_process_pids(pid) == set()


def test_serving_hardware_reads_every_gpu_through_the_one_nvml_reader(monkeypatch):
    """vLLM start checks (platform, Turing clamp, VRAM) see all GPUs, not GPU 0 only."""
    from tools.gpu import vram as vram_mod
    from tools.serving.preflight.hardware import Hardware

    stand_in = StandInNvml([
        {"name": "A100", "total": 40960 * MIB, "used": 1000 * MIB, "util": 5, "cc": (8, 0)},
        {"name": "Tesla T4", "total": T4_TOTAL, "used": 9000 * MIB, "util": 90, "cc": (7, 5),
         "compute": [(4242, 8000 * MIB)]},
    ])
    monkeypatch.setattr(vram_mod, "_load_nvml", lambda: stand_in)
    hw = Hardware()
    assert hw.platform() == "cuda"
    assert hw.compute_capability() == (7, 5)  # the T4 on index 1 still needs the clamp
    v = hw.vram([4242])
    assert v.total_mib == 40960 + 15360 and v.used_mib == 10000
    assert v.process_mib == 8000 and v.utilization_pct == 90


# ------------------------------------------------------------------------------ host memory (the CPU backend)


class StandInProcess:
    """psutil.Process for a stand-in process tree: RSS by pid; a pid not in the tree has ended."""

    TREE = {100: 300 * MIB, 101: 900 * MIB, 102: 50 * MIB}

    def __init__(self, pid: int) -> None:
        if pid not in self.TREE:
            raise ProcessLookupError(pid)
        self.pid = pid

    def memory_info(self):
        return SimpleNamespace(rss=self.TREE[self.pid])


def test_host_memory_sums_rss_and_readable_pss_over_the_servers_processes(tmp_path):
    from tools.gpu.vram import HostMemory, host_memory

    proc = tmp_path / "proc"
    for pid, pss_kib in ((100, 200 * 1024), (101, 700 * 1024)):  # 102's smaps_rollup is not readable
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "smaps_rollup").write_text(
            f"00400000-7ffd [rollup]\nRss:  {pss_kib + 10} kB\nPss:  {pss_kib} kB\nPss_Anon:  1 kB\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model-00001.safetensors").write_bytes(b"\0" * (3 * MIB))
    (model / "model-00002.safetensors").write_bytes(b"\0" * MIB)
    (model / "config.json").write_text("{}")

    hm = host_memory("default", {100, 101, 102, 999}, str(model), process=StandInProcess, proc=proc)
    assert isinstance(hm, HostMemory)
    assert hm.pids == [100, 101, 102]  # 999 ended before it was read: not counted
    assert hm.rss_mib == 1250 and hm.pss_mib == 900 and hm.pss_pids == 2
    assert hm.weights_mib == 4
    assert "rss" in hm.method and "smaps_rollup" in hm.method
    assert hm.line() == "default: RSS 1250 MiB, PSS 900 MiB over 3 processes, weights 4.0 MiB on disk"

    none = host_memory("b", {102}, "google/some-hub-id", process=StandInProcess, proc=proc)
    assert none.pss_mib is None and none.weights_mib is None and "smaps_rollup" not in none.method


def test_host_memory_reaches_the_summary_without_a_gpu():
    from tools.gpu.vram import HostMemory

    st = vram_status(nvml=StandInNvml([], init_error=StandInNvmlError("NVML Shared Library Not Found")))
    st.host = [HostMemory(instance="default", pids=[1, 2], rss_mib=812.4, pss_mib=640.2, pss_pids=2,
                          weights_mib=12.5, method="m")]
    assert st.summary_line() == ("No NVIDIA GPU: NVML unavailable: NVML Shared Library Not Found; default: RSS 812 "
                                 "MiB, PSS 640 MiB over 2 processes, weights 12.5 MiB on disk")


def test_host_memory_of_this_process_is_real():
    from tools.gpu.vram import host_memory

    hm = host_memory("self", {os.getpid()})
    assert hm.pids == [os.getpid()] and hm.rss_mib > 1
    if os.path.exists(f"/proc/{os.getpid()}/smaps_rollup"):
        assert hm.pss_mib is not None and 0 < hm.pss_mib <= hm.rss_mib * 1.01
