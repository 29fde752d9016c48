"""Named instances and the router without vLLM: every bad input is one line, exit 2, nothing launched, no state
file changed. "Running" instances here are real processes (`sleep`) with state files, as start would write."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.fixtures import ROOT, stand_in_t4_hardware, free_port, state_env
from tools.core.commands import CLI
from tools.core.errors import ToolFailure
from tools.serving.config import load_config
from tools.core.errors import BadInput


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()
            and p.name != ".instances.lock"} if d.exists() else {}


def _vllm_children() -> set[int]:
    out = set()
    for c in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(c.cmdline())
        except psutil.Error:
            continue
        if "api_server" in cmd or "vllm-router" in cmd:
            out.add(c.pid)
    return out


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def _vllm_children_before():
    """The servers already running when a test starts (the session's shared ones, in a whole-suite run)."""
    _BEFORE.clear()
    _BEFORE.update(_vllm_children())
    yield


def _no_vllm_child() -> bool:
    """This test started no vLLM server and no router."""
    return not (_vllm_children() - _BEFORE)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "", "a b", "-a", "x" * 33, "a;b", "ä"])
def test_bad_instance_name_is_refused_in_one_line(tmp_path, name, capsys, monkeypatch):
    env = state_env(tmp_path / "run")
    flag = f"--instance={name}"
    every = [["start", flag], ["status", flag], ["stop", flag], ["log", flag], ["query", "hi", flag]]
    if name == "../x":  # every command, each as the script
        for args in every:
            r = _cli(args, env)
            assert r.returncode == 2, (args, r.stderr)
            assert len(r.stderr.strip().splitlines()) == 1 and "not a valid instance name" in r.stderr, r.stderr
    else:  # the other names through the same main(), in this process
        from tools.cli import main

        monkeypatch.setenv("STATE_DIR", str(tmp_path / "run"))
        assert main(every[0]) == 2
        err = capsys.readouterr().err
        # an empty name is refused by the rule every string option keeps, before the instance's own check
        why = "--instance: must not be empty" if name == "" else "not a valid instance name"
        assert len(err.strip().splitlines()) == 1 and why in err, err
    assert not (tmp_path / "run").exists()  # nothing written, not even the state dir


def test_instance_paths_and_the_default_instance_unchanged(tmp_path):
    cfg = load_config(ROOT / "tpu.env", state_dir=tmp_path)
    assert cfg.state_file == tmp_path / "vllm.json" and cfg.log_file == tmp_path / "vllm.log"
    a = load_config(ROOT / "tpu.env", state_dir=tmp_path, instance="a")
    assert a.state_file == tmp_path / "a" / "vllm.json" and a.log_file == tmp_path / "a" / "vllm.log"
    assert load_config(ROOT / "tpu.env", state_dir=tmp_path, instance="default").instance == ""


def test_port_of_a_running_instance_is_refused(tmp_path, fleet):
    port = free_port()
    fleet("a", port)
    before = _snapshot(tmp_path / "run")
    r = _cli(["start", "--instance", "b", "--port", str(port)], state_env(tmp_path / "run"))
    assert r.returncode == 2 and f"port {port} is held by instance 'a'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1  # the one-line reason (no "starting" notice before it)
    assert _snapshot(tmp_path / "run") == before and not (tmp_path / "run" / "b").exists()


