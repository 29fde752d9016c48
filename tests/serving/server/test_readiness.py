"""A start that half-works ends at once and says why: a server that answers /health but refuses the readiness
completion or the chat warm-up (HTTP 4xx/5xx with a body) ends the start with the server's own message and the
parameter that fixes it, through the library, the command line and MCP; one that exits is explained by its own
error, never by the fd-limit warning every vLLM start prints; one that says nothing still meets the timeout.
The servers are tests/helpers/stand_ins/vllm_server.py; the start timeout is long, so a start that waited it out would show."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import psutil
import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tools.core.errors import ToolFailure
from tools.serving.server import readiness
from tools.serving.config import ServeConfig
from tools.serving.server.server import start_server
from tools.serving.server.server import stop_server


@pytest.fixture
def build(tmp_path, monkeypatch, serve_config_factory):
    """build(name, mode, chat_template=True, **overrides) -> the ServeConfig of a stand-in build."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(self.port, self.model))
    made: list[ServeConfig] = []

    def make(name: str, mode: str = "serve", chat_template: bool = True, **overrides) -> ServeConfig:
        model = tmp_path / name
        model.mkdir()
        (model / "behaviour.json").write_text(json.dumps({"mode": mode}))
        (model / "config.json").write_text("{}")
        if chat_template:
            (model / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
        cfg = serve_config_factory(model, name, **{"state_dir": tmp_path / "run", "start_timeout_s": 600.0,
                                                   **overrides})
        made.append(cfg)
        return cfg

    yield make
    for cfg in made:
        stop_server(cfg, grace_s=2)


def _launched_pid(exc: ToolFailure) -> int:
    return exc.detail["pid"]


@pytest.mark.parametrize("mode,request_name", [("refuse", "readiness completion"), ("refuse_chat", "chat warm-up")])
def test_a_server_that_refuses_what_clients_send_ends_the_start_naming_max_model_len(build, mode, request_name):
    cfg = build("short", mode)
    with pytest.raises(ToolFailure) as exc:
        start_server(cfg)
    msg, detail = str(exc.value), exc.value.detail
    assert "\n" not in msg and "answered but refused what clients send" in msg
    assert f"the {request_name} was refused with HTTP 400" in msg
    assert "maximum context length is 16 tokens" in msg and "max_model_len" in msg
    assert "ulimit" not in msg and "within 600 s" not in msg
    assert detail["parameter"] == "max_model_len" and detail["refusal"]["request"] == request_name
    assert not psutil.pid_exists(_launched_pid(exc.value)) or \
        psutil.Process(_launched_pid(exc.value)).status() == psutil.STATUS_ZOMBIE
    assert not cfg.state_file.exists()


def test_without_a_chat_template_the_chat_warm_up_is_not_sent(build):
    res = start_server(build("plain", "refuse_chat", chat_template=False))
    assert res.first_completion == "plain"


def test_a_server_that_exits_is_explained_by_its_own_error_not_the_fd_limit_warning(build):
    with pytest.raises(ToolFailure) as exc:
        start_server(build("broken", "exit"))
    assert "exited with code 1" in str(exc.value) and "the stand-in refuses this build" in str(exc.value)
    assert "ulimit" not in str(exc.value)


def test_a_server_that_says_nothing_meets_the_timeout_and_the_warning_is_not_its_cause(build):
    with pytest.raises(ToolFailure) as exc:
        start_server(build("quiet", "hang", start_timeout_s=2.0))
    assert "did not become ready within 2 s" in str(exc.value) and "ulimit" not in str(exc.value)


def test_the_refusal_names_the_parameter_in_each_front_ends_spelling(build, tmp_path, capsys, monkeypatch):
    from fastmcp import Client

    from tools.cli import main
    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    cfg = build("short", "refuse")
    for k, v in {"STATE_DIR": str(cfg.state_dir), "PORT": str(cfg.port), "SPECULATIVE_CONFIG": "", "EXTRA_ARGS": "",
                 "START_TIMEOUT_S": "600"}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = main(["start", "--model", cfg.model, "--served-name", "short"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 1 and "maximum context length is 16 tokens" in err[-1] and "--max-model-len" in err[-1], err

    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(tmp_path)], [str(tmp_path / "evidence")], environ={})
    server = create_server(Settings(roots=roots, config_overrides={
        "state_dir": str(cfg.state_dir), "port": cfg.port, "speculative_config": "", "extra_args": "",
        "start_timeout_s": 600.0}), toolsets=["serve"])

    async def go():
        async with Client(server) as c:
            return await c.call_tool("start_vllm_server", {"model": cfg.model, "served_name": "short"},
                                     raise_on_error=False)

    res = asyncio.run(go())
    text = res.content[0].text
    assert res.is_error and "maximum context length is 16 tokens" in text and "max_model_len" in text, text


def test_a_refusal_body_is_read_as_the_server_wrote_it():
    r = readiness.refusal("chat warm-up", 400, json.dumps(stand_in_vllm.CONTEXT_REFUSAL))
    assert r.parameter == "max_model_len" and r.message.startswith("This model's maximum context length is 16")
    assert readiness.refusal("chat warm-up", 500, '{"object": "error", "message": "boom"}').message == "boom"
    plain = readiness.refusal("chat warm-up", 503, "<html> busy </html>")
    assert plain.message == "<html> busy </html>" and plain.parameter is None


def test_a_server_still_loading_is_waited_for_not_refused():
    """503 (and 429, 502, 504) mean "not yet": a server that answers /health while its model still loads."""
    import httpx

    from tests.helpers.stand_ins.measure import serve_in_thread

    loading = stand_in_vllm.handler(Path("m"), [], {"mode": "loading"})  # /health 200, every POST 503
    with serve_in_thread(loading) as url, httpx.Client() as c:
        assert readiness.first_completion(c, url, "m") == (None, None)
        assert readiness.chat_warm_up(c, url, "m") == (False, None)
