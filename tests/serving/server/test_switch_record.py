"""What a switch leaves for later: the failed build's log kept beside the state (named by build and time) and
readable through the log readers after the rollback, and `status` saying how the last switch ended, with the
builds named. Stand-in servers (tests/helpers/stand_ins/vllm_server.py)."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tools.core.errors import ToolFailure
from tools.serving.server import switch_record
from tools.serving.config import ServeConfig
from tools.serving.server.replace import replace_server
from tools.serving.server.server import start_server
from tools.serving.server.server import read_log, server_status, stop_server


@pytest.fixture
def build(tmp_path, monkeypatch, serve_config_factory):
    """build(name, mode="serve") -> the ServeConfig of a stand-in build on one port and state dir."""
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(self.port, self.model))
    made: list[ServeConfig] = []
    port = serve_config_factory(tmp_path, "x").port

    def make(name: str, mode: str = "serve") -> ServeConfig:
        model = tmp_path / name
        model.mkdir()
        (model / "behaviour.json").write_text(json.dumps({"mode": mode}))
        (model / "config.json").write_text("{}")
        cfg = serve_config_factory(model, name, state_dir=tmp_path / "run", port=port, start_timeout_s=20.0)
        made.append(cfg)
        return cfg

    yield make
    for cfg in made:
        stop_server(cfg, grace_s=2)


def test_after_a_rollback_the_failed_builds_log_is_kept_and_read_and_status_names_the_outcome(build, tmp_path):
    a = build("a")
    start_server(a)
    b = build("b", "exit")
    with pytest.raises(ToolFailure) as exc:
        replace_server(b)
    assert exc.value.detail["outcome"] == "restored a"
    kept = sorted(switch_record.logs_dir(a).iterdir())
    assert len(kept) == 1 and re.fullmatch(r"b-\d{8}T\d{6}\.\d+Z-failed\.log", kept[0].name)
    assert "the stand-in refuses this build" in kept[0].read_text()
    assert str(kept[0]) in str(exc.value.detail["b_failure"])  # the failure names the kept log, not the live one
    text = read_log(a, 50)
    live, failed = text.split("\n--- the failed start of b in the last switch")
    assert str(a.model) in live and "refuses" not in live  # the live log is the restored build's
    assert str(kept[0]) in failed and "ValueError: the stand-in refuses this build" in failed
    st = server_status(a)
    assert st.healthy and st.served_name == "a"
    assert st.last_switch["outcome"] == "restored a" and st.last_switch["failed_log"] == str(kept[0])
    assert "last switch" in st.message and "from a to b: restored a" in st.message

    # a good switch afterwards: its outcome names the build, and no failed log is shown any more
    res = replace_server(build("c"))
    assert res.outcome == "serving c"
    st = server_status(a)
    assert st.last_switch["outcome"] == "serving c" and st.last_switch["failed_log"] is None
    assert "--- the failed start" not in read_log(a, 50) and kept[0].is_file()


def test_mcp_reads_the_failed_builds_log_after_the_rollback(build, tmp_path):
    from fastmcp import Client

    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    a = build("a")
    start_server(a)
    b = build("b", "exit")
    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(tmp_path)], [str(tmp_path / "evidence")], environ={})
    server = create_server(Settings(roots=roots, config_overrides={
        "state_dir": str(a.state_dir), "port": a.port, "speculative_config": "", "extra_args": "",
        "start_timeout_s": 20.0}), toolsets=["serve", "log"])

    async def go():
        async with Client(server) as c:
            r = await c.call_tool("start_vllm_server", {"model": b.model, "served_name": "b", "replace": True},
                                  raise_on_error=False)
            logs = await c.call_tool("server_logs", {"lines": 20})
            res = await c.read_resource("gemma4-t4://server/log")
            st = await c.call_tool("server_status", {})
            return r, logs.structured_content, res[0].text, st.structured_content

    r, logs, resource, st = asyncio.run(go())
    assert r.is_error and "restored a" in r.content[0].text
    assert any("the stand-in refuses this build" in ln for ln in logs["lines"])
    assert "the stand-in refuses this build" in resource and "the failed start of b" in resource
    assert st["last_switch"]["outcome"] == "restored a"


def test_only_the_newest_failed_logs_are_kept(build, monkeypatch):
    monkeypatch.setattr(switch_record, "KEEP_FAILED", 2)
    a = build("a", "exit")
    for _ in range(3):
        with pytest.raises(ToolFailure):
            start_server(a)
    assert len(list(switch_record.logs_dir(a).iterdir())) == 2


def test_an_interrupted_switch_reads_as_interrupted_not_as_a_failed_build(tmp_path):
    """A switch stopped by a signal (its record's message "interrupted; ...") is not described as the new build
    failing: status and the log readers say it was interrupted."""
    from tools.serving.config import load_config
    from tools.serving.server.switch_record import SwitchRecord, describe, failed_log_section, write_switch

    cfg = load_config(state_dir=str(tmp_path / "run"))
    log = tmp_path / "b.log"
    log.write_text("INFO loading weights\n")
    rec = SwitchRecord(at="2026-12-05T00:00:00+00:00", outcome="unchanged (a serves)", from_build="a",
                       to_build="b", serving="a", message="interrupted; unchanged (a serves)", failed_log=str(log))
    assert "interrupted; unchanged (a serves)" in describe(rec) and "failed" not in describe(rec), describe(rec)
    write_switch(cfg, rec)
    section = failed_log_section(cfg, 5)
    assert section.startswith("--- the interrupted start of b") and "loading weights" in section, section
    failed = rec.model_copy(update={"message": "b did not serve; unchanged (a serves)"})
    assert "b's failed start log" in describe(failed)
    # one served name across two builds (clients keep it): the folders say which build is which
    same = rec.model_copy(update={"from_build": "chat", "to_build": "chat", "from_model": "/m/fp16",
                                  "to_model": "/m/fp16-exact"})
    assert "from chat to chat: " in describe(same) and "builds: /m/fp16 -> /m/fp16-exact" in describe(same)