def test_cpu_cores_one_per_instance_then_refused(tmp_path, fleet):
    from tools.serving.frontdoor import instances
    from tools.serving.preflight.hardware import Hardware
    from tools.serving.server.server import start_server

    class TwoCores(Hardware):
        def platform(self):
            return "cpu"

        def cpu_cores(self):
            return [0, 1]

    hw = TwoCores()
    cfg = lambda name, **kw: load_config(ROOT / "tpu.env", state_dir=tmp_path / "run", instance=name, **kw)  # noqa: E731
    assert instances.plan(cfg(None), hw).cpu_cores is None  # the default instance alone: vLLM's own binding
    assert instances.plan(cfg("a"), hw).cpu_cores == [[0]]
    fleet("a", free_port(), cpu_cores=[[0]])
    planned = instances.plan(cfg("b"), hw)
    assert planned.cpu_cores == [[1]]
    assert planned.server_env("cpu")["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    fleet("b", free_port(), cpu_cores=[[1]])
    before = _snapshot(tmp_path / "run")
    with pytest.raises(ToolFailure, match="no free CPU core for another instance") as exc:
        start_server(cfg("c", port=free_port()), hardware=hw)
    assert "\n" not in str(exc.value) and _no_vllm_child()
    assert _snapshot(tmp_path / "run") == before
    with pytest.raises(BadInput) as refused:
        instances.plan(cfg("c", cpus=2), hw)
    assert refused.value.render(CLI).startswith("--cpus 2: only 0 of 2 cores are free"), refused.value
    # An unbound default instance (started alone) holds every core: a named one is refused while it runs.
    fleet("default", free_port())
    with pytest.raises(ToolFailure, match="no free CPU core"):
        instances.plan(cfg("d"), hw)


def test_a_plan_made_under_the_placement_lock_stands_only_while_that_hold_does(tmp_path, fleet):
    """A switch plans its new build's place under the placement lock and hands that hold to the build's start:
    the start launches on that plan and lets the lock go with its block. Another start waits meanwhile; a hold
    let go is not used again: another start may have taken the cores since, so the plan is made anew."""
    import fcntl

    from tests.helpers.serving import TwoCores
    from tools.serving.records import placement

    hw = TwoCores()
    cfg = load_config(ROOT / "tpu.env", state_dir=tmp_path / "run", instance="a")

    def locked_elsewhere() -> bool:  # a descriptor of its own, as another start's: flock refuses it too
        with open(tmp_path / "run" / ".instances.lock", "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    with placement.locked(cfg) as hold:
        planned = hold.plan(cfg, hw)
        assert planned.cpu_cores == [[0]] and locked_elsewhere()
        with placement.locked(cfg) as joined:  # a block inside it in this thread joins it, not waits for it
            assert joined is hold
        assert hold.held and hold.plan(cfg, hw) is planned  # planned once
        with placement.locked(cfg, hold) as handed:  # handed over: let go with that block
            assert handed is hold
        assert not hold.held and not locked_elsewhere()
    with pytest.raises(RuntimeError, match="no longer held"):
        hold.plan(cfg, hw)
    fleet("x", free_port(), cpu_cores=[[0]])  # another start took core 0 since
    with placement.locked(cfg, hold) as fresh:
        assert fresh is not hold and fresh.plan(cfg, hw).cpu_cores == [[1]]


def test_cpu_parallelism_needs_a_core_per_rank(tmp_path):
    from tools.serving.frontdoor import instances
    from tools.serving.preflight.hardware import Hardware

    class TwoCores(Hardware):
        def platform(self):
            return "cpu"

        def cpu_cores(self):
            return [0, 1]

    cfg = load_config(ROOT / "tpu.env", state_dir=tmp_path, tensor_parallel_size=2)
    planned = instances.plan(cfg, TwoCores())
    assert planned.cpu_cores == [[0], [1]] and "--tensor-parallel-size" in planned.vllm_argv("cpu")
    assert planned.server_env("cpu")["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    with pytest.raises(BadInput, match="4 vLLM ranks need a core each"):
        instances.plan(load_config(ROOT / "tpu.env", state_dir=tmp_path, tensor_parallel_size=2,
                                   data_parallel_size=2), TwoCores())


def test_gpu_room_and_parallelism_on_a_t4(tmp_path, fleet):
    from tools.serving.frontdoor import instances

    hw = stand_in_t4_hardware()()
    cfg = lambda name, **kw: load_config(ROOT / "tpu.env", state_dir=tmp_path / "run", instance=name, **kw)  # noqa: E731
    fleet("a", free_port(), platform="cuda", gpus=[0], gpu_memory_utilization=0.6)
    with pytest.raises(ToolFailure, match="GPU 0 has no room .* a 0.6 already claim 0.6 of it; pass at most 0.40"):
        instances.plan(cfg("b", gpu_memory_utilization=0.5), hw)
    ok = instances.plan(cfg("b", gpu_memory_utilization=0.4), hw)
    assert ok.gpus == [0] and ok.server_env("cuda")["CUDA_VISIBLE_DEVICES"] == "0"
    with pytest.raises(BadInput) as refused:
        instances.plan(cfg("b", gpus=[1]), hw)
    assert refused.value.render(CLI).startswith("--gpus 1: this machine has GPUs 0..0"), refused.value
    with pytest.raises(BadInput, match="DATA_PARALLEL_SIZE=2 needs 2 GPUs, 1 visible"):
        instances.plan(cfg("b", data_parallel_size=2), hw)
    # On a 4-T4 VM a new instance without --gpus takes the least claimed GPU.
    four = stand_in_t4_hardware()()
    four.gpu_count = lambda: 4
    assert instances.plan(cfg("b"), four).gpus == [1]
    assert instances.plan(cfg("b", tensor_parallel_size=2), four).gpus == [1, 2]
    argv = load_config(ROOT / "tpu.env", tensor_parallel_size=2, data_parallel_size=2).vllm_argv("cuda")
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and "--data-parallel-size" in argv


def test_data_parallel_beyond_the_gpus_from_the_cli(cli_here, tmp_path):
    env = state_env(tmp_path / "run", DATA_PARALLEL_SIZE="3")
    r = cli_here(["start", "--instance", "a", "--port", str(free_port())], env)
    # On this machine (no GPU: the CPU path) three ranks need three free cores; on a GPU machine three GPUs.
    if (os.cpu_count() or 1) < 3:
        assert r.returncode == 2 and "3 vLLM ranks" in r.stderr, r.stderr
        assert not (tmp_path / "run" / "a").exists()


def test_router_over_an_instance_not_running(cli_here, tmp_path, fleet):
    fleet("a", free_port())
    env = state_env(tmp_path / "run")
    before = _snapshot(tmp_path / "run")
    r = cli_here(["router", "start", "--instances", "a,b"], env)
    assert r.returncode == 2 and "instance 'b' is not running (running: a)" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli_here(["router", "start", "--instances", "a", "--policy", "fastest"], env)
    assert r.returncode == 2 and "fastest" in r.stderr
    assert _snapshot(tmp_path / "run") == before and _no_vllm_child()
    st = cli_here(["router", "status"], env)
    assert st.returncode == 3 and "no router running" in st.stdout


def test_status_lists_every_instance_and_fails_unless_all_healthy(cli_here, tmp_path, fleet):
    fleet("a", free_port(), cpu_cores=[[0]])
    fleet("b", free_port(), cpu_cores=[[1]])
    r = cli_here(["status", "--json"], state_env(tmp_path / "run"))
    data = json.loads(r.stdout)
    assert r.returncode == 3  # alive (the sleeps) but nothing answers /health
    assert [i["instance"] for i in data["instances"]] == ["a", "b"]
    assert all(i["alive"] and not i["healthy"] for i in data["instances"]) and data["all_healthy"] is False
    assert data["instances"][1]["cpu_cores"] == [[1]]
    one = cli_here(["status", "--instance", "a", "--json"], state_env(tmp_path / "run"))
    assert one.returncode == 3 and json.loads(one.stdout)["instance"] == "a"


def test_status_reports_the_served_models_memory_as_vram_status_does(cli_here, tmp_path, fleet):
    """On a CPU, status (and --json) gives the server's host memory, RSS and PSS of its processes, with the
    method, as vram_status's host figures."""
    from tools.gpu.vram import host_memory

    st = fleet("a", free_port())
    one = cli_here(["status", "--instance", "a", "--json"], state_env(tmp_path / "run"))
    mem = json.loads(one.stdout)["memory"]
    assert mem["kind"] == "host" and mem["pids"] == [st["pid"]] and mem["rss_mib"] > 0
    assert "psutil memory_info().rss" in mem["method"]
    assert mem["rss_mib"] == pytest.approx(host_memory("a", {st["pid"]}).rss_mib, rel=0.5)
    text = cli_here(["status", "--instance", "a"], state_env(tmp_path / "run")).stdout
    assert "  host memory a: RSS " in text and "(psutil memory_info().rss" in text


def test_stop_all_and_one_instance(cli_here, tmp_path, fleet):
    a = fleet("a", free_port())
    b = fleet("b", free_port())
    env = state_env(tmp_path / "run")
    r = cli_here(["stop", "--instance", "a", "--grace", "5"], env)
    assert r.returncode == 0, r.stderr
    assert not psutil.pid_exists(a["pid"]) or psutil.Process(a["pid"]).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "run" / "b" / "vllm.json").exists()
    r = cli_here(["stop", "--all", "--json"], env)
    assert r.returncode == 0, r.stderr
    stopped = json.loads(r.stdout)["stopped"]
    assert [s["was_running"] for s in stopped] == [False, True]  # no router, then b
    assert not (tmp_path / "run" / "b" / "vllm.json").exists()
    assert cli_here(["stop", "--all", "--instance", "a"], env).returncode == 2


def test_endpoint_choice_is_one_of_three(cli_here, tmp_path, fleet):
    from tools.measure.endpoint import EndpointParams, resolve_endpoint

    cfg = load_config(ROOT / "tpu.env", state_dir=tmp_path / "run")
    with pytest.raises(BadInput, match="base_url and instance exclude each other"):
        resolve_endpoint(EndpointParams(base_url="http://x:1", instance="a"), cfg)
    with pytest.raises(ToolFailure, match="no router is running"):
        resolve_endpoint(EndpointParams(router=True), cfg)
    with pytest.raises(BadInput, match="instance 'a' is not running"):
        resolve_endpoint(EndpointParams(instance="a"), cfg)
    assert resolve_endpoint(EndpointParams(), cfg).kind == "config"
    with pytest.raises(ToolFailure, match="no vLLM server is running"):
        resolve_endpoint(EndpointParams(), cfg, managed=True)
    port = free_port()
    fleet("a", port)
    ep = resolve_endpoint(EndpointParams(instance="a"), cfg)
    assert (ep.kind, ep.name, ep.base_url) == ("instance", "a", f"http://127.0.0.1:{port}")
    with pytest.raises(ToolFailure, match=r"as the default instance \(running: a; pass instance\)"):
        resolve_endpoint(EndpointParams(), cfg, managed=True)
    r = cli_here(["sweep", "--instance", "a", "--router"], state_env(tmp_path / "run"))
    assert r.returncode == 2 and "instance and router exclude each other" in r.stderr


def test_mcp_tools_take_an_instance(tmp_path, fleet):
    from fastmcp import Client
    from fastmcp.exceptions import ToolError

    from tools.mcp.app import Settings, create_server
    from tools.core.paths import Roots

    roots = Roots.from_env([str(tmp_path)], [str(tmp_path)], environ={})
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}),
                        toolsets="all")
    a = fleet("a", free_port())

    async def go():
        async with Client(mcp) as c:
            out = {"status": (await c.call_tool("server_status", {})).structured_content,
                   "one": (await c.call_tool("server_status", {"instance": "a"})).structured_content}
            with pytest.raises(ToolError, match="not a valid instance name"):
                await c.call_tool("server_status", {"instance": "../a"})
            with pytest.raises(ToolError, match="instance 'b' is not running"):
                await c.call_tool("start_router", {"instances": ["a", "b"]})
            with pytest.raises(ToolError, match="instance 'b' is not running"):
                await c.call_tool("query_model", {"prompt": "hi", "instance": "b"})
            out["vram"] = (await c.call_tool("vram_status", {})).structured_content
            out["stop"] = (await c.call_tool("stop_vllm_server", {"instance": "a", "grace_s": 5})).structured_content
            out["router"] = (await c.call_tool("router_status", {})).structured_content
            return out

    out = asyncio.run(go())
    assert [i["instance"] for i in out["status"]["instances"]] == ["a"]
    assert out["one"]["instance"] == "a" and out["one"]["alive"] and out["one"]["pid"] == a["pid"]
    assert out["vram"]["available"] is False or a["pid"] in out["vram"]["server_pids"]
    assert out["stop"]["was_running"] and out["stop"]["pid"] == a["pid"]
    assert out["router"]["alive"] is False


