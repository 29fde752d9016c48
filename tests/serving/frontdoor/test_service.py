"""The default configuration (tpu.env as shipped: FRONT_DOOR=1): `./vllm-t4 start` serves the port clients use
through the front door, the build behind it on an internal port; `start --replace` (MCP start_vllm_server
replace=true) switches builds there with requests flowing and none failed; `status`, `query` and `log` read the
build behind the door; `stop` ends the door and its builds. The builds are tests/helpers/stand_ins/vllm_server.py, the router the
real vllm-router, the switch's own process tests/helpers/stand_ins/switch.py (a CPU of two cores)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, free_port, group_alive, kill_group
from tests.helpers.serving import Clients
from tests.helpers.stand_ins.switch import SWITCH
from tools.serving.records import router_state, state
from tools.serving.frontdoor import switch_process
from tools.serving.config import ServeConfig, load_config


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """(make(name, mode) -> model folder, env): the project's tpu.env as shipped, its port and state folder this
    test's own, vLLM the stand-in."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(
        self.port, self.model, [self.served_name, *self.served_aliases]))
    monkeypatch.setattr(switch_process, "PROGRAM", SWITCH)
    port = free_port()
    env = {"STATE_DIR": str(tmp_path / "run"), "PORT": str(port), "SPECULATIVE_CONFIG": "", "EXTRA_ARGS": "",
           "START_TIMEOUT_S": "30", "CPU_KVCACHE_SPACE_GIB": "1", "FRONT_DOOR_HOLD_S": "30"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("FRONT_DOOR", raising=False)

    def make(name: str, mode: str = "serve", **spec) -> str:
        return stand_in_vllm.build(tmp_path / name, mode=mode, **spec)

    cfg = load_config()
    assert cfg.front_door, "tpu.env as shipped serves through the front door"
    try:
        yield make, cfg
    finally:
        from tools.serving.frontdoor.instances import stop_all

        stop_all(cfg, grace_s=2)


def _cli(capsys, *args):
    from tools.cli import main

    capsys.readouterr()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _background(*args: str) -> subprocess.Popen:
    """./vllm-t4 ARGS with the stand-in builds, in a process of its own that runs on while the test acts."""
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.stand_ins.switch", "cli", *args], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _until_recorded(proc: subprocess.Popen, instance: str) -> None:
    """Waits until `instance` has a state file (its build launched by `proc`, still loading)."""
    deadline = time.monotonic() + 60
    while not load_config(instance=instance).state_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)


def test_the_shipped_configuration_switches_builds_on_the_port_clients_use_with_no_failed_request(shipped, capsys):
    make, cfg = shipped
    rc, out, err = _cli(capsys, "start", "--model", make("old"), "--served-name", "old")
    assert rc == 0, err
    rt = router_state.recorded(cfg)
    assert rt is not None and rt.port == cfg.port, "the router listens on PORT"
    [blue] = rt.backends
    assert blue.instance == "blue" and blue.base_url != cfg.base_url
    assert f"Serving at {cfg.base_url} (the front door" in out and "on instance blue" in out, out
    old = state.load_state(load_config(instance="blue"))

    rc, out, err = _cli(capsys, "start", "--model", make("again"))
    assert rc == 1 and "already serves" in err and "--replace" in err, err

    with Clients(cfg.base_url) as clients, Clients(cfg.base_url, model="old") as naming:
        rc, out, err = _cli(capsys, "start", "--model", make("new"), "--served-name", "new", "--replace")
        assert rc == 0, err
        # a build that loads but refuses what clients send: the old one keeps the traffic
        rc2, out2, err2 = _cli(capsys, "start", "--model", make("short", "refuse"), "--served-name", "short",
                               "--replace")
    assert "serving new" in out and "in place of old (beside" in out and " 0 failed" in out, out
    assert rc2 == 1 and "--max-model-len than 16" in err2 and "new still serves" in err2, err2
    assert clients.failed() == [] and naming.failed() == [], (clients.failed()[:3], naming.failed()[:3])
    assert clients.served()[-1] == "new" and "old" in clients.served() and naming.served()[-1] == "new"
    assert group_alive(old.pgid) == []
    [green] = router_state.recorded(cfg).backends
    assert green.instance == "green"

    rc, out, err = _cli(capsys, "status")
    assert rc == 0 and f"the front door at {cfg.base_url} answers, over new (instance green, serving)" in out, out
    rc, out, err = _cli(capsys, "query", "hello")
    assert rc == 0 and out.startswith("new"), out  # the stand-in answers with its build's name
    rc, out, err = _cli(capsys, "log", "-n", "5")  # the serving build's log, then the failed start's, kept
    assert rc == 0 and "--- the failed start of short in the last switch" in out, out

    new = state.load_state(load_config(instance="green"))
    router_pid = router_state.recorded(cfg).pid
    rc, out, err = _cli(capsys, "stop")
    assert rc == 0 and "router" in out and out.count("\n") >= 1, out
    assert router_state.recorded(cfg) is None and group_alive(new.pgid) == [] and group_alive(router_pid) == []


