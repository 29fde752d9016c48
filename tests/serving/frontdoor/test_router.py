"""Two tiny-model instances side by side on vLLM's CPU backend (each its own port, KV space and core), token
identity between them live and through record/check, vllm-router in front, a sweep through the router reaching
both, and `stop --all` leaving no process. Instance a is started with the command line, b through the MCP tool."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.fixtures import ROOT, SERVE_MAX_MODEL_LEN, free_port, group_alive, in_process_engine

pytestmark = [pytest.mark.vllm, pytest.mark.vllm_lane(0)]  # lane 0: evens out the two lanes


def _cli(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)



class Fleet:
    def __init__(self, state: Path, env: dict[str, str], mcp, evidence: Path, ports: dict[str, int]):
        self.state, self.env, self.mcp, self.evidence, self.ports = state, env, mcp, evidence, ports
        self.pgids: list[int] = []

    def call(self, tool: str, args: dict):
        from fastmcp import Client

        async def go():
            async with Client(self.mcp) as c:
                return (await c.call_tool(tool, args)).structured_content

        return asyncio.run(go())


@pytest.fixture(scope="module")
def fleet(emb4_build, tmp_path_factory):
    from tools.mcp.app import Settings, create_server
    from tools.core.paths import Roots

    base = tmp_path_factory.mktemp("fleet")
    state, evidence = base / "run", base / "evidence"
    evidence.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), STATE_DIR=str(state), MODEL_NAME=str(emb4_build),
               SERVED_MODEL_NAME="tiny", MAX_MODEL_LEN=str(SERVE_MAX_MODEL_LEN), MAX_NUM_SEQS="8",
               CPU_KVCACHE_SPACE_GIB="1", SPECULATIVE_CONFIG="", EXTRA_ARGS="", START_TIMEOUT_S="900")
    overrides = {"state_dir": str(state), "cpu_kvcache_space_gib": 1, "speculative_config": "", "extra_args": "",
                 "max_num_seqs": 8}
    mcp = create_server(Settings(roots=Roots.from_env([str(emb4_build.parent)], [str(evidence)], environ={}),
                                 config_overrides=overrides), toolsets="all")
    f = Fleet(state, env, mcp, evidence, {"a": free_port(), "b": free_port(), "router": free_port()})
    mp = pytest.MonkeyPatch()
    in_process_engine(mp)  # both starts (the command line's and MCP's): the fleet's checks are not vLLM's processes
    env.update({k: os.environ[k] for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS") if k in os.environ})
    try:
        a = _cli(["start", "--instance", "a", "--port", str(f.ports["a"]), "--json"], env, timeout=1200)
        assert a.returncode == 0, a.stderr[-3000:]
        f.pgids.append(json.loads(a.stdout)["pgid"])
        b = f.call("start_vllm_server", {"instance": "b", "port": f.ports["b"], "model": str(emb4_build),
                                         "served_name": "tiny", "max_model_len": SERVE_MAX_MODEL_LEN})
        f.pgids.append(b["pgid"])
        yield f
    finally:
        mp.undo()
        _cli(["stop", "--all", "--grace", "5"], env, timeout=300)


def test_two_instances_side_by_side(fleet):
    st = _cli(["status", "--json"], fleet.env, timeout=120)
    assert st.returncode == 0, st.stdout + st.stderr  # every instance reported is healthy
    data = json.loads(st.stdout)
    inst = {i["instance"]: i for i in data["instances"]}
    assert set(inst) == {"a", "b"} and data["all_healthy"]
    assert inst["a"]["base_url"].endswith(f":{fleet.ports['a']}") and inst["b"]["base_url"].endswith(
        f":{fleet.ports['b']}")
    assert all(i["kv_cache_tokens"] > 0 for i in inst.values())  # each its own KV space (1 GiB each)
    cores_a = {c for r in inst["a"]["cpu_cores"] for c in r}
    cores_b = {c for r in inst["b"]["cpu_cores"] for c in r}
    assert cores_a and cores_b and not cores_a & cores_b  # no two instances bound to one core
    assert list((fleet.state / "a").glob("vllm-*.log")) and (fleet.state / "b" / "vllm.json").is_file()
    assert not (fleet.state / "vllm.json").exists()  # the default instance is not involved
    q = _cli(["query", "abcdef", "--max-tokens", "4", "--instance", "b", "--json"], fleet.env, timeout=120)
    assert q.returncode == 0 and json.loads(q.stdout)["usage"]["completion_tokens"] >= 1
    log = _cli(["log", "--instance", "a", "-n", "3"], fleet.env, timeout=60)
    assert log.returncode == 0 and len(log.stdout.rstrip("\n").splitlines()) == 3
    # A third instance finds its port free but, on a 2-core machine, no free core.
    if len(os.sched_getaffinity(0)) == 2:
        c = _cli(["start", "--instance", "c", "--port", str(free_port())], fleet.env, timeout=120)
        assert c.returncode == 1 and "no free CPU core" in c.stderr and not (fleet.state / "c").exists()


def test_compare_live_between_instances_matches_record_then_check(fleet):
    live = _cli(["compare", "live", "a", "b", "--max-tokens", "16", "--json"], fleet.env, timeout=600)
    assert live.returncode == 0, live.stderr[-2000:]
    lv = json.loads(live.stdout)
    assert lv["total"] == 8 and f":{fleet.ports['a']}" in lv["reference"] and f":{fleet.ports['b']}" in lv["candidate"]
    ref = fleet.evidence / "a.json"
    rec = _cli(["compare", "record", "--instance", "a", "--out", str(ref), "--max-tokens", "16"], fleet.env,
               timeout=600)
    assert rec.returncode == 0, rec.stderr[-2000:]
    chk = _cli(["compare", "check", str(ref), "--instance", "b", "--json"], fleet.env, timeout=600)
    assert chk.returncode == 0, chk.stderr[-2000:]
    ck = json.loads(chk.stdout)
    # One build in two instances: the same verdicts either way (greedy, identical weights).
    assert [p["verdict"] for p in lv["prompts"]] == [p["verdict"] for p in ck["prompts"]]
    assert lv["identical"] == ck["identical"] == 8


def test_router_in_front_and_a_sweep_through_it(fleet):
    r = _cli(["router", "start", "--instances", "a,b", "--port", str(fleet.ports["router"]), "--json"], fleet.env,
             timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    started = json.loads(r.stdout)
    fleet.pgids.append(started["pgid"])
    assert [b["instance"] for b in started["backends"]] == ["a", "b"]
    st = _cli(["router", "status", "--json"], fleet.env, timeout=60)
    assert st.returncode == 0 and json.loads(st.stdout)["backends_healthy"] == {"a": True, "b": True}
    again = _cli(["router", "start", "--instances", "a"], fleet.env, timeout=60)
    assert again.returncode == 1 and "already running" in again.stderr

    sw = _cli(["sweep", "--router", "--input-lens", "32", "--output-len", "8", "--concurrency", "2",
               "--repeats", "1", "--min-prompts", "6", "--prompts-per-concurrency", "3", "--no-warmup",
               "--label", "routed", "--out", str(fleet.evidence), "--json"], fleet.env, timeout=900)
    assert sw.returncode == 0, sw.stderr[-3000:]
    res = json.loads(sw.stdout)
    assert [c["status"] for c in res["cells"]] == ["ok"]
    prov = json.loads((Path(res["run_dir"]) / "provenance.json").read_text())
    ep = prov["endpoint"]
    assert ep["kind"] == "router" and ep["base_url"].endswith(f":{fleet.ports['router']}")
    assert [b["instance"] for b in ep["backends"]] == ["a", "b"]
    assert ep["requests"]["a"] > 0 and ep["requests"]["b"] > 0  # round robin reached both backends
    assert ep["requests"]["a"] + ep["requests"]["b"] >= 6


def test_mcp_status_then_stop_all_leaves_no_process(fleet):
    status = fleet.call("server_status", {})
    assert {i["instance"] for i in status["instances"]} == {"a", "b"}
    assert status["router"] is None or status["router"]["alive"]
    live = fleet.call("compare_tokens", {"mode": "live", "instance": "a", "other_instance": "b", "max_tokens": 8})
    assert live["total"] == 8 and live["identical"] == 8
    one = fleet.call("server_status", {"instance": "b"})
    assert one["alive"] and one["healthy"] and one["instance"] == "b"
    stop_b = fleet.call("stop_vllm_server", {"instance": "b", "grace_s": 10})
    assert stop_b["was_running"] and not (fleet.state / "b" / "vllm.json").exists()
    assert fleet.call("server_status", {"instance": "a"})["healthy"]  # a is untouched
    out = _cli(["stop", "--all", "--json"], fleet.env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert all(group_alive(g) == [] for g in fleet.pgids)
    assert not list(fleet.state.rglob("*.json"))  # no state file left: instances and router
    gone = _cli(["status", "--json"], fleet.env, timeout=60)
    assert gone.returncode == 3 and json.loads(gone.stdout)["instances"] == []