def test_vram_marks_each_instances_processes(tmp_path, fleet):
    from tests.helpers.stand_ins.nvml import T4_TOTAL, StandInNvml
    from tools.gpu.vram import MIB, vram_status
    from tools.serving.records.placement import process_owners

    a = fleet("a", free_port(), platform="cuda", gpus=[0], gpu_memory_utilization=0.45)
    b = fleet("b", free_port(), platform="cuda", gpus=[0], gpu_memory_utilization=0.45)
    owners = process_owners(load_config(ROOT / "tpu.env", state_dir=tmp_path / "run"))
    assert owners[a["pid"]] == "a" and owners[b["pid"]] == "b"
    stand_in = StandInNvml([{"name": "Tesla T4", "total": T4_TOTAL, "used": 6000 * MIB, "util": 10,
                             "compute": [(a["pid"], 3000 * MIB), (b["pid"], 2900 * MIB), (1, 100 * MIB)]}])
    st = vram_status(nvml=stand_in, owners=owners)
    procs = {p.pid: p for p in st.gpus[0].processes}
    assert (procs[a["pid"]].instance, procs[b["pid"]].instance, procs[1].instance) == ("a", "b", None)
    assert procs[a["pid"]].is_vllm_server and not procs[1].is_vllm_server and st.server_used_mib == 5900