def test_an_mcp_client_switches_the_shipped_configuration_the_same_way(shipped, tmp_path):
    from fastmcp import Client

    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    make, cfg = shipped
    old, new = make("old"), make("new")
    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(tmp_path)], [str(tmp_path / "evidence")], environ={})
    server = create_server(Settings(roots=roots), toolsets=["serve"])

    async def call(name, args):
        async with Client(server) as c:
            return await c.call_tool(name, args, raise_on_error=False)

    first = asyncio.run(call("start_vllm_server", {"model": old, "served_name": "old"}))
    assert not first.is_error and "(the front door; the build on instance blue" in first.content[0].text
    with Clients(cfg.base_url) as clients:
        res = asyncio.run(call("start_vllm_server", {"model": new, "served_name": "new", "replace": True}))
        asked = asyncio.run(call("query_model", {"prompt": "hi"}))
    text = res.content[0].text
    assert not res.is_error and "serving new" in text and " 0 failed" in text and "on the CPU stand-in" in text, text
    assert not asked.is_error and "new" in asked.content[0].text, asked.content[0].text
    assert clients.failed() == [] and clients.served()[-1] == "new"
    stopped = asyncio.run(call("stop_vllm_server", {}))
    assert not stopped.is_error and router_state.recorded(cfg) is None, stopped.content[0].text


def test_a_start_and_a_switch_say_what_the_checks_warn(shipped, capsys, tmp_path):
    """A build repacked for bfloat16 served as float16 (tpu.env's CPU_DTYPE): the start serves it and says
    preflight's warning, on the command line and through MCP, for a first start and for a switch."""
    from fastmcp import Client

    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    make, cfg = shipped
    assert cfg.cpu_dtype == "float16"
    old, new = make("old"), make("new")
    for b in (old, new):
        (tmp_path / b / "repack-report.json").write_text(json.dumps({"target_dtype": "bfloat16"}))
    rc, out, err = _cli(capsys, "start", "--model", old, "--served-name", "old")
    assert rc == 0 and "warning: runtime_dtype: " in out and "repacked for bfloat16" in out, (out, err)
    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(tmp_path)], [str(tmp_path / "evidence")], environ={})
    server = create_server(Settings(roots=roots), toolsets=["serve"])

    async def switch():
        async with Client(server) as c:
            return await c.call_tool("start_vllm_server", {"model": new, "served_name": "new", "replace": True},
                                     raise_on_error=False)

    res = asyncio.run(switch())
    text = res.content[0].text
    assert not res.is_error and "serving new" in text and "warning: runtime_dtype: " in text, text
    assert [w.split(":")[0] for w in res.structured_content["warnings"]] == ["runtime_dtype"]


