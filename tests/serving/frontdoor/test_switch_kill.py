"""The switching command signalled at each phase of a switch, with a loop of chat completions running through the
front door the whole time: `./vllm-t4 router switch` (a process of its own, the stand-in builds patched in) gets
SIGKILL or SIGINT while B loads, once B is ready but before the router changes, and while A drains (beside); while
A drains and stops, and while B loads (hold: the machine too small for two). The phases are the switch's own
(frontdoor._step, where it pauses a moment for the test) or B's state file.

After each: no request failed (in hold, none held past the announced bound, which would have failed it), the
right build answering (SIGKILL: the switch went on alone and B serves; SIGINT: it rolled back and A serves, except
once B had the traffic, while A drained), the router's state naming exactly the build it routes to, and no
process of the other build, nor the switch's, left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import psutil
import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, free_port
from tests.helpers.kill_matrix import all_gone, assert_ended, cli, signal_when
from tests.helpers.serving import Clients, TwoCores, until
from tools.serving.frontdoor import door as frontdoor
from tools.serving.records import router_state, state
from tools.serving.server import switch_record
from tools.serving.config import ServeConfig
from tools.serving.server.server import start_server
from tools.serving.frontdoor.router import start_router, stop_router
from tools.serving.records.state import InstanceBusy
from tools.serving.server.server import stop_server

HOLD_S = 10.0   # the front door's hold: A's stop and B's load (about 2 s here) fit well within it
LOAD_S = 0.5    # B's load: long enough to be signalled during it
PAUSE_S = 1.0   # the switch's pause at the phase a test signals it in

# (mode, phase): where the switching command is signalled
PHASES = [("beside", "b loads"), ("beside", "b ready"), ("beside", "a drains"), ("hold", "a drains"),
          ("hold", "b loads")]


@pytest.fixture
def front(tmp_path, monkeypatch, serve_config_factory):
    """The router (hold HOLD_S) over build `old` on instance blue; yields (front-door config, environment of the
    command line against it)."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(self.port, self.model))
    run = tmp_path / "run"
    base = serve_config_factory(tmp_path, "front", state_dir=run, start_timeout_s=30.0)
    a = _build(tmp_path, "old", {})
    a_cfg = serve_config_factory(a, "old", state_dir=run, instance="blue", cpus=1, port=free_port(),
                                 start_timeout_s=30.0)
    env = dict(os.environ, PYTHONPATH=str(ROOT), STATE_DIR=str(run), HOST="127.0.0.1", SPECULATIVE_CONFIG="",
               EXTRA_ARGS="", START_TIMEOUT_S="30", CPU_KVCACHE_SPACE_GIB="1", STAND_IN_PHASES=str(tmp_path))
    env.pop("VLLM_API_KEY", None)
    try:
        start_server(a_cfg, hardware=TwoCores())
        start_router(base, ["blue"], port=free_port(), hold_s=HOLD_S)
        yield base, env
    finally:
        for name in ("blue", "green"):
            stop_server(replace(base, instance=name), grace_s=2)
        stop_router(base, grace_s=5)


def _build(tmp_path, name: str, behaviour: dict) -> str:
    return stand_in_vllm.build(tmp_path / name, **behaviour)


def _processes_of(model: str) -> list[int]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if model in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p.pid)
    return out


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGINT"])
@pytest.mark.parametrize("mode,phase", PHASES, ids=[f"{m}-{p.replace(' ', '-')}" for m, p in PHASES])
def test_a_switching_command_signalled_at_each_phase_leaves_one_build_serving_and_no_request_failed(
        front, tmp_path, mode, phase, sig):
    _signalled(front, tmp_path, mode, phase, sig, ["router", "switch", "--instance", "green"])


# tpu.env as shipped (FRONT_DOOR=1): `start --replace` is the same switch, to the free slot (green)
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGINT"])
@pytest.mark.parametrize("mode,phase", [("beside", "b ready"), ("hold", "b loads")],
                         ids=["beside-b-ready", "hold-b-loads"])