def test_router_lifecycle_over_stand_in_workers(tmp_path, fleet):
    """vllm-router itself over two stand-in servers: started only over running instances, ready when it routes,
    requests spread over both (the /metrics deltas a sweep records), stopped with its whole group."""
    import httpx

    from tools.serving.frontdoor import router
    from tools.measure.endpoint import request_counts

    pa, pb, pr = free_port(), free_port(), free_port()
    fleet("a", pa, serve=True)
    fleet("b", pb, serve=True)
    for port in (pa, pb):  # the stand-ins listen
        for _ in range(100):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
    env = state_env(tmp_path / "run")
    # Another router on the machine (another checkout, a CI job) holds vllm-router's default metrics port: each
    # router gets a free one of its own, or the second panics on 29000.
    held = socket.socket()
    try:
        held.bind(("127.0.0.1", 29000))
        held.listen()
    except OSError:  # already held by something else: the same situation
        pass
    try:
        r = _cli(["router", "start", "--instances", "a,b", "--port", str(pr), "--json"], env)
    finally:
        held.close()
    assert r.returncode == 0, r.stderr
    started = json.loads(r.stdout)
    metrics_port = started["argv"][started["argv"].index("--prometheus-port") + 1]
    assert metrics_port != "29000"
    try:
        assert [b["instance"] for b in started["backends"]] == ["a", "b"]
        assert (tmp_path / "run" / "router.json").is_file() and (tmp_path / "run" / "router.log").is_file()
        clash = _cli(["start", "--instance", "c", "--port", str(pr)], env)
        assert clash.returncode == 2 and "held by the router" in clash.stderr
        backends = [{"instance": "a", "base_url": f"http://127.0.0.1:{pa}"},
                    {"instance": "b", "base_url": f"http://127.0.0.1:{pb}"}]
        before = request_counts(backends)
        for _ in range(6):
            out = httpx.post(f"http://127.0.0.1:{pr}/v1/completions", json={"model": "m", "prompt": "x",
                                                                           "max_tokens": 1}, timeout=30)
            assert out.status_code == 200, out.text
        after = request_counts(backends)
        assert after["a"] - before["a"] > 0 and after["b"] - before["b"] > 0  # round robin reached both
        st = _cli(["router", "status", "--json"], env)
        assert st.returncode == 0 and json.loads(st.stdout)["backends_healthy"] == {"a": True, "b": True}
        status = _cli(["status", "--json"], env)
        assert json.loads(status.stdout)["router"]["alive"]
    finally:
        stop = _cli(["stop", "--all", "--json"], env)
    assert stop.returncode == 0, stop.stderr
    assert json.loads(stop.stdout)["stopped"][0]["was_running"]
    assert not psutil.pid_exists(started["pid"]) or psutil.Process(started["pid"]).status() == psutil.STATUS_ZOMBIE
    assert not list((tmp_path / "run").rglob("*.json"))
    assert router.router_status(load_config(ROOT / "tpu.env", state_dir=tmp_path / "run")).alive is False


