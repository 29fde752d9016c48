"""The front door (vllm-router on the client port, builds as named instances behind it) through a switch, with
a bounded loop of chat completions running through it the whole time: a good switch with both builds side by
side, a build that exits, a build that answers but refuses what clients send, and the same on a machine too
small for two (the front door holds requests while the old build stops and the new one loads). After each:
no failed request, the right build answering, its figures, no process of a stopped build left. The builds are
tests/helpers/stand_ins/vllm_server.py; the router is the real vllm-router. A two-core CPU is stood in (Hardware)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import free_port, group_alive
from tests.helpers.serving import Clients, TwoCores
from tools.core.errors import ToolFailure
from tools.serving.frontdoor import door as frontdoor
from tools.serving.records import router_state, state
from tools.serving.server import switch_record
from tools.serving.config import ServeConfig
from tools.serving.frontdoor.router import start_router, stop_router
from tools.serving.server.server import start_server
from tools.serving.server.server import stop_server


@pytest.fixture
def door(tmp_path, monkeypatch, serve_config_factory):
    """door(a_mode="serve") -> (front-door config, make(instance, name, mode, cpus)); the router over build
    `old` on instance blue."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(
        self.port, self.model, [self.served_name, *self.served_aliases]))
    hw = TwoCores()
    base = serve_config_factory(tmp_path, "front", state_dir=tmp_path / "run", start_timeout_s=30.0)
    made: list[ServeConfig] = []

    def make(instance: str, name: str, mode: str = "serve", cpus: int = 1, **spec) -> ServeConfig:
        model = stand_in_vllm.build(tmp_path / name, mode=mode, **spec)
        cfg = serve_config_factory(model, name, state_dir=tmp_path / "run", instance=instance, cpus=cpus,
                                   port=free_port(), start_timeout_s=30.0)
        made.append(cfg)
        return cfg

    make.hw = hw
    try:  # a set-up that fails halfway leaves no server either
        start_server(make("blue", "old"), hardware=hw)
        start_router(base, ["blue"], port=free_port(), hold_s=30.0)
        yield base, make
    finally:
        stop_router(base, grace_s=5)
        for cfg in made:
            stop_server(cfg, grace_s=2)


def _front(base: ServeConfig) -> str:
    return router_state.recorded(base).base_url


def test_a_good_switch_beside_the_old_build_fails_no_request(door):
    base, make = door
    old = state.load_state(_instance(base, "blue"))
    b = make("green", "new")
    # and clients that name the model keep the name they were given: the new build answers to it too
    with Clients(_front(base)) as clients, Clients(_front(base), model="old") as naming:
        time.sleep(0.5)
        res = frontdoor.switch(base, b, hardware=make.hw)
        time.sleep(0.5)
    assert naming.failed() == [] and naming.served()[-1] == "new", naming.failed()[:3]
    assert "answering to old too" in res.announced and router_state.recorded(base).names == ["old", "new"]
    assert res.outcome == "serving new" and res.replaced == "old" and res.mode == "beside"
    assert "no request waits for a load" in res.announced
    assert clients.failed() == [] and clients.served()[-1] == "new" and "old" in clients.served()
    assert res.figures.requests and res.figures.failed == 0 and res.figures.longest_wait_s == 0
    assert [x.instance for x in router_state.recorded(base).backends] == ["green"]
    assert frontdoor.workers(router_state.recorded(base)) == [res.backend]
    assert group_alive(old.pgid) == [] and not _instance(base, "blue").state_file.exists()
    from tools.serving.frontdoor.instances import fleet_status

    st = fleet_status(base)
    assert st.last_switch["outcome"] == "serving new" and st.last_switch["figures"]["failed"] == 0
    assert "last switch" in st.message and "from old to new: serving new" in st.message
    # the builds by folder too: a served name kept across builds would hide which serves
    assert res.model == b.model and res.replaced_model == old.model
    assert f"builds: {old.model} -> {b.model}" in st.message and st.last_switch["to_model"] == b.model


def _instance(base: ServeConfig, name: str) -> ServeConfig:
    import dataclasses

    return dataclasses.replace(base, instance=name)


@pytest.mark.parametrize("mode,words", [("exit", "the stand-in refuses this build"),
                                        ("refuse", "maximum context length is 16 tokens")])
