"""The second command: two state-changing commands on one instance at once (start/start, start/stop,
replace/replace, replace/stop), a second Ctrl-C during a replace's rollback, and an API key for a server reachable
beyond the loopback. Every command is `./vllm-t4` in a process of its own (tests/helpers/stand_ins/vllm_server.py's driver: the
command line's main() with the stand-in where vLLM would be), so the instance's lock is taken by two processes as
it is in use.

Each case: one winner (the other refused in one line, nothing done) or two whole results; no stand-in left
running that no state file names; every state record true (its leader alive and answering, no replace record
left behind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.stand_ins import vllm_server as stand_in_vllm
from tests.helpers.fixtures import ROOT, free_port
from tests.helpers.kill_matrix import all_gone
from tests.helpers.serving import Bench, until
from tools.serving.records import state
from tools.serving.config import load_config
from tools.serving.server.server import server_status

BUSY = "is being changed by another command"


@pytest.fixture
def bench(tmp_path):
    b = Bench(tmp_path)
    yield b
    b.stop()


def _refused(r: subprocess.CompletedProcess, command: str) -> None:
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("starting ")]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"vllm-t4 {command}: "), r.stderr
    assert BUSY in lines[0] and "nothing was done" in lines[0], r.stderr


# (first command, second command, what serves at the end): the second is refused while the first runs.
MATRIX = {
    "start/start": (("start", "b"), ("start", "c"), "b"),
    "start/stop": (("start", "b"), ("stop",), "b"),
    "replace/replace": (("replace", "b"), ("replace", "c"), "b"),
    "replace/stop": (("replace", "b"), ("stop",), "b"),
    "failing replace/replace": (("replace", "b-broken"), ("replace", "c"), "a"),  # the orphan
}


def _args(bench: Bench, cmd: tuple[str, ...]) -> list[str]:
    if cmd[0] == "stop":
        return ["stop"]
    args = ["start", "--model", str(bench.tmp / cmd[1])]
    return args + (["--replace"] if cmd[0] == "replace" else [])


@pytest.mark.parametrize("case", MATRIX)
def test_two_commands_at_once_one_winner_nothing_orphaned(bench, case):
    first, second, serving = MATRIX[case]
    bench.build("a")
    go = bench.tmp / "go"  # the first command's build loads until the second command has ended
    bench.build("b", until=str(go))
    bench.build("b-broken", until=str(go), mode="exit")
    bench.build("c")
    if first[0] == "replace":
        assert bench.run("start", "--model", str(bench.tmp / "a")).returncode == 0
    p1 = bench.popen(*_args(bench, first))
    try:
        until(f"{first[1]} launched", lambda: bench.started(first[1]), p1)
        r2 = bench.run(*_args(bench, second))
        _refused(r2, "stop" if second[0] == "stop" else "start")
        go.touch()
        _, err1 = p1.communicate(timeout=120)
    finally:
        if p1.poll() is None:
            p1.kill()
    assert p1.returncode == (1 if serving == "a" else 0), err1
    assert not bench.started("c")  # the refused command did nothing
    bench.check_true_and_nothing_orphaned(serving)
    # and the second command, run again now, has its whole result
    again = bench.run(*_args(bench, second))
    assert again.returncode == (0 if second[0] != "start" or first[0] == "replace" else 1), again.stderr
    if second[0] == "stop":
        bench.check_true_and_nothing_orphaned(None)
    elif first[0] == "start":  # start over a running server: refused as before, b still serves
        assert "already running" in again.stderr
        bench.check_true_and_nothing_orphaned("b")


def test_each_launch_keeps_a_log_of_its_own(bench):
    """A failed B's log is not overwritten by A's start again: the failure names a file that still says why."""
    bench.build("a")
    bench.build("b", mode="exit")
    assert bench.run("start", "--model", str(bench.tmp / "a")).returncode == 0
    a_log = state.load_state(bench.cfg()).log_path
    r = bench.run("start", "--model", str(bench.tmp / "b"), "--replace", "--json")
    assert r.returncode == 1 and "restored a" in r.stderr
    detail = json.loads(r.stdout)["detail"]
    b_log = Path(detail["b_failure"]["detail"]["log_path"])
    now = state.load_state(bench.cfg())
    assert len({a_log, str(b_log), now.log_path}) == 3
    assert "the stand-in refuses this build" in b_log.read_text()
    assert str(bench.tmp / "a") in Path(now.log_path).read_text()
    bench.check_true_and_nothing_orphaned("a")


def test_a_second_ctrl_c_during_the_rollback_still_brings_a_back(bench):
    """Two SIGINTs 0.3 s apart while B starts (B takes a second to end on SIGTERM): A is launched again, the
    command exits 130 with one line, B is gone and no replace record says A was stopped."""
    bench.build("a")
    bench.build("b", mode="hang", term_s=1.0)
    assert bench.run("start", "--model", str(bench.tmp / "a")).returncode == 0
    a_pid = state.load_state(bench.cfg()).pid
    p = bench.popen("start", "--model", str(bench.tmp / "b"), "--replace")
    try:
        until("b launched", lambda: bench.started("b"), p)
        p.send_signal(signal.SIGINT)
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "vllm-t4: interrupted", err
    assert "Traceback" not in err
    rec = state.load_state(bench.cfg())
    assert rec is not None and rec.served_name == "a" and rec.pid != a_pid  # A launched again
    deadline = time.monotonic() + 30
    while not server_status(bench.cfg()).healthy and time.monotonic() < deadline:
        time.sleep(0.1)
    bench.check_true_and_nothing_orphaned("a")


def test_the_way_back_names_the_env_file_and_replaces_what_serves(bench, tmp_path):
    """A replace killed while B starts: the command that brings A back carries --env-file (its STATE_DIR and
    settings) and --replace (B may serve by then), and run as said it serves A."""
    env_file = tmp_path / "other.env"
    env_file.write_text((ROOT / "tpu.env").read_text())
    bench.build("a")
    bench.build("b", until=str(tmp_path / "never"))
    assert bench.run("start", "--env-file", str(env_file), "--model", str(bench.tmp / "a")).returncode == 0
    p = bench.popen("start", "--env-file", str(env_file), "--model", str(bench.tmp / "b"), "--replace")
    try:
        until("b launched", lambda: bench.started("b"), p)
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        if p.poll() is None:
            p.kill()
    st = bench.run("status", "--env-file", str(env_file))
    assert st.returncode == 3
    said = st.stdout.split("bring it back with `")[1].split("`")[0]
    assert f"--env-file {env_file.resolve()}" in said and said.endswith("--replace"), said
    words = said.split()[1:]  # without ./vllm-t4
    again = bench.run(*words)
    assert again.returncode == 0, again.stderr
    bench.check_true_and_nothing_orphaned("a")


def test_a_replace_header_shows_the_port_the_instance_serves_on(bench, tmp_path):
    """PORT from the configuration file is a preference: the replace serves on A's port, and says so first."""
    env_file = tmp_path / "port.env"
    env_file.write_text("".join(f"PORT={bench.port}\n" if ln.startswith("PORT=") else ln + "\n"
                                for ln in (ROOT / "tpu.env").read_text().splitlines()))
    env = {k: v for k, v in bench.env.items() if k != "PORT"}
    bench.build("a")
    bench.build("b")
    other_port = free_port()
    assert bench.run("start", "--env-file", str(env_file), "--model", str(bench.tmp / "a"), "--port",
                     str(other_port), env=env).returncode == 0
    r = bench.run("start", "--env-file", str(env_file), "--model", str(bench.tmp / "b"), "--replace", env=env)
    assert r.returncode == 0, r.stderr
    assert state.load_state(bench.cfg()).port == other_port
    header = r.stderr.splitlines()[0]
    assert header.startswith(f"starting b at http://127.0.0.1:{other_port} "), header
    assert f":{bench.port}" not in header


