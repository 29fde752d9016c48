"""The Server object: one server's whole life (start, wait until ready, status, query, log, stop) with its state
file as its record. As a context manager it is the command's own server: what the block started is stopped when
the block ends, normally or by an exception (a SIGKILL of the command: tests/measure/test_decode_owned_server.py);
a start the block's Server refused stops nothing. Outside a block a ready server outlives the start. The servers
are tests/stand_in_vllm.py."""

from __future__ import annotations

import json

import psutil
import pytest

from tests import stand_in_vllm
from tools.core.errors import ToolFailure
from tools.serving import Server
from tools.serving.config import ServeConfig


@pytest.fixture
def build(tmp_path, monkeypatch, serve_config_factory):
    """build(name) -> the ServeConfig of a stand-in build that serves; stopped after the test."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(self.port, self.model))
    made: list[ServeConfig] = []

    def make(name: str) -> ServeConfig:
        model = tmp_path / name
        stand_in_vllm.build(model)
        cfg = serve_config_factory(model, name, state_dir=tmp_path / "run", start_timeout_s=600.0)
        made.append(cfg)
        return cfg

    yield make
    for cfg in made:
        Server(cfg).stop(grace_s=2)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_server_started_in_its_with_block_is_stopped_when_the_block_ends(build):
    cfg = build("own")
    with Server(cfg) as server:
        started = server.start()
        assert server.status().healthy and server.record.pid == started.pid
    assert _gone(started.pid) and not cfg.state_file.exists() and server.started is None


def test_a_server_started_in_its_with_block_is_stopped_when_the_block_raises(build):
    cfg = build("own")
    with pytest.raises(RuntimeError, match="the measurement failed"):
        with Server(cfg) as server:
            pid = server.start().pid
            raise RuntimeError("the measurement failed")
    assert _gone(pid) and not cfg.state_file.exists()


def test_a_refused_start_in_a_with_block_stops_nothing(build):
    """The refusal names a server this block did not start: it is not the block's to stop."""
    cfg = build("theirs")
    theirs = Server(cfg).start()
    with Server(cfg) as server:
        with pytest.raises(ToolFailure, match="already running"):
            server.start()
    assert not _gone(theirs.pid) and Server(cfg).record.pid == theirs.pid


def test_a_server_started_outside_a_with_block_serves_after_its_start(build):
    """start, wait_ready, status, query, log and stop through one object; the start's guard has ended."""
    cfg = build("kept")
    server = Server(cfg)
    started = server.start()
    guards = [p for p in psutil.process_iter(["cmdline"]) if "tools.serving.server.guard" in (p.info["cmdline"] or [])
              and str(cfg.state_file) in (p.info["cmdline"] or [])]
    assert guards == []
    assert server.wait_ready(5.0) and server.status().healthy
    assert server.query("hi", max_tokens=2).text == "kept"
    assert server.log(5) != ""
    stopped = server.stop(grace_s=2)
    assert stopped.was_running and stopped.pid == started.pid and _gone(started.pid)
    assert server.record is None and not server.wait_ready(0.5)
