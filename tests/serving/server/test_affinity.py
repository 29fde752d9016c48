"""Where a bound CPU instance runs: every process of it on the instance's own cores, whatever the process that
launched it was confined to or asked of OpenMP. Stand-in servers (tests/helpers/stand_ins/vllm_server.py) launched through the
project's start path; their affinity is read from the kernel, thread by thread.

vLLM binds only its model worker's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND); its API server and engine core keep
the affinity they inherit. A beside start launched from a process confined to the running instance's core ran its
API server and engine core on that busy core alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import free_port
from tools.serving.records import state
from tools.serving.config import ServeConfig
from tools.serving.preflight.hardware import Hardware
from tools.serving.server.server import start_server
from tools.serving.server.server import stop_server

CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores this process may run on")


class Machine(Hardware):
    """This machine's cores as placement sees them, whatever the launching thread is confined to meanwhile."""

    def platform(self):
        return "cpu"

    def cpu_cores(self):
        return CORES


def _threads_affinity(pid: int) -> dict[int, frozenset[int]]:
    """tid -> the cores the kernel lets that thread of `pid` run on."""
    return {int(t): frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


@pytest.fixture
def make(tmp_path, monkeypatch, serve_config_factory):
    """make(instance, name, cpus) -> the config of a stand-in build; every server started is stopped after."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(
        self.port, self.model, [self.served_name]))
    made: list[ServeConfig] = []

    def make(instance: str | None, name: str, cpus: int | None = 1) -> ServeConfig:
        model = stand_in_vllm.build(tmp_path / name, mode="serve")
        cfg = serve_config_factory(model, name, state_dir=tmp_path / "run", instance=instance, cpus=cpus,
                                   port=free_port(), start_timeout_s=30.0)
        made.append(cfg)
        return cfg

    yield make
    for cfg in made:
        stop_server(cfg, grace_s=2)


def _start_confined(cfg: ServeConfig, cores: set[int]):
    """start_server from this thread confined to `cores` (a child inherits its creator thread's affinity)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        return start_server(cfg, hardware=Machine())
    finally:
        os.sched_setaffinity(0, before)


@two_cores
def test_a_bound_instance_runs_on_its_own_cores_when_its_launcher_is_confined_to_anothers(make):
    a_core, b_core = CORES[0], CORES[1]
    blue, green = make("blue", "first"), make("green", "second")
    a = start_server(blue, hardware=Machine())  # from this process as it is: every core
    b = _start_confined(green, {a_core})  # from a process confined to blue's core

    assert state.load_state(blue).cpu_cores == [[a_core]] and state.load_state(green).cpu_cores == [[b_core]]
    assert set(_threads_affinity(b.pid).values()) == {frozenset({b_core})}, "green runs on blue's core"
    assert set(_threads_affinity(a.pid).values()) == {frozenset({a_core})}
    assert _environ(b.pid)["VLLM_CPU_OMP_THREADS_BIND"] == str(b_core)


def test_a_callers_openmp_placement_does_not_reach_a_bound_instance(make, monkeypatch):
    """OMP_PLACES / OMP_PROC_BIND of the caller would bind the instance's API server and engine core (libgomp
    binds a process's first thread when torch loads it) to the caller's places, not the instance's cores."""
    for k, v in {"OMP_PLACES": f"{{{CORES[0]}}}", "OMP_PROC_BIND": "true", "GOMP_CPU_AFFINITY": str(CORES[0]),
                 "KMP_AFFINITY": "compact", "OMP_NUM_THREADS": "1"}.items():
        monkeypatch.setenv(k, v)
    blue = make("blue", "first")
    a = start_server(blue, hardware=Machine())

    env = _environ(a.pid)
    recorded = state.load_state(blue).env  # what a relaunch of it (a failed switch's way back) is given
    for k in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        assert k not in env and k not in recorded, k
    assert env["OMP_NUM_THREADS"] == recorded["OMP_NUM_THREADS"] == "1"  # a thread count is not a placement


def test_the_default_instance_alone_keeps_the_cores_its_caller_gave_it(make):
    """Not bound by the project (vLLM binds it), the server keeps what it is started with: `taskset -c 0
    ./vllm-t4 start` stays on core 0."""
    cfg = make(None, "only", cpus=None)
    res = _start_confined(cfg, {CORES[0]})

    assert state.load_state(cfg).cpu_cores is None
    assert set(_threads_affinity(res.pid).values()) == {frozenset({CORES[0]})}