def test_bad_model_folder_and_max_model_len_exit_2(bench):
    too_long = bench.build("short")
    (Path(too_long) / "config.json").write_text(json.dumps({"max_position_embeddings": 1024}))
    for args, says in [(["--model", str(bench.tmp / "nonexist")], "does not exist"),
                       (["--model", too_long, "--max-model-len", "999999"], "above the model's own limit")]:
        r = bench.run("start", *args)
        lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("starting ")]
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
    assert bench.starts() == []


def test_a_non_loopback_host_needs_an_api_key(bench):
    bench.build("a")
    r = bench.run("start", "--model", str(bench.tmp / "a"), env=dict(bench.env, HOST="0.0.0.0"))
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("starting ")]
    assert r.returncode == 2 and len(lines) == 1 and "VLLM_API_KEY" in lines[0] and "0.0.0.0" in lines[0], r.stderr
    assert bench.starts() == []


def test_the_api_key_reaches_vllm_and_every_call_but_no_file(bench, tmp_path):
    """With a key, the server gets it (and answers /v1 only with it: the readiness completion and query send it);
    the state file, the log and the replace's records never hold it."""
    key = "k-" + "s3cret" * 6
    env = dict(bench.env, VLLM_API_KEY=key)
    bench.build("a")
    assert bench.run("start", "--model", str(bench.tmp / "a"), env=env).returncode == 0
    q = bench.run("query", "hi", env=env)
    assert q.returncode == 0 and q.stdout.startswith("ok"), q.stderr
    rec = state.load_state(bench.cfg())
    assert bench.starts()[-1]["key"] is True
    anonymous = httpx.post(f"{rec.base_url}/v1/completions", json={"model": "a", "prompt": "x"}, timeout=10)
    assert anonymous.status_code == 401
    bench.build("b")
    assert bench.run("start", "--model", str(bench.tmp / "b"), "--replace", env=env).returncode == 0
    for f in (tmp_path / "run").rglob("*"):
        if f.is_file():
            assert key not in f.read_text(errors="replace"), f


