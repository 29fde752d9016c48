"""The Server object: one server's whole life (start, wait until ready, status, query, log, stop) with its state
file as its record. As a context manager it is the command's own server: what the block started is stopped when
the block ends, normally or by an exception (a SIGKILL of the command: tests/measure/test_decode_owned_server.py);
a start the block's Server refused stops nothing. Outside a block a ready server outlives the start. The servers
are tests/stand_in_vllm.py."""

from __future__ import annotations

import httpx
import psutil
import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tools.core.commands import CLI
from tools.core.errors import ToolFailure
from tools.serving import Server, first_listed_model, listed_models
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


def _answering(body) -> httpx.Client:
    """A client whose server answers GET /v1/models with `body` (JSON)."""
    return httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, json=body)))


def test_which_model_a_server_serves_is_its_first_listed_model_or_one_of_two_failures():
    """One reader of /v1/models for the measurements, provenance and the token comparison: the first model; a
    server that lists none, or answers with no model list (a JSON list instead of an object too), one line each."""
    with _answering({"data": [{"id": "m", "root": "/models/m", "max_model_len": 64}, {"id": "n"}]}) as c:
        assert first_listed_model(c, "http://s") == {"id": "m", "root": "/models/m", "max_model_len": 64}
        assert [m["id"] for m in listed_models(c, "http://s")] == ["m", "n"]
    with _answering({"data": []}) as c, pytest.raises(ToolFailure, match="lists no model in /v1/models"):
        first_listed_model(c, "http://s")
    for body in ([{"id": "m"}], {"data": "m"}, {"data": ["m"]}):
        with _answering(body) as c, pytest.raises(ToolFailure) as exc:
            first_listed_model(c, "http://s")
        assert str(exc.value).startswith("no vLLM server answers at http://s (ValueError)")
        assert exc.value.field == "base_url"


def test_query_with_no_server_recorded_sends_the_prompt_nowhere(tmp_path, monkeypatch, serve_config_factory):
    """Nothing recorded: the config's port may be another program's, so the prompt is not posted to it (it was)."""
    from tools.serving import query

    posted: list[str] = []
    monkeypatch.setattr(httpx, "post", lambda url, **kw: posted.append(url))
    cfg = serve_config_factory(tmp_path / "model", "m", state_dir=tmp_path / "run")
    with pytest.raises(ToolFailure, match="no vLLM server is recorded") as exc:
        query(cfg, "a private prompt")
    assert "./vllm-t4 start" in exc.value.render(CLI) and posted == []