def test_start_replace_in_the_shipped_configuration_signalled_mid_switch_fails_no_request(
        front, tmp_path, mode, phase, sig):
    base, env = front
    env = {k: v for k, v in env.items() if k != "FRONT_DOOR"}  # tpu.env's own value
    _signalled((base, env), tmp_path, mode, phase, sig, ["start", "--replace"])


def _signalled(front, tmp_path, mode: str, phase: str, sig: str, command: list[str]) -> None:
    base, env = front
    tmp = tmp_path
    new = _build(tmp, "new", {"load_s": LOAD_S})
    green = replace(base, instance="green")
    env = dict(env, STAND_IN_PAUSE_AT="" if phase == "b loads" else phase, STAND_IN_PAUSE_S=str(PAUSE_S))
    if phase == "b loads":  # B's state file is written at its launch, a second before it answers
        reached = green.state_file.exists
    else:
        reached = (tmp / phase.replace(" ", "-")).exists
    want = "new" if sig == "SIGKILL" or (mode, phase) == ("beside", "a drains") else "old"
    switcher: list[int] = []

    def settle() -> None:  # the switch process, to wait for once the command is gone
        running = router_state.switch_running(base)
        assert running, "no switch recorded as running"
        switcher.append(running["pid"])

    with Clients(router_state.recorded(base).base_url) as clients:
        until("a request answered", lambda: clients.served())
        proc = cli([*command, "--model", new, "--served-name", "new", "--cpus", "1" if mode == "beside" else "2"],
                   env, driver=["-m", "tests.helpers.stand_ins.switch", "cli"])
        err = signal_when(proc, reached, sig, phase, settle=settle)
        assert_ended(sig, proc.returncode, err)
        if sig == "SIGINT":  # acknowledged at once (the way back may take minutes), then how it ended
            said = [ln for ln in err.splitlines() if ln.startswith("vllm-t4: ")]
            assert said[0].startswith(f"vllm-t4: interrupt received: the switch (pid {switcher[0]}) ends safely"), err
            assert said[0].endswith("then check `./vllm-t4 status`") and "\x1e" not in err, err
            assert said[1].startswith("vllm-t4: the switch ended: last switch (") and "interrupted" in said[1], err
        assert all_gone(switcher, wait_s=60), "the switch process did not end"
        until(f"{want} answering", lambda: clients.served()[-1:] == [want])
        n = len(clients.results)
        until("three more answers", lambda: len(clients.results) >= n + 3)
    assert clients.failed() == [], clients.failed()[:3]
    assert clients.served()[-1] == want
    if mode == "hold":  # announced before anything stopped
        assert "requests wait at the front door (about " in err and "each at most 10 s" in err, err

    serving, other = ("green", "blue") if want == "new" else ("blue", "green")
    rt = router_state.recorded(base)
    st = state.load_state(replace(base, instance=serving))
    assert [x.instance for x in rt.backends] == [serving] and frontdoor.workers(rt) == [st.base_url]
    assert state.leader(st) is not None
    assert not replace(base, instance=other).state_file.exists()
    assert _processes_of(new if want == "old" else str(tmp / "old")) == []
    assert router_state.switch_running(base) is None
    last = switch_record.load_switch(base)
    assert last is not None and last.serving == want, last