def test_a_second_ctrl_c_inside_the_rollback_does_not_stop_it(bench, monkeypatch):
    """The second SIGINT lands exactly in the rollback (while what is left of B is stopped): A is still launched
    again and the replace record goes; the interrupt is delivered once the rollback is done."""
    from tools.serving.server import replace as replace_mod
    from tools.serving.server.replace import replace_server

    monkeypatch.setattr("tools.serving.config.ServeConfig.vllm_argv",
                        lambda self, platform: stand_in_vllm.argv(self.port, self.model))
    monkeypatch.setenv("VLLM_STAND_IN_LOG", str(bench.log))
    a_model, b_model = bench.build("a"), bench.build("b", mode="hang")
    cfg_a = load_config(ROOT / "tpu.env", state_dir=str(bench.tmp / "run"), port=bench.port, model=a_model,
                        speculative_config="", extra_args="", start_timeout_s=30.0)
    cfg_b = load_config(ROOT / "tpu.env", state_dir=str(bench.tmp / "run"), port=bench.port, model=b_model,
                        speculative_config="", extra_args="", start_timeout_s=30.0)
    from tools.serving.server.server import start_server
    a_pid = start_server(cfg_a).pid
    real_stop = replace_mod.stop_server
    rolled_back: list[str] = []

    def stop_then_second_ctrl_c(cfg, **kw):
        if rolled_back == ["first"]:  # the rollback's stop of what is left of B
            rolled_back.append("second")
            signal.raise_signal(signal.SIGINT)
        return real_stop(cfg, **kw)

    def progress(frac: float, total: float | None, msg: str) -> None:
        rec = state.load_state(cfg_b)
        if rec is not None and rec.served_name == "b" and not rolled_back:
            rolled_back.append("first")
            raise KeyboardInterrupt  # the first Ctrl-C, while B starts

    monkeypatch.setattr(replace_mod, "stop_server", stop_then_second_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        replace_server(cfg_b, progress=progress)
    assert rolled_back == ["first", "second"]
    rec = state.load_state(cfg_a)
    assert rec is not None and rec.served_name == "a" and rec.pid != a_pid
    deadline = time.monotonic() + 30
    while not server_status(cfg_a).healthy and time.monotonic() < deadline:
        time.sleep(0.1)
    bench.check_true_and_nothing_orphaned("a")


# ------------------------------------------------------------------ the MCP front end going away during a start

def _mcp_server(bench: Bench) -> subprocess.Popen:
    (bench.tmp / "evidence").mkdir(exist_ok=True)
    env = dict(bench.env, START_TIMEOUT_S="60")
    proc = subprocess.Popen(stand_in_vllm.mcp_argv("--models-root", str(bench.tmp), "--evidence-root",
                                                   str(bench.tmp / "evidence"), "--state-dir", str(bench.tmp / "run"),
                                                   "--toolsets", "serve,jobs"), cwd="/", env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def send(msg: dict) -> None:
        proc.stdin.write(json.dumps({"jsonrpc": "2.0", **msg}) + "\n")
        proc.stdin.flush()

    send({"id": 1, "method": "initialize", "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                                                      "clientInfo": {"name": "test", "version": "0"}}})
    while json.loads(proc.stdout.readline()).get("id") != 1:
        pass
    send({"method": "notifications/initialized"})
    proc.send = send  # type: ignore[attr-defined]
    return proc


def _gone_as_a_client_goes(proc: subprocess.Popen, how: str) -> None:
    if how == "client closes":  # as the client library does: stdin closed, the process killed 4 s later
        proc.stdin.close()
        try:
            proc.wait(timeout=4)
        except subprocess.TimeoutExpired:
            proc.kill()
    else:
        proc.send_signal(signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL)
    proc.wait(timeout=60)


# start_job: as the client does it (the library kills server.py 4 s after closing stdin); SIGTERM and
# SIGKILL end a job's thread as they end a foreground call's.
FRONT_END_GOES = [(call, how) for call in ("start", "replace") for how in ("client closes", "SIGTERM", "SIGKILL")]
FRONT_END_GOES.append(("start_job", "client closes"))


@pytest.mark.parametrize("call,how", FRONT_END_GOES)
def test_the_server_a_front_end_was_starting_ends_with_it(bench, call, how):
    """server.py goes away while the vLLM it is starting loads: that vLLM ends too; after a replace, A serves
    again or the replace record says A was stopped and nothing else is recorded."""
    bench.build("a")
    b = bench.build("b", until=str(bench.tmp / "never"))
    for m in ("a", "b"):
        (bench.tmp / m / "config.json").write_text("{}")  # a checkpoint folder to the roots' confinement
    if call == "replace":
        assert bench.run("start", "--model", str(bench.tmp / "a")).returncode == 0
    proc = _mcp_server(bench)
    try:
        args = {"model": b, "served_name": "b", "replace": call == "replace"}
        if call == "start_job":
            proc.send({"id": 2, "method": "tools/call", "params": {"name": "start_job", "arguments": {
                "tool": "start_vllm_server", "arguments": args}}})
        else:
            proc.send({"id": 2, "method": "tools/call", "params": {"name": "start_vllm_server", "arguments": args}})
        until("b launched", lambda: bench.started("b"), proc)
        _gone_as_a_client_goes(proc, how)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    b_pids = [s["pid"] for s in bench.starts() if Path(s["model"]).name == "b"]
    assert b_pids and all_gone(b_pids, wait_s=20)
    cfg = bench.cfg()
    deadline = time.monotonic() + 20  # the guard removes the record of what it ended
    while state.load_state(cfg) is not None and state.load_state(cfg).served_name == "b" and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    rec = state.load_state(cfg)
    assert rec is None or rec.served_name == "a", rec
    if rec is None:
        rep = state.load_replace(cfg)
        assert (rep is not None and rep.a.served_name == "a") == (call == "replace")
        if rep is not None:
            assert "a was stopped: bring it back with" in server_status(cfg).message
            state.clear_replace(cfg)
        bench.check_true_and_nothing_orphaned(None)
    else:
        while not server_status(cfg).healthy and time.monotonic() < deadline:
            time.sleep(0.1)
        bench.check_true_and_nothing_orphaned("a")


# ------------------------------------------------------------------ the lock and the record's owner, in-process

def _record(cfg, pid: int, create_time: float, name: str) -> state.ServerState:
    return state.ServerState(pid=pid, pgid=pid, create_time=create_time, host="127.0.0.1", port=cfg.port,
                             base_url=cfg.base_url, model="m", served_name=name, argv=["x"], platform="cpu",
                             started_at="2026-01-01T00:00:00+00:00", started_ts=0.0, log_path="l")


def test_a_record_is_removed_only_by_the_command_it_names(bench):
    """The first replace's failed B once removed the state file whatever it named by then (the second's server
    went unrecorded): now a record that names another server (pid or start time) stays."""
    cfg = bench.cfg()
    cfg.instance_dir.mkdir(parents=True, exist_ok=True)
    mine, theirs = _record(cfg, 4242, 1.0, "mine"), _record(cfg, 4343, 2.0, "theirs")
    state.write_state(cfg, theirs)
    assert state.clear_state(cfg, mine) is False and state.load_state(cfg).served_name == "theirs"
    assert state.clear_state(cfg, _record(cfg, 4343, 3.0, "recycled pid")) is False
    assert state.clear_state(cfg, theirs) is True and state.load_state(cfg) is None


def test_a_failed_start_does_not_forget_a_record_written_since(bench, monkeypatch):
    """_end_launched of a start whose server is gone leaves a record naming another server."""
    import subprocess as sp

    from tools.serving.server import launch

    cfg = bench.cfg()
    cfg.instance_dir.mkdir(parents=True, exist_ok=True)
    proc = sp.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    state.write_state(cfg, _record(cfg, os.getpid(), 5.0, "another command's"))
    launch.end_launched(cfg, proc)
    assert state.load_state(cfg).served_name == "another command's"


def test_the_lock_refuses_another_thread_and_another_process_and_is_reentrant(bench):
    import threading

    cfg = bench.cfg()
    seen: list[str] = []
    with state.instance_lock(cfg, "start of b"):
        with state.instance_lock(cfg, "start of a again"):  # a replace's rollback, in the same thread
            seen.append("nested")

        def other() -> None:  # an MCP call running beside the start in this process
            try:
                with state.instance_lock(cfg, "stop"):
                    seen.append("not refused")
            except state.InstanceBusy as exc:
                seen.append(str(exc))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        r = bench.run("stop")  # another process; nothing recorded, but the state file check comes first
        cfg.state_file.write_text("{}")
        r2 = bench.run("stop")
        cfg.state_file.unlink()
    assert seen[0] == "nested" and BUSY in seen[1] and "another call of this server" in seen[1]
    assert r.returncode == 0 and "no server recorded" in r.stdout
    _refused(r2, "stop")
    assert "start of b" in r2.stderr and str(os.getpid()) in r2.stderr
    assert not state.lock_file(cfg).exists()  # an instance that records nothing keeps no lock file


def test_the_measuring_clients_send_the_key(monkeypatch):
    """Every client of the server sends the bearer key from VLLM_API_KEY: the model listing of the measurements
    (provenance, ServerClient: capacity, fidelity), compare's greedy generation, and the children that read
    OPENAI_API_KEY (vllm bench serve in the sweep's worker, lm-eval)."""
    from tests.helpers.stand_ins.measure import keyed_stand_in, serve_in_thread
    from tools.core.api_key import with_client_key
    from tools.measure.tokens.compare import generate
    from tools.measure.provenance import server_info
    from tools.measure.server_client import ServerClient

    key = "k-" + "x" * 40
    monkeypatch.setenv("VLLM_API_KEY", key)
    seen: list[str | None] = []
    with serve_in_thread(keyed_stand_in(key, seen)) as url:
        assert server_info(url).model_id == "m"
        ServerClient(url, 10.0)
        try:
            generate(url, ["hi"], max_tokens=1, top_logprobs=0)
        except Exception:  # the stand-in's answer may not be a whole record: what it was sent is the point
            pass
    assert len(seen) >= 3 and set(seen) == {f"Bearer {key}"}
    assert with_client_key({"A": "1"}) == {"A": "1", "OPENAI_API_KEY": key}
    monkeypatch.delenv("VLLM_API_KEY")
    assert with_client_key({"A": "1"}) == {"A": "1"}