def test_the_front_door_reads_as_the_service_in_preflight_and_status(shipped, capsys):
    """The port check of a start sees the front door started from here (a replace switches behind it), and
    status is healthy (exit 0) only while a build answers behind the door."""
    from tools.serving.preflight.steps import checks_for

    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    [port] = [c for c in checks_for("start") if c.name == "port"]
    assert port.status == "ok" and "is the front door's" in port.value and "over instance blue" in port.value, port
    kill_group(state.load_state(load_config(instance="blue")).pgid)
    rc, out, _ = _cli(capsys, "status")
    assert rc == 3 and f"the front door at {cfg.base_url} answers, over old (instance blue, down)" in out, out


def test_a_door_started_before_front_door_0_was_set_is_still_the_service_on_the_port(shipped, capsys, monkeypatch):
    """FRONT_DOOR=0 set after a door was started: status, query and stop still find the door on PORT (they read
    no server there and left the door and its build running), and a plain start names the door's port."""
    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    blue = state.load_state(load_config(instance="blue"))
    door = router_state.recorded(cfg)
    monkeypatch.setenv("FRONT_DOOR", "0")
    rc, out, err = _cli(capsys, "status")
    assert rc == 0 and f"the front door at {cfg.base_url} answers, over old (instance blue, serving)" in out, out
    rc, out, err = _cli(capsys, "status", "--json")  # the service's process is the door, not nothing
    top = json.loads(out)
    assert rc == 0 and top["alive"] and top["pid"] == door.pid and top["uptime_s"] is not None, out
    rc, out, err = _cli(capsys, "query", "hello", "--max-tokens", "2")
    assert rc == 0, err
    rc, out, err = _cli(capsys, "start", "--model", make("new"), "--served-name", "new")
    assert rc == 1 and "already serves" in err and "--replace" in err, err
    rc, out, err = _cli(capsys, "stop")
    assert rc == 0, (out, err)
    assert group_alive(blue.pgid) == [] and group_alive(door.pgid) == [] and router_state.recorded(cfg) is None


def test_two_replaces_at_once_through_the_front_door_one_switches_the_other_is_refused(shipped, capsys, tmp_path):
    """A second `start --replace` while the first switch runs is refused in one line before it chooses a slot or
    starts anything; the first ends serving its build, no request failing meanwhile."""
    import os
    import subprocess
    import sys
    import time

    from tests.helpers.fixtures import ROOT

    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    env = dict(os.environ, PYTHONPATH=str(ROOT), STAND_IN_PHASES=str(tmp_path), STAND_IN_PAUSE_AT="b ready",
               STAND_IN_GO=str(tmp_path / "go"))
    drive = [sys.executable, "-m", "tests.helpers.stand_ins.switch", "cli", "start", "--replace", "--served-name"]
    with Clients(cfg.base_url) as clients:
        first = subprocess.Popen([*drive, "new", "--model", make("new")], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while not (tmp_path / "b-ready").exists():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.05)
        second = subprocess.run([*drive, "other", "--model", make("other")], cwd=ROOT, env=env, text=True,
                                capture_output=True, timeout=60)
        (tmp_path / "go").touch()
        out, err = first.communicate(timeout=60)
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("vllm-t4 ")]
    assert second.returncode == 1 and len(lines) == 1 and "the front door is being changed" in lines[0], second.stderr
    assert "this start was not done" in lines[0]
    assert first.returncode == 0 and "serving new" in out, err
    assert clients.failed() == [] and clients.served()[-1] == "new"
    assert [b.instance for b in router_state.recorded(cfg).backends] == ["green"]
    assert state.load_state(load_config(instance="blue")) is None  # nothing of the refused start