def test_status_does_not_list_the_default_instance_again(cli_here, tmp_path, fleet):
    """The default instance is the top level of status; `instances` holds the named ones only."""
    fleet("default", free_port())
    fleet("a", free_port(), cpu_cores=[[0]])
    r = cli_here(["status", "--json"], state_env(tmp_path / "run"))
    data = json.loads(r.stdout)
    assert data["alive"] and data["instance"] == "default"
    assert [i["instance"] for i in data["instances"]] == ["a"] and data["all_healthy"] is False
    text = cli_here(["status"], state_env(tmp_path / "run")).stdout
    assert text.count("[default]") == 1 and text.count("[a]") == 1


def test_a_chosen_port_is_free_and_outside_the_ephemeral_range(monkeypatch):
    """A port handed to a server that binds it tens of seconds later is not one the kernel may give meanwhile to
    another process's outgoing connection: it comes from below the ephemeral range, and is free now."""
    from tools.core import process

    low = process._ephemeral_low()
    ports = {process.free_port() for _ in range(20)}
    assert all(process._FIRST_CHOSEN_PORT <= p < low for p in ports), (low, ports)
    assert all(process.port_holder("127.0.0.1", p) is None for p in ports)
    with socket.socket() as held:  # a port held now is never chosen
        held.bind(("127.0.0.1", min(ports)))
        held.listen()
        monkeypatch.setattr(process.random, "sample", lambda r, k: [min(ports)])
        assert process.free_port() != min(ports)