def test_a_new_build_that_fails_leaves_the_old_one_serving_and_no_request_failed(door, mode, words):
    base, make = door
    old = state.load_state(_instance(base, "blue"))
    b = make("green", "bad", mode)
    with Clients(_front(base)) as clients:
        time.sleep(0.3)
        with pytest.raises(ToolFailure) as exc:
            frontdoor.switch(base, b, hardware=make.hw)
        time.sleep(0.3)
    detail = exc.value.detail
    assert detail["outcome"] == "unchanged (old serves)" and words in str(exc.value)
    if mode == "refuse":
        assert detail["parameter"] == "max_model_len"
    assert clients.failed() == [] and set(clients.served()) == {"old"}
    assert state.leader(state.load_state(_instance(base, "blue"))).pid == old.pid
    assert group_alive(detail["pgid"]) == [] and not b.state_file.exists()
    last = switch_record.load_switch(base)
    assert last.outcome == "unchanged (old serves)" and last.failed_log
    assert mode == "refuse" or words in open(last.failed_log).read()  # a refusal is an answer, not a log line


def test_a_machine_too_small_for_two_holds_requests_while_the_new_build_loads(door):
    base, make = door
    old = state.load_state(_instance(base, "blue"))
    b = make("green", "new", cpus=2, load_s=2)  # two cores wanted, one is blue's
    with Clients(_front(base)) as clients:
        time.sleep(0.3)
        res = frontdoor.switch(base, b, hardware=make.hw)
        time.sleep(0.3)
    assert res.mode == "hold" and "each at most 30 s" in res.announced and "old stops first" in res.announced
    # the wait it announces is the old build's own start on this machine, as its record measured it
    assert old.startup_s is not None and f"(about {old.startup_s:.0f} s, old's own start here)" in res.announced
    assert res.outcome == "serving new" and clients.failed() == [] and clients.served()[-1] == "new"
    # held, not failed: a request held past the announced bound would have failed above
    assert res.figures.retried and res.figures.failed == 0 and res.figures.longest_wait_s > 0
    assert group_alive(old.pgid) == []


def test_a_hold_shorter_than_a_start_here_is_refused_before_anything_stops(door):
    """Where a build took longer to start on this machine than the front door holds a request, a switch that
    stops it first would fail requests: refused in one line, naming the hold to ask for; the old build serves."""
    base, make = door
    a_cfg = _instance(base, "blue")
    old = state.load_state(a_cfg)
    state.write_state(a_cfg, old.model_copy(update={"startup_s": 75.0}))  # a start as slow as a loaded T4 box's
    b = make("green", "new", cpus=2)
    with Clients(_front(base)) as clients:
        time.sleep(0.3)
        with pytest.raises(ToolFailure) as exc:
            frontdoor.switch(base, b, hardware=make.hw)
        time.sleep(0.3)
    msg = str(exc.value)
    assert "old took 75 s to start on this machine" in msg and "at least 150 s" in msg and "\n" not in msg
    assert exc.value.detail["outcome"] == "unchanged (old serves)" and not b.state_file.exists()
    assert clients.failed() == [] and clients.served()[-1] == "old" and group_alive(old.pgid)


def test_on_a_machine_too_small_for_two_a_failed_build_gives_the_traffic_back_to_the_old_one(door):
    base, make = door
    b = make("green", "bad", "exit", cpus=2)
    with Clients(_front(base)) as clients:
        time.sleep(0.3)
        with pytest.raises(ToolFailure) as exc:
            frontdoor.switch(base, b, hardware=make.hw)
        time.sleep(0.5)
    assert exc.value.detail["outcome"] == "restored old" and "the stand-in refuses this build" in str(exc.value)
    assert clients.failed() == [] and clients.served()[-1] == "old"
    st = state.load_state(_instance(base, "blue"))
    assert st is not None and state.leader(st) is not None
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
               for p in [exc.value.detail["pid"]])