def test_a_switch_reads_the_router_state_once_per_process_and_plans_the_new_build_once(shipped, capsys, tmp_path,
                                                                                      monkeypatch):
    """`start --replace` on the shipped configuration: the command reads the front door's state once, its switch
    process once more (its own, fresh read) and plans the new build's place once, the plan B launches on."""
    import json

    from tests.helpers.stand_ins.switch import count_calls

    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    counts = tmp_path / "switch-counts.json"
    monkeypatch.setenv("STAND_IN_COUNTS", str(counts))
    here: dict[str, int] = {}
    count_calls(here, monkeypatch.setattr)
    rc, out, err = _cli(capsys, "start", "--model", make("new"), "--served-name", "new", "--replace")
    assert rc == 0 and "in place of old (beside" in out, err
    assert here == {"router_load": 1}, here  # the command plans nothing: its switch process does
    assert json.loads(counts.read_text()) == {"plan": 1, "router_load": 1}


def test_the_doors_build_is_changed_through_the_door_not_by_its_instance_name(shipped, capsys):
    """stop --instance blue or start --instance blue --replace on the build behind the door would leave clients
    without it (or its names): refused in one line naming instance; the door keeps serving."""
    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    rc, _, err = _cli(capsys, "stop", "--instance", "blue")
    assert rc == 2 and "--instance blue serves behind the front door" in err and "./vllm-t4 stop" in err, err
    rc, _, err = _cli(capsys, "start", "--instance", "blue", "--replace", "--model", make("new"))
    assert rc == 2 and "--instance blue serves behind the front door" in err and "--replace" in err, err
    assert state.leader(state.load_state(load_config(instance="blue"))) is not None


def test_a_door_left_with_no_build_is_refilled_by_the_next_start(shipped, capsys):
    """The build behind the door killed (or ended by a switch that failed both ways): the next start puts its
    build behind the same door, and requests sent meanwhile are held and answered."""
    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    old = state.load_state(load_config(instance="blue"))
    kill_group(old.pgid)
    with Clients(cfg.base_url) as clients:
        rc, out, err = _cli(capsys, "start", "--model", make("new"), "--served-name", "new")
    assert rc == 0 and "the front door" in out, err
    assert clients.failed() == [] and clients.served()[-1] == "new"
    rt = router_state.recorded(cfg)
    [b] = rt.backends
    assert state.load_state(load_config(instance=b.instance)).served_name == "new" and "old" in rt.names


def test_a_lock_that_is_a_folder_is_named_and_stop_leaves_the_door_whole(shipped, capsys):
    """A folder at blue/vllm.lock: status and start said "3: it is a folder; give another path", and stop stopped
    the router, then failed on blue's lock and left blue serving behind no door. Each names the lock file and what
    to do; stop stops nothing until it can stop everything."""
    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    lock = load_config(instance="blue").instance_dir / "vllm.lock"
    lock.unlink()
    lock.mkdir()
    rc, out, err = _cli(capsys, "status")
    assert rc == 0 and "over old (instance blue, serving)" in out, (out, err)
    for args in (("start", "--model", make("new"), "--replace"), ("stop",)):
        rc, out, err = _cli(capsys, *args)
        assert rc == 1 and f"lock file {lock} is not a regular file" in err and "delete it" in err, err
        assert len(err.strip().splitlines()) == 1, err
    rt = router_state.recorded(cfg)
    assert rt is not None and router_state.alive(rt) and state.load_state(load_config(instance="blue")) is not None
    rc, out, err = _cli(capsys, "query", "hi")
    assert rc == 0 and out.startswith("old"), (out, err)
    lock.rmdir()
    assert _cli(capsys, "stop")[0] == 0 and router_state.recorded(cfg) is None


def test_two_stops_of_the_front_door_at_once_one_stops_the_other_is_refused(shipped, capsys):
    """Two `stop`s 0.1 s apart both went ahead: the first stopped the router and was refused blue, the second said
    it stopped the router again ("SIGTERM" replaced by None) and stopped blue. One stops the door and its builds;
    the other is refused in one line, nothing done."""
    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old", term_s=3), "--served-name", "old")[0] == 0
    first = _background("stop")
    deadline = time.monotonic() + 30
    while router_state.switch_running(cfg) is None and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    rc, out, err = _cli(capsys, "stop")
    out1, err1 = first.communicate(timeout=60)
    assert first.returncode == 0 and "stopped the router" in out1 and "SIGTERM" in out1, (out1, err1)
    assert rc == 1 and len(err.strip().splitlines()) == 1 and "was not done" in err, err
    assert router_state.recorded(cfg) is None and state.load_state(load_config(instance="blue")) is None


