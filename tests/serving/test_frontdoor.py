"""The front door (vllm-router on the client port, builds as named instances behind it) through a switch, with
a bounded loop of chat completions running through it the whole time: a good switch with both builds side by
side, a build that exits, a build that answers but refuses what clients send, and the same on a machine too
small for two (the front door holds requests while the old build stops and the new one loads). After each:
no failed request, the right build answering, its figures, no process of a stopped build left. The builds are
tests/stand_in_vllm.py; the router is the real vllm-router. A two-core CPU is stood in (Hardware)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import psutil
import pytest

from tests import stand_in_vllm
from tests.fixtures import free_port, group_alive
from tools.core.errors import ToolFailure
from tools.serving import frontdoor, router_state, state
from tools.serving.config import ServeConfig
from tools.serving.hardware import Hardware
from tools.serving.router import start_router, stop_router
from tools.serving.vllm_server import start_server, stop_server


class TwoCores(Hardware):
    def platform(self):
        return "cpu"

    def cpu_cores(self):
        return [0, 1]


class Clients:
    """Chat completions through the front door from two threads until stopped: what each got."""

    def __init__(self, url: str):
        self.url, self.results, self._stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def _run(self):
        with httpx.Client(timeout=120.0) as c:
            while not self._stop.is_set():
                t = time.monotonic()
                try:
                    r = c.post(f"{self.url}/v1/chat/completions", json={
                        "model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
                    got = (r.status_code, r.json()["choices"][0]["message"]["content"] if r.status_code == 200
                           else r.text[:200])
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    got = (0, repr(exc))
                self.results.append((*got, time.monotonic() - t))
                time.sleep(0.05)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self.threads:
            t.join(timeout=150)

    def failed(self):
        return [r for r in self.results if r[0] != 200]

    def served(self):
        return [r[1] for r in self.results if r[0] == 200]


@pytest.fixture
def door(tmp_path, monkeypatch, serve_config_factory):
    """door(a_mode="serve") -> (front-door config, make(instance, name, mode, cpus)); the router over build
    `old` on instance blue."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(self.port, self.model))
    hw = TwoCores()
    base = serve_config_factory(tmp_path, "front", state_dir=tmp_path / "run", start_timeout_s=30.0)
    made: list[ServeConfig] = []

    def make(instance: str, name: str, mode: str = "serve", cpus: int = 1, **spec) -> ServeConfig:
        model = tmp_path / name
        model.mkdir(exist_ok=True)
        (model / "behaviour.json").write_text(json.dumps({"mode": mode, **spec}))
        (model / "config.json").write_text("{}")
        (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
        cfg = serve_config_factory(model, name, state_dir=tmp_path / "run", instance=instance, cpus=cpus,
                                   port=free_port(), start_timeout_s=30.0)
        made.append(cfg)
        return cfg

    a = make("blue", "old")
    start_server(a, hardware=hw)
    start_router(base, ["blue"], port=free_port(), hold_s=30.0)
    make.hw = hw
    yield base, make
    stop_router(base, grace_s=5)
    for cfg in made:
        stop_server(cfg, grace_s=2)


def _front(base: ServeConfig) -> str:
    return router_state.recorded(base).base_url


def test_a_good_switch_beside_the_old_build_fails_no_request(door):
    base, make = door
    old = state.load_state(_instance(base, "blue"))
    b = make("green", "new")
    with Clients(_front(base)) as clients:
        time.sleep(0.5)
        res = frontdoor.switch(base, b, hardware=make.hw)
        time.sleep(0.5)
    assert res.outcome == "serving new" and res.replaced == "old" and res.mode == "beside"
    assert "no request waits for a load" in res.announced
    assert clients.failed() == [] and clients.served()[-1] == "new" and "old" in clients.served()
    assert res.figures.requests and res.figures.failed == 0 and res.figures.longest_wait_s == 0
    assert [x.instance for x in router_state.recorded(base).backends] == ["green"]
    assert frontdoor.workers(router_state.recorded(base)) == [res.backend]
    assert group_alive(old.pgid) == [] and not _instance(base, "blue").state_file.exists()


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


def test_a_machine_too_small_for_two_holds_requests_while_the_new_build_loads(door):
    base, make = door
    old = state.load_state(_instance(base, "blue"))
    b = make("green", "new", cpus=2, load_s=2)  # two cores wanted, one is blue's
    with Clients(_front(base)) as clients:
        time.sleep(0.3)
        res = frontdoor.switch(base, b, hardware=make.hw)
        time.sleep(0.3)
    assert res.mode == "hold" and "each at most 30 s" in res.announced and "old stops first" in res.announced
    assert res.outcome == "serving new" and clients.failed() == [] and clients.served()[-1] == "new"
    # held, not failed: a request held past the announced bound would have failed above
    assert res.figures.retried and res.figures.failed == 0 and res.figures.longest_wait_s > 0
    assert group_alive(old.pgid) == []


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