def _placement_locked(base: ServeConfig) -> bool:
    """Whether a process holds the state dir's placement lock (a descriptor of our own: flock refuses it even
    against this process's own)."""
    import fcntl

    with open(base.state_dir / ".instances.lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fh, fcntl.LOCK_UN)
        return False


@pytest.mark.parametrize("cpus,mode,plans", [(1, "beside", 1), (2, "hold", 2)])
def test_a_switch_plans_the_new_build_once_and_launches_it_under_the_lock_it_planned_under(door, monkeypatch, cpus,
                                                                                         mode, plans):
    """Beside: B's place is planned once, and B launched on that plan before the placement lock is let go (the
    hold from the plan to the launch: another start cannot take the same cores between them). Hold: planned
    against A (it does not fit), then once A is gone. Either way the router's state file is read once."""
    from tests.helpers.stand_ins.switch import count_calls
    from tools.serving.server import server

    base, make = door
    b = make("green", "new", cpus=cpus)
    counts: dict[str, int] = {}
    count_calls(counts, monkeypatch.setattr)
    seen: dict[str, bool] = {}
    read, launch, wait = frontdoor.Counts.read, server.launch_server, server.wait_ready

    def counted(rt):  # first read just before anything moves: beside, with B's plan already made
        seen.setdefault("before anything moves", _placement_locked(base))
        return read(rt)

    def launched(cfg, *args, **kw):
        seen.setdefault("at the launch", _placement_locked(base))
        return launch(cfg, *args, **kw)

    def waited(*args, **kw):
        seen.setdefault("while B loads", _placement_locked(base))
        return wait(*args, **kw)

    monkeypatch.setattr(frontdoor.Counts, "read", staticmethod(counted))
    monkeypatch.setattr(server, "launch_server", launched)
    monkeypatch.setattr(server, "wait_ready", waited)
    res = frontdoor.switch(base, b, hardware=make.hw)
    assert res.mode == mode and res.outcome == "serving new"
    assert counts == {"plan": plans, "router_load": 1}, counts
    # let go once B launched: another start waits for the launch, not for B's load
    assert seen == {"before anything moves": mode == "beside", "at the launch": True, "while B loads": False}, seen


@pytest.mark.vllm
@pytest.mark.vllm_lane(1)
def test_real_vllm_switches_through_the_front_door_fail_no_request(emb4_build, serve_config_factory, tmp_path,
                                                                  monkeypatch):
    """tpu.env as shipped (FRONT_DOOR=1), real vLLM CPU servers behind the real router (each build on cores of
    its own), the starts and switches as `./vllm-t4 start [--replace]` and start_vllm_server run them
    (tools.serving.frontdoor.service), with chat completions running through the port clients use the whole time:
    (a) a good switch (the tiny all-4-bit build under a second name, beside the first), (b) a switch to a copy vLLM
    refuses to load (an unknown quantization method), (c) a switch to the build at max_model_len=16, below what
    its chat template renders for one word (18 tokens), (d) at 19, which loads and refuses what clients send. No
    request fails; after (a) the new build answers, after (b)-(d) it still does; (c) is refused before anything
    launches, naming max_model_len; (d) ends on vLLM's own refusal of the readiness request, names max_model_len
    and not a line every start prints, and leaves no record; the failed build's log is kept; no process of a
    stopped build is left. The plain start's refusal (no front door) is the same readiness code, on the stand-in
    in test_readiness."""
    import shutil

    from tests.helpers.fixtures import in_process_engine, require_plugin
    from tools.serving.frontdoor import service

    require_plugin()
    in_process_engine(monkeypatch)
    monkeypatch.delenv("FRONT_DOOR")
    run, port = tmp_path / "run", free_port()
    bad = tmp_path / "gemma-4-tiny-unknown-quant"
    shutil.copytree(emb4_build, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "no-such-method"
    (bad / "config.json").write_text(json.dumps(config))

    def build(model, name, **kw) -> ServeConfig:
        return serve_config_factory(model, name, state_dir=run, port=port, **kw)

    base = build(emb4_build, "tiny-first")
    assert base.front_door, "tpu.env as shipped serves through the front door"
    pgids = []
    try:
        first = service.start(base)
        front = first.base_url
        assert front == base.base_url and first.front_door["instance"] == "blue"
        pgids.append(first.pgid)
        results, configs = {}, {}
        for step, (b, want) in {"a": (build(emb4_build, "tiny-second"), "tiny-second"),
                                "b": (build(bad, "tiny-unknown-quant"), "tiny-second"),
                                "c": (build(emb4_build, "tiny-short", max_model_len=16), "tiny-second"),
                                "d": (build(emb4_build, "tiny-short", max_model_len=19), "tiny-second"),
                                }.items():
            # one loop names no model, one the name clients were first given (every later build answers to it)
            with Clients(front, model=None) as clients, Clients(front, model="tiny-first") as naming:
                time.sleep(1.0)
                try:
                    results[step] = service.start(b, replace_running=True)
                except ToolFailure as exc:
                    results[step] = exc
                time.sleep(1.0)
            assert clients.failed() == [] and naming.failed() == [], (step, clients.failed()[:3], naming.failed()[:3])
            assert clients.served() and clients.served()[-1] == want, (step, set(clients.served()))
            configs[step] = b
        assert results["a"].outcome == "serving tiny-second" and results["a"].mode == "beside"
        assert results["a"].figures.failed == 0 and results["a"].figures.requests
        for step in "bcd":
            assert isinstance(results[step], ToolFailure), results[step]
            assert results[step].detail["outcome"] == "unchanged (tiny-second serves)", str(results[step])
        pgids += [results[step].detail["pgid"] for step in "bd"]
        # (c) below the chat template's own length: refused before anything launched, in seconds
        assert results["c"].detail["check"] == "max_model_len" and results["c"].detail["parameter"] == "max_model_len"
        assert "chat template renders 18 tokens" in str(results["c"]) and "pid" not in results["c"].detail
        # (d) room for the template, not for the readiness request: vLLM's own refusal ends the start at once
        assert results["d"].detail["parameter"] == "max_model_len"
        assert results["d"].detail["reason"] == "answered but refused what clients send"
        assert "maximum context length is 19 tokens" in str(results["d"]) and "ulimit" not in str(results["d"])
        assert not _instance(base, "blue").state_file.exists()
        last = switch_record.load_switch(base)  # the failed build's log is kept and named
        assert last.outcome == "unchanged (tiny-second serves)" and os.path.isfile(last.failed_log)
        [green] = router_state.recorded(base).backends
        pgids.append(state.load_state(_instance(base, "green")).pgid)
        print({k: (v.to_dict() if hasattr(v, "to_dict") else str(v)) for k, v in results.items()})
    finally:
        service.stop(base, grace_s=10)
        for name in ("blue", "green"):
            stop_server(_instance(base, name), grace_s=10)
    assert all(group_alive(g) == [] for g in pgids)


def test_the_command_line_and_mcp_switch_the_same_way(door, tmp_path, capsys, monkeypatch):
    from fastmcp import Client

    from tools.cli import main
    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    from tests.helpers.stand_ins.switch import SWITCH
    from tools.serving.frontdoor import switch_process

    base, make = door
    b = make("green", "new")
    # repacked for bfloat16, served as tpu.env's CPU_DTYPE=float16: each switch to it says preflight's warning
    (Path(b.model) / "repack-report.json").write_text(json.dumps({"target_dtype": "bfloat16"}))
    monkeypatch.setattr(switch_process, "PROGRAM", SWITCH)  # the switch's own process runs the stand-ins too
    for k, v in {"STATE_DIR": str(base.state_dir), "SPECULATIVE_CONFIG": "", "EXTRA_ARGS": "",
                 "START_TIMEOUT_S": "30", "CPU_KVCACHE_SPACE_GIB": "1"}.items():
        monkeypatch.setenv(k, v)
    with Clients(_front(base)) as clients:
        capsys.readouterr()
        rc = main(["router", "switch", "--instance", "green", "--model", b.model, "--served-name", "new",
                   "--cpus", "1"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        assert "serving new" in out.out and "in place of old" in out.out and " 0 failed" in out.out
        assert "\n  warning: runtime_dtype: " in out.out, out.out
        (tmp_path / "evidence").mkdir()
        roots = Roots.from_env([str(tmp_path)], [str(tmp_path / "evidence")], environ={})
        server = create_server(Settings(roots=roots, config_overrides={
            "state_dir": str(base.state_dir), "speculative_config": "", "extra_args": "", "start_timeout_s": 30.0,
            "cpu_kvcache_space_gib": 1}), toolsets=["fleet"])
        bad = make("blue", "short", "refuse")

        async def go():
            async with Client(server) as c:
                return await c.call_tool("switch_build", {"instance": "blue", "model": bad.model,
                                                          "served_name": "short"}, raise_on_error=False)

        res = asyncio.run(go())
        good = make("blue", "newer")
        (Path(good.model) / "repack-report.json").write_text(json.dumps({"target_dtype": "bfloat16"}))

        async def go_good():
            async with Client(server) as c:
                return await c.call_tool("switch_build", {"instance": "blue", "model": good.model,
                                                          "served_name": "newer"})

        done = asyncio.run(go_good()).content[0].text
    text = res.content[0].text
    assert res.is_error and "max_model_len" in text and "new still serves" in text, text
    # the figures of a switch say where they were measured
    assert "serving newer" in done and " 0 failed" in done and "on the CPU stand-in" in done, done
    assert f"; builds: {b.model} -> {good.model}; warning: runtime_dtype: " in done.splitlines()[0], done
    assert clients.failed() == [] and clients.served()[-1] == "newer"


@pytest.mark.parametrize("cpus,mode", [(1, "beside"), (2, "hold")])
def test_a_switch_interrupted_while_the_new_build_loads_leaves_the_old_one_with_the_traffic(door, cpus, mode):
    """Ctrl-C (or a cancelled MCP job) once B is launched: beside, A never stopped; in hold, A is launched again
    and put back while the router holds the requests."""
    base, make = door
    b = make("green", "new", "hang", cpus=cpus)

    def progress(frac: float, total: float | None, msg: str) -> None:
        if b.state_file.exists():
            raise KeyboardInterrupt

    with Clients(_front(base)) as clients:
        time.sleep(0.3)
        with pytest.raises(KeyboardInterrupt):
            frontdoor.switch(base, b, hardware=make.hw, progress=progress)
        deadline = time.monotonic() + 20  # hold: A is launched again, not waited for
        while clients.served()[-1:] != ["old"] or len(clients.served()) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        n = len(clients.results)
        while len(clients.results) < n + 3:
            time.sleep(0.05)
    assert clients.failed() == [] and clients.served()[-1] == "old"
    assert not b.state_file.exists()
    assert frontdoor.workers(router_state.recorded(base)) == [state.load_state(_instance(base, "blue")).base_url]