def test_a_door_that_is_gone_is_cleaned_up_by_stop_and_its_builds_refused_by_start(shipped, capsys):
    """The router killed: start refuses to start another build beside the one left (naming it and stop); stop
    ends that build too; then start serves again."""
    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    old = state.load_state(load_config(instance="blue"))
    kill_group(router_state.recorded(cfg).pgid)
    rc, _, err = _cli(capsys, "start", "--model", make("new"))
    assert rc == 1 and "instance blue (old) still runs without the front door" in err and "./vllm-t4 stop" in err, err
    rc, out, err = _cli(capsys, "stop")
    assert rc == 0 and group_alive(old.pgid) == [], (out, err)
    assert _cli(capsys, "start", "--model", make("new"), "--served-name", "new")[0] == 0


def test_a_stop_while_the_front_door_starts_is_refused_not_passed_over(shipped, capsys, tmp_path):
    make, cfg = shipped
    go = tmp_path / "go"
    slow = make("slow", until=str(go))
    first = _background("start", "--model", slow)
    try:
        _until_recorded(first, "blue")
        rc, _, err = _cli(capsys, "stop")
        assert rc == 1 and "the front door is being changed" in err and "this stop was not done" in err, err
    finally:
        go.touch()
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0 and "the front door" in out, err


def test_status_tells_what_runs_through_a_switch_and_after_stop(shipped, capsys, tmp_path):
    """While a switch runs, status names it (its pid and what it does) and says the loading build does not answer while that switch changes it; the
    door's readiness URL (the one for a load balancer in front of it) fails while no build is behind it, as in a
    hold; the status fields read alive and healthy while the door serves through a healthy build; an old build a
    command stops is not reported as died; after stop nothing reads as serving, and the builds' logs are still
    found."""
    import httpx

    from tools.serving.frontdoor import door as frontdoor
    from tools.serving.server import server as vllm_server
    from tools.serving.frontdoor.instances import fleet_status

    make, cfg = shipped
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    ready = f"{cfg.base_url}/readiness"
    assert httpx.get(ready).status_code == 200
    top = fleet_status(cfg)
    assert top.alive and top.healthy and top.served_name == "old" and top.base_url == cfg.base_url, top.message

    rt = router_state.recorded(cfg)
    [blue] = rt.backends
    frontdoor.remove_worker(rt, blue.base_url)  # as a hold leaves the door while the old build stops
    try:
        assert httpx.get(ready).status_code == 503
        rc, out, _ = _cli(capsys, "status")
        assert rc == 3 and "over no build (a request is held up to" in out and "routing" in out, out
    finally:
        frontdoor.add_worker(rt, blue.base_url)
    assert httpx.get(ready).status_code == 200

    go = tmp_path / "go"
    with Clients(cfg.base_url) as clients:
        switch = _background("start", "--replace", "--served-name", "new", "--model", make("new", until=str(go)))
        try:
            _until_recorded(switch, "green")
            rc, out, _ = _cli(capsys, "status")
            assert "a switch of the front door runs (pid" in out and "switch to new on instance green" in out, out
            assert "[green] not answering: new" in out and "while another command changes instance green" in out, out
            assert "running but not healthy" not in out
            assert fleet_status(cfg).replace["running"] and "switch to new" in fleet_status(cfg).replace["what"]
        finally:
            go.touch()
            out, err = switch.communicate(timeout=60)
    assert switch.returncode == 0 and "serving new" in out, err
    assert clients.failed() == []

    # the old build's stop as a command does it, under its instance's lock: a status meanwhile says so, not died
    green_cfg = load_config(instance="green")
    green = state.load_state(green_cfg)
    with state.instance_lock(green_cfg, "stop"):
        kill_group(green.pgid)
        st = vllm_server.server_status(green_cfg)
    assert not st.died and "another command changes instance green" in st.message, st.message
    deadline = time.monotonic() + 30  # the router finds the build gone within 3 of its 2-s checks
    while httpx.get(ready).status_code != 503:
        assert time.monotonic() < deadline, "the door's readiness still 200 with no build answering behind it"
        time.sleep(0.5)
    assert _cli(capsys, "start", "--model", make("again"), "--served-name", "again")[0] == 0  # behind the door again

    rc, out, err = _cli(capsys, "stop")
    assert rc == 0, err
    rc, out, _ = _cli(capsys, "status")
    assert rc == 3 and "nothing serves now" in out and "serving new" not in out and "(new serves)" not in out, out
    rc, out, err = _cli(capsys, "log", "-n", "5")
    assert rc == 0 and "Starting to load model" in out, err
    assert vllm_server.log_path(cfg).parent.name in ("blue", "green"), vllm_server.log_path(cfg)


