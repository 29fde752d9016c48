"""start with replace=true: B checked before A is touched, A stopped, B started, A started again from its own
record when B fails; what serves is said in one line and in `outcome`. The "servers" are tests/helpers/stand_ins/vllm_server.py
(it binds the port, answers /health and completions, or exits as a broken build does, or never becomes ready), so
every case but the one real-vLLM test at the end runs in a second or two."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, free_port, group_alive
from tools.core.errors import BadInput, ToolFailure
from tools.serving.records import state
from tools.serving.config import ServeConfig
from tools.serving.server.replace import replace_server
from tools.serving.server.server import server_status, stop_server
from tools.serving.server.server import start_server

@pytest.fixture
def stand_in(tmp_path, monkeypatch, serve_config_factory):
    """make(name, mode="serve", **overrides) -> ServeConfig of a stand-in build (a folder of its own) on one
    port and state dir shared by the test; `starts()` lists what was started ({pid, model, mark}: mark, the
    VLLM_STAND_IN_MARK of the environment the start got)."""
    log = tmp_path / "starts.jsonl"
    monkeypatch.setenv("VLLM_STAND_IN_LOG", str(log))
    monkeypatch.setattr(ServeConfig, "vllm_argv", lambda self, platform: stand_in_vllm.argv(self.port, self.model))
    base = serve_config_factory(tmp_path / "unused", "base", state_dir=tmp_path / "run", start_timeout_s=20.0)
    made: list[ServeConfig] = []

    def make(name: str, mode: str = "serve", **overrides) -> ServeConfig:
        model = tmp_path / name
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text("{}")
        if mode != "serve":
            (model / "behaviour.json").write_text(json.dumps({"mode": mode}))
        cfg = serve_config_factory(model, name, **{"state_dir": tmp_path / "run", "port": base.port,
                                                   "start_timeout_s": 20.0, **overrides})
        made.append(cfg)
        return cfg

    make.starts = lambda: [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    yield make
    for cfg in made:
        try:
            stop_server(cfg, grace_s=2)
        except ToolFailure:
            pass


def _serving(cfg: ServeConfig) -> state.ServerState:
    st = server_status(cfg)
    assert st.alive and st.healthy, st.message
    return state.load_state(cfg)


def test_a_good_b_takes_the_place_of_a(stand_in):
    a = stand_in("a")
    ra = start_server(a)
    b = stand_in("b")
    res = replace_server(b)
    assert res.outcome == "serving b" and res.replaced["served_name"] == "a" and res.replaced["pid"] == ra.pid
    assert res.model == b.model and _serving(b).served_name == "b"
    assert group_alive(ra.pgid) == [] and not state.replace_file(b).exists()


def test_a_b_vllm_refuses_restores_a_with_its_own_command_line_and_environment(stand_in, monkeypatch):
    monkeypatch.setenv("VLLM_STAND_IN_MARK", "a's")
    a = stand_in("a")
    ra = start_server(a)
    recorded = state.load_state(a)
    monkeypatch.setenv("VLLM_STAND_IN_MARK", "b's")
    b = stand_in("b", mode="exit")
    with pytest.raises(ToolFailure) as exc:
        replace_server(b)
    msg, detail = str(exc.value), exc.value.detail
    assert "\n" not in msg and "b did not start" in msg and "the stand-in refuses this build" in msg
    assert "restored a" in msg and detail["outcome"] == "restored a"
    now = _serving(a)
    assert now.served_name == "a" and now.pid != ra.pid and now.pid == detail["serving"]["pid"]
    assert now.argv == recorded.argv and now.env == recorded.env
    assert now.startup_s is not None  # its own time to ready, recorded as a first start records it
    starts = stand_in.starts()
    assert [s["model"] for s in starts] == [a.model, b.model, a.model]
    assert starts[2]["mark"] == "a's"  # A's recorded environment, not the replacing command's
    assert group_alive(ra.pgid) == [] and not state.replace_file(a).exists()
    assert all(not psutil.pid_exists(s["pid"]) for s in starts[:2])


def test_a_b_refused_by_the_checks_leaves_a_unchanged(stand_in, tmp_path):
    a = stand_in("a")
    ra = start_server(a)
    b = dataclasses.replace(stand_in("b"), model=str(tmp_path / "no-such-build"))  # checked before A is touched
    with pytest.raises(ToolFailure) as exc:
        replace_server(b)
    assert exc.value.detail["outcome"] == "unchanged (a serves)" and "a still serves (unchanged)" in str(exc.value)
    assert "no-such-build does not exist" in str(exc.value)
    assert _serving(a).pid == ra.pid and len(stand_in.starts()) == 1


def test_a_b_on_a_port_another_instance_holds_is_bad_input_and_a_is_unchanged(stand_in, serve_config_factory):
    a = stand_in("a", instance="m", cpus=1)
    ra = start_server(a)
    other = stand_in("other", instance="other", port=free_port(), cpus=1)
    start_server(other)
    b = stand_in("b", instance="m", port=other.port)
    with pytest.raises(BadInput) as exc:  # still exit 2 on the command line
        replace_server(b)
    assert exc.value.detail["outcome"] == "unchanged (a serves)" and _serving(a).pid == ra.pid


def test_neither_starting_is_unavailable_and_status_says_how_to_bring_a_back(stand_in, tmp_path):
    a = stand_in("a")
    start_server(a)
    (tmp_path / "a" / "behaviour.json").write_text(json.dumps({"mode": "exit"}))  # A's build broke meanwhile
    b = stand_in("b", mode="exit")
    with pytest.raises(ToolFailure) as exc:
        replace_server(b)
    detail = exc.value.detail
    assert detail["outcome"] == "unavailable (nothing serves)" and detail["a_failure"] and detail["b_failure"]
    assert "starting a again failed too" in str(exc.value) and "nothing serves" in str(exc.value)
    st = server_status(a)
    assert not st.alive and st.replace["phase"] == "failed"
    assert "ended with neither build serving" in st.message and "bring it back with" in st.message
    assert a.model in st.message


def test_without_a_server_replace_is_a_plain_start(stand_in):
    b = stand_in("b")
    res = replace_server(b)
    assert res.outcome == "serving b" and res.replaced is None and _serving(b).served_name == "b"


def test_an_interrupted_replace_launches_a_again(stand_in):
    a = stand_in("a")
    ra = start_server(a)
    b = stand_in("b", mode="hang")
    calls: list[str] = []

    def progress(frac: float, total: float | None, msg: str) -> None:
        calls.append(msg)
        if state.load_state(b) is not None and state.load_state(b).served_name == "b":
            raise KeyboardInterrupt  # Ctrl-C while B starts

    with pytest.raises(KeyboardInterrupt):
        replace_server(b, progress=progress)
    back = state.load_state(a)
    assert back is not None and back.served_name == "a" and back.pid != ra.pid  # launched, not waited for
    deadline = time.monotonic() + 20
    while not server_status(a).healthy and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server_status(a).healthy and stand_in.starts()[-1]["model"] == a.model
    assert not state.replace_file(a).exists()


def _cli_status(capsys, monkeypatch, cfg: ServeConfig, instance: str) -> str:
    from tools.cli import main

    monkeypatch.setenv("STATE_DIR", str(cfg.state_dir))
    capsys.readouterr()
    main(["status", "--instance", instance])
    return capsys.readouterr().out


def test_a_replace_killed_between_a_stop_and_b_ready_is_reported_by_status_and_start(stand_in, tmp_path, capsys,
                                                                                     monkeypatch):
    a = stand_in("a", instance="x")
    start_server(a)
    b = stand_in("b", mode="hang", instance="x")
    driver = subprocess.Popen(stand_in_vllm.cli_argv("start", "--env-file", str(ROOT / "tpu.env"), "--instance",
                                                     "x", "--model", b.model, "--served-name", "b", "--port",
                                                     str(a.port), "--replace"),
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "HOST": "127.0.0.1",
                                             "STATE_DIR": str(tmp_path / "run"), "SPECULATIVE_CONFIG": "",
                                             "EXTRA_ARGS": "", "START_TIMEOUT_S": "60"})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # B launched: A was stopped
            rec = state.load_state(b) if b.state_file.exists() else None
            if rec is not None and rec.served_name == "b":
                break
            time.sleep(0.1)
        else:
            raise AssertionError("B was never launched")
        driver.send_signal(signal.SIGKILL)
    finally:
        driver.wait()
    cfg = b
    st = server_status(cfg)
    assert st.replace and not st.replace["running"] and st.replace["phase"] == "starting B"
    assert "was interrupted while starting B" in st.message and "a was stopped: bring it back with" in st.message
    assert a.model in st.message
    text = _cli_status(capsys, monkeypatch, cfg, "x")
    assert (f"bring it back with `./vllm-t4 start --instance x --model {a.model} --served-name a --port {a.port} "
            "--replace`") \
        in text and "\x1e" not in text
    stop_server(cfg, grace_s=2)  # B, which never became ready
    again = start_server(a)
    assert again.note and "was interrupted while starting B" in again.note
    assert not state.replace_file(cfg).exists()  # said once; the replace is over


def test_the_command_line_says_what_serves_in_one_line(stand_in, capsys, monkeypatch):
    from tools.cli import main

    a = stand_in("a", instance="n1")
    start_server(a)
    stand_in("b", mode="exit")
    for k, v in {"STATE_DIR": str(a.state_dir), "PORT": str(a.port), "SPECULATIVE_CONFIG": "", "EXTRA_ARGS": "",
                 "START_TIMEOUT_S": "20"}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = main(["start", "--instance", "n1", "--model", str(Path(a.model).parent / "b"), "--served-name", "b",
               "--replace"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and err[-1].startswith("vllm-t4 start: ") and "restored a" in err[-1]
    assert all("Traceback" not in ln for ln in err)
    st = server_status(a)
    assert st.healthy and st.served_name == "a"


def test_mcp_start_with_replace(stand_in, tmp_path):
    from fastmcp import Client

    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    a = stand_in("a")
    start_server(a)
    stand_in("b")
    (tmp_path / "b" / "config.json").write_text("{}")  # a checkpoint folder to the roots' confinement
    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(tmp_path)], [str(tmp_path / "evidence")], environ={})
    server = create_server(Settings(roots=roots, config_overrides={
        "state_dir": str(a.state_dir), "port": a.port, "speculative_config": "", "extra_args": ""}), toolsets=["serve"])

    async def go():
        async with Client(server) as c:
            r = await c.call_tool("start_vllm_server", {"model": str(tmp_path / "b"), "served_name": "b",
                                                        "replace": True})
            st = await c.call_tool("server_status", {})
            return r.structured_content, st.structured_content

    res, st = asyncio.run(go())
    assert res["outcome"] == "serving b" and res["replaced"]["served_name"] == "a"
    assert st["served_name"] == "b" and st["healthy"] and st["instances"] == []


@pytest.mark.vllm
@pytest.mark.vllm_lane(0)  # evens out the lanes (its servers are its own)
def test_real_vllm_a_failed_replace_serves_a_again(emb4_build, serve_config_factory, tmp_path, monkeypatch):
    """A (the tiny all-4-bit build) serving; B is A's copy whose config.json names a quantization method vLLM
    does not know (`quantization_config.quant_method`). No check made before A is stopped reads that field (the
    start checks read the folder, config.json's position limit, the port, memory and the vLLM build), so B passes
    them and fails in vLLM: A is started again, serves, the message says so, and no process is left."""
    import shutil

    from tests.helpers.fixtures import in_process_engine, require_plugin

    require_plugin()
    in_process_engine(monkeypatch)  # recorded with A and used for its restart
    a = serve_config_factory(emb4_build, "gemma-4-tiny-text-emb4", state_dir=tmp_path / "run")
    bad = tmp_path / "gemma-4-tiny-unknown-quant"
    shutil.copytree(emb4_build, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "no-such-method"
    (bad / "config.json").write_text(json.dumps(config))
    b = serve_config_factory(bad, "gemma-4-tiny-unknown-quant", state_dir=a.state_dir, port=a.port)
    pgids: list[int] = []
    try:
        pgids.append(start_server(a).pgid)
        seen: list[int] = []

        def progress(frac: float, total: float | None, msg: str) -> None:  # the groups of B and of A's second start, to check after
            rec = state.load_state(a)
            if rec is not None:
                seen.append(rec.pgid)

        with pytest.raises(ToolFailure) as exc:
            replace_server(b, progress=progress)
        pgids += list(dict.fromkeys(seen))
        msg, detail = str(exc.value), exc.value.detail
        assert detail["outcome"] == "restored gemma-4-tiny-text-emb4", msg
        assert "gemma-4-tiny-unknown-quant did not start" in msg and "restored gemma-4-tiny-text-emb4" in msg
        st = server_status(a)
        assert st.healthy and st.served_name == "gemma-4-tiny-text-emb4" and st.pid == detail["serving"]["pid"]
        pgids.append(st.pid)
    finally:
        stop_server(a, grace_s=10)
    assert all(group_alive(g) == [] for g in pgids)
    assert not state.replace_file(a).exists() and not a.state_file.exists()


def test_start_and_replace_say_what_the_checks_warn(stand_in):
    """A start the checks let through with a warning (here: a build repacked for bfloat16 served as float16) says
    the warning in its result, as preflight would have: the build serves, but not the numbers its repack checked."""
    a = stand_in("a", cpu_dtype="float16")
    (Path(a.model) / "repack-report.json").write_text(json.dumps({"target_dtype": "bfloat16"}))
    ra = start_server(a)
    assert [w.split(":")[0] for w in ra.warnings] == ["runtime_dtype"], ra.warnings
    assert "repacked for bfloat16" in ra.warnings[0] and "CPU_DTYPE=float16" in ra.warnings[0]
    b = stand_in("b", cpu_dtype="float16")  # no report: nothing to warn about
    rb = replace_server(b)
    assert rb.outcome == "serving b" and rb.warnings == []
    c = stand_in("c", cpu_dtype="float16")
    (Path(c.model) / "repack-report.json").write_text(json.dumps({"target_dtype": "bfloat16"}))
    rc = replace_server(c)
    assert rc.outcome == "serving c" and [w.split(":")[0] for w in rc.warnings] == ["runtime_dtype"]
