"""The front door with an API key: the real vllm-router over a build (tests/helpers/stand_ins/vllm_server.py, which with
VLLM_API_KEY answers /v1 only to that bearer key, as vLLM does). vllm-router 0.1.17 checks no key itself and
passes the client's Authorization header on: a request without the key is refused (by the instance, through the
router), one with it answered; the router's start (its readiness asks /v1/models through it) and status work with
the key; the key is in none of the router's command line, environment, state file or log. Beyond the loopback the
front door is refused without a key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

import httpx
import psutil
import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, free_port
from tools.core.errors import BadInput
from tests.helpers.serving import TwoCores
from tools.serving.frontdoor import door as frontdoor
from tools.serving.records import router_state
from tools.serving.config import ServeConfig
from tools.serving.server.server import start_server
from tools.measure.endpoint import request_counts
from tools.serving.frontdoor.router import router_status, start_router, stop_router
from tools.serving.server.server import stop_server

KEY = "k-" + "fr0nt" * 8
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
HW = TwoCores()


@pytest.fixture
def blue(tmp_path, monkeypatch, serve_config_factory):
    """(router's config, instance blue's config): build `old` serving as instance blue, with the key when the
    test has set VLLM_API_KEY."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(
        self.port, self.model, [self.served_name]))
    base = serve_config_factory(tmp_path, "front", state_dir=tmp_path / "run", start_timeout_s=30.0)
    made: list[ServeConfig] = []

    def make(instance: str, name: str) -> ServeConfig:
        model = tmp_path / name
        model.mkdir()
        (model / "behaviour.json").write_text(json.dumps({"mode": "serve"}))
        (model / "config.json").write_text("{}")
        made.append(serve_config_factory(model, name, state_dir=tmp_path / "run", instance=instance, cpus=1,
                                         port=free_port(), start_timeout_s=30.0))
        return made[-1]

    def start():
        start_server(make("blue", "old"), hardware=HW)
        return base, make

    try:
        yield start
    finally:
        stop_router(base, grace_s=5)
        for cfg in made:
            stop_server(cfg, grace_s=2)


def test_a_front_door_beyond_the_loopback_needs_the_key(blue, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    base, _ = blue()
    with pytest.raises(BadInput) as exc:
        start_router(base, ["blue"], host="0.0.0.0", port=free_port(), timeout_s=20)
    msg = str(exc.value)
    assert "0.0.0.0" in msg and "VLLM_API_KEY" in msg and "\n" not in msg
    assert router_state.load(base) is None and not router_state.state_file(base).exists()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_key_is_required_and_used_through_the_router(blue, monkeypatch, host):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    base, _ = blue()
    res = start_router(base, ["blue"], host=host, port=free_port(), timeout_s=20)
    url = f"http://127.0.0.1:{res.base_url.rsplit(':', 1)[1]}"
    with httpx.Client(timeout=30) as c:
        assert c.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 401
        assert c.post(f"{url}/v1/chat/completions", json=CHAT,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get(f"{url}/v1/models").status_code == 401
        ok = c.post(f"{url}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["model"] == "old", ok.text
    st = router_status(base)
    assert st.alive and st.healthy and st.backends_healthy == {"blue": True}, st.message
    assert request_counts([asdict(b) for b in st.backends])["blue"] is not None
    # the key is nowhere the router keeps or shows: its argv, its environment, its state file and its log
    proc = psutil.Process(res.pid)
    assert not any(KEY in a for a in proc.cmdline() + res.argv)
    assert KEY not in json.dumps(proc.environ())
    for f in (router_state.state_file(base), router_state.log_file(base)):
        assert KEY not in f.read_text(errors="replace"), f


def test_a_switch_behind_a_keyed_front_door(blue, monkeypatch):
    """The switch's checks of the new build (its start's readiness sends the key; /health and /metrics are not
    under /v1) pass with a key; the new build answers through the router to the key only."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    base, make = blue()
    res = start_router(base, ["blue"], port=free_port(), timeout_s=20)
    out = frontdoor.switch(base, make("green", "new"), hardware=HW)
    assert out.outcome == "serving new", out
    with httpx.Client(timeout=30) as c:
        assert c.post(f"{res.base_url}/v1/chat/completions", json=CHAT).status_code == 401
        ok = c.post(f"{res.base_url}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["model"] == "new", ok.text


def test_the_command_line_refuses_it_in_one_line_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), STATE_DIR=str(tmp_path / "run"), HOST="0.0.0.0")
    env.pop("VLLM_API_KEY", None)
    r = subprocess.run([sys.executable, "-m", "tools.cli", "router", "start", "--instances", "blue", "--port",
                        str(free_port())], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "HOST is 0.0.0.0" in lines[0] and "VLLM_API_KEY" in lines[0], \
        r.stderr
    assert not (tmp_path / "run" / "router.json").exists()