def test_while_a_switch_is_under_way_another_switch_a_router_stop_and_a_stop_of_its_builds_are_refused(
        front, tmp_path):
    """The switch process holds the front door's switch lock and both instances' locks: each of these is refused
    in one line, nothing done, and the switch then ends as it would have."""
    base, env = front
    new = _build(tmp_path, "new", {})
    go = tmp_path / "go"
    env = dict(env, STAND_IN_PAUSE_AT="b ready", STAND_IN_GO=str(go))
    proc = cli(["router", "switch", "--instance", "green", "--model", new, "--served-name", "new", "--cpus", "1"],
               env, driver=["-m", "tests.helpers.stand_ins.switch", "cli"])
    try:
        until("B ready", (tmp_path / "b-ready").exists)
        running = router_state.switch_running(base)
        assert running and "switch to new" in running["what"], running
        stop = subprocess.run([sys.executable, "-m", "tests.helpers.stand_ins.switch", "cli", "router", "stop"], env=env,
                              capture_output=True, text=True, timeout=60)
        lines = stop.stderr.strip().splitlines()
        assert stop.returncode == 1 and len(lines) == 1 and "the front door is being changed" in lines[0], stop
        assert f"pid {running['pid']}" in lines[0] and "the router's stop was not done" in lines[0]
        other = replace(base, model=new, served_name="other", instance="red", port=free_port())
        with pytest.raises(InstanceBusy, match="another switch was not done"):
            frontdoor.switch(base, other, hardware=TwoCores())
        with pytest.raises(InstanceBusy, match="instance blue is being changed"):
            stop_server(replace(base, instance="blue"))
        assert router_state.recorded(base) is not None and proc.poll() is None
    finally:
        go.touch()
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 0 and switch_record.load_switch(base).serving == "new", err
    assert router_state.switch_running(base) is None and not router_state.switch_file(base).exists()


def test_a_second_ctrl_c_does_not_cut_the_rollback_short(front, tmp_path):
    """Two SIGINTs 0.2 s apart once B is ready: the command passes one on, waits for the rollback whatever else
    comes, then exits 130 with one line; A serves, B is gone, no request failed. B takes 2 s to end on SIGTERM: the
    second SIGINT lands while the rollback waits for it, on any machine."""
    base, env = front
    new = _build(tmp_path, "new", {"term_s": 2})
    env = dict(env, STAND_IN_PAUSE_AT="b ready", STAND_IN_PAUSE_S=str(PAUSE_S))
    with Clients(router_state.recorded(base).base_url) as clients:
        until("a request answered", lambda: clients.served())
        proc = cli(["router", "switch", "--instance", "green", "--model", new, "--served-name", "new", "--cpus",
                    "1"], env, driver=["-m", "tests.helpers.stand_ins.switch", "cli"])
        err = signal_when(proc, (tmp_path / "b-ready").exists, "SIGINT", "B ready",
                          settle=lambda: (proc.send_signal(signal.SIGINT), time.sleep(0.2)))
        assert_ended("SIGINT", proc.returncode, err)
        assert router_state.switch_running(base) is None  # the rollback was over when the command ended
        n = len(clients.results)
        until("three more answers", lambda: len(clients.results) >= n + 3)
    assert clients.failed() == [] and clients.served()[-1] == "old"
    assert [x.instance for x in router_state.recorded(base).backends] == ["blue"]
    assert not replace(base, instance="green").state_file.exists() and _processes_of(new) == []


def test_a_cancelled_front_end_passes_the_cancellation_on_and_waits_for_the_rollback(front, tmp_path, monkeypatch):
    """What an MCP cancellation does (its progress report raises): the switch process gets one SIGINT, B is ended,
    A keeps the traffic, and the front end raises its own exception once the rollback is over."""
    from tests.helpers.stand_ins.switch import SWITCH
    from tools.serving.frontdoor import switch_process

    base, _ = front
    monkeypatch.setattr(switch_process, "PROGRAM", SWITCH)
    b = replace(base, model=_build(tmp_path, "new", {"mode": "hang"}), served_name="new", instance="green",
                port=free_port(), cpus=1)

    class Cancelled(Exception):
        pass

    def progress(frac: float, total: float | None, msg: str) -> None:
        if b.state_file.exists():
            raise Cancelled

    with Clients(router_state.recorded(base).base_url) as clients:
        with pytest.raises(Cancelled):
            switch_process.switch(base, b, progress=progress)
        assert router_state.switch_running(base) is None
        n = len(clients.results)
        until("three more answers", lambda: len(clients.results) >= n + 3)
    assert clients.failed() == [] and set(clients.served()) == {"old"}
    assert not b.state_file.exists() and _processes_of(b.model) == []
    assert switch_record.load_switch(base).message == "interrupted; unchanged (old serves)"