def test_a_switch_that_finds_the_door_stopped_advises_a_plain_start(shipped):
    """`stop &` then `start --replace`: the switch finds no door (stopped meanwhile) and advises start, not the
    router's own start."""
    from tools.core.errors import ToolFailure
    from tools.serving.frontdoor import door as frontdoor
    from tools.serving.frontdoor.service import build_config

    make, cfg = shipped
    with pytest.raises(ToolFailure) as exc:
        frontdoor.switch(cfg, build_config(cfg, None))
    assert '"start"' in exc.value.message and "router.start" not in exc.value.message, exc.value.message


def test_a_start_that_loses_to_a_starting_door_names_the_winner(shipped, capsys, tmp_path):
    """Starts at once: the loser is refused naming the start that runs, never told its build (still starting)
    was left by a door that is gone."""
    make, cfg = shipped
    go = tmp_path / "go"
    first = _background("start", "--model", make("slow", until=str(go)))
    try:
        _until_recorded(first, "blue")
        rc, _, err = _cli(capsys, "start", "--model", make("other"))
        assert rc == 1 and "the front door is being changed (pid" in err and "this start was not done" in err, err
        assert "without the front door" not in err
    finally:
        go.touch()
        out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err


def test_a_switch_that_would_change_the_clients_key_is_refused_unless_told(shipped, capsys, monkeypatch):
    """The door's build answers to key K1 and clients send it: a switch started with K2 (or with a key where the
    build takes none) is refused in one line naming VLLM_API_KEY, nothing changed and no request refused;
    --new-key switches, and then the new key is the one answered."""
    import httpx

    make, cfg = shipped
    k1, k2 = "k1-" + "a" * 24, "k2-" + "b" * 24
    monkeypatch.setenv("VLLM_API_KEY", k1)
    assert _cli(capsys, "start", "--model", make("old"), "--served-name", "old")[0] == 0
    with Clients(cfg.base_url, key=k1) as clients:
        clients.flowing()
        monkeypatch.setenv("VLLM_API_KEY", k2)
        rc, _, err = _cli(capsys, "start", "--model", make("new"), "--served-name", "new", "--replace")
    [line] = [ln for ln in err.splitlines() if ln.startswith("vllm-t4 ")]
    assert rc == 2 and "VLLM_API_KEY" in line and "--new-key" in line, err
    assert clients.failed() == [] and set(clients.served()) == {"old"}
    assert [b.instance for b in router_state.recorded(cfg).backends] == ["blue"]
    rc, out, err = _cli(capsys, "start", "--model", make("new"), "--served-name", "new", "--replace", "--new-key")
    assert rc == 0 and "serving new" in out, err
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for key, code in ((k2, 200), (k1, 401)):
        r = httpx.post(f"{cfg.base_url}/v1/chat/completions", json=chat, timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == code, (key, r.text)
