"""Records forged to name a stranger: a same-user process started as `setsid sleep` with its real pid, group
(== pid) and start time passes every check but one, that it is the program the project launched for the record
(its launch token, records.identity.LAUNCH_ENV). Such a record is damaged: stop signals nothing it names, and the
real server it hides is shown by status and stop (records.state.unrecorded). The front door and its builds are
stand-in processes launched as the project launches them (tests/serving/conftest.py's fleet)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from tests.helpers.fixtures import free_port, state_env


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _forged(record: dict, proc: subprocess.Popen) -> str:
    """`record` made to name `proc` with its real pid, group and start time (and the record's token kept)."""
    return json.dumps({**record, "pid": proc.pid, "pgid": proc.pid,
                       "create_time": psutil.Process(proc.pid).create_time()})


def test_a_router_record_naming_a_stranger_signals_nobody_and_status_shows_the_router(cli_here, tmp_path, fleet,
                                                                                        stranger):
    port = free_port()
    blue = fleet("blue", free_port(), serve=True, door_port=port)
    router = fleet("router", port, serve=True, backends=("blue",))
    run = tmp_path / "run"
    (run / "router.json").write_text(_forged(router, stranger))
    env = state_env(run, PORT=str(port), FRONT_DOOR="1")

    r = cli_here(["status"], env)
    assert r.returncode != 0 and f"pid {router['pid']}" in r.stdout and f"port {port}" in r.stdout, r.stdout

    r = cli_here(["stop", "--grace", "2"], env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "router.json is damaged" in line and "launch token" in line, line
    assert f"kill -TERM -- -{router['pid']}" in line, line
    assert stranger.poll() is None and _alive(router["pid"]) and not _alive(blue["pid"])


def test_a_build_record_naming_a_stranger_signals_nobody_and_stop_names_the_build(cli_here, tmp_path, fleet,
                                                                                    stranger):
    blue = fleet("blue", free_port(), serve=True)
    run = tmp_path / "run"
    (run / "blue" / "vllm.json").write_text(_forged(blue, stranger))
    env = state_env(run, PORT=str(free_port()))

    r = cli_here(["stop", "--instance", "blue", "--grace", "2"], env)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "blue/vllm.json is damaged" in r.stderr and "launch token" in r.stderr, r.stderr
    assert stranger.poll() is None and _alive(blue["pid"])

    r = cli_here(["status"], env)
    assert r.returncode != 0 and f"pid {blue['pid']}" in r.stdout + r.stderr, (r.stdout, r.stderr)
    assert stranger.poll() is None and _alive(blue["pid"])


def test_a_default_record_naming_a_stranger_is_damaged(cli_here, tmp_path, fleet, stranger):
    default = fleet("default", free_port(), serve=True)
    run = tmp_path / "run"
    (run / "vllm.json").write_text(_forged(default, stranger))
    r = cli_here(["stop", "--grace", "2"], state_env(run, PORT=str(default["port"])))
    assert r.returncode == 1 and "vllm.json is damaged" in r.stderr and "launch token" in r.stderr, r.stderr
    assert stranger.poll() is None and _alive(default["pid"])


def test_a_record_of_a_dead_leader_spares_a_strangers_group_of_that_number(cli_here, tmp_path, fleet):
    """A record naming a pid that is gone, whose group number a stranger's processes still hold (their leader
    exited): nothing of that group carries the record's launch token, so nothing is signalled."""
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess; subprocess.Popen(['sleep', '1000'])"],
                              start_new_session=True)
    leader.wait()
    deadline = time.monotonic() + 10
    left = []
    while not left and time.monotonic() < deadline:
        left = [p for p in psutil.process_iter() if _pgid(p.pid) == leader.pid]
    assert left
    try:
        default = fleet("default", free_port())
        run = tmp_path / "run"
        (run / "vllm.json").write_text(json.dumps({**default, "pid": leader.pid, "pgid": leader.pid,
                                                   "create_time": time.time() - 1}))
        r = cli_here(["stop", "--grace", "2"], state_env(run, PORT=str(default["port"])))
        assert "Traceback" not in r.stderr, r.stderr
        assert all(_alive(p.pid) for p in left), r.stdout + r.stderr
    finally:
        for p in left:
            p.kill()


def _pgid(pid: int) -> int | None:
    import os

    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_a_launched_vllm_keeps_its_token_readable_when_it_retitles_itself(tmp_path):
    """vLLM renames its processes (setproctitle), which would overwrite the environment /proc shows: the launch
    environment keeps it (SPT_NOENV), so a retitled server is still recognised as the one launched."""
    from tools.serving.records.identity import carries, launch_env, new_launch

    token = new_launch()
    p = subprocess.Popen([sys.executable, "-c", "import setproctitle, sys, time; setproctitle.setproctitle("
                          "'VLLM::EngineCore' * 8); print(flush=True); time.sleep(60)"],
                         env={**_env(), **launch_env(token)}, stdout=subprocess.PIPE, start_new_session=True)
    try:
        p.stdout.readline()
        proc = psutil.Process(p.pid)
        assert proc.cmdline()[0].startswith("VLLM::EngineCore") and carries(proc, token)
    finally:
        p.kill()
        p.wait()


def _env() -> dict[str, str]:
    """This run's environment without SPT_NOENV (the test run sets it: tests/helpers/reaper.py), so that what
    keeps a launched process's environment readable is the launch environment's own."""
    import os

    return {k: v for k, v in os.environ.items() if k != "SPT_NOENV"}


def test_a_stepped_wall_clock_does_not_make_a_launched_leader_a_stranger():
    """psutil's start time moves with the wall clock's boot time (a stepped clock shifted it by 66 s on this
    project's test machine, and a running server read as died): a leader that carries its record's launch token is
    the record's process whatever the start time says; without the token the start time still decides."""
    from tools.serving.records.state import ProcessRecord
    from tests.helpers.fixtures import launched

    proc, token = launched(["sleep", "1000"])
    try:
        started = psutil.Process(proc.pid).create_time()
        stepped = ProcessRecord(pid=proc.pid, pgid=proc.pid, create_time=started - 66.0, launch=token)
        assert stepped.leader() is not None and stepped.leader().pid == proc.pid
        assert not stepped.recycled() and proc.pid in [p.pid for p in stepped.group()]
        untokened = ProcessRecord(pid=proc.pid, pgid=proc.pid, create_time=started - 66.0)
        assert untokened.leader() is None and untokened.recycled() and untokened.group() == []
    finally:
        proc.kill()
        proc.wait()


def test_status_of_a_record_whose_pid_is_another_process_now_says_so(cli_here, tmp_path, fleet, stranger):
    """A record naming a live pid with another start time (a recycled pid): status said "died (killed, or
    exited)" where stop said the pid belongs to another process now; both say the latter, and nothing is
    signalled."""
    default = fleet("default", free_port())
    run = tmp_path / "run"
    (run / "vllm.json").write_text(json.dumps({**default, "pid": stranger.pid, "pgid": stranger.pid,
                                               "create_time": psutil.Process(stranger.pid).create_time() - 5}))
    r = cli_here(["status"], state_env(run, PORT=str(default["port"])))
    assert f"server pid {stranger.pid} is gone (the pid now belongs to another process)" in r.stdout, r.stdout
    assert "died (killed" not in r.stdout and stranger.poll() is None


def test_a_leader_killed_a_moment_ago_is_a_dead_server_not_a_stranger(tmp_path, monkeypatch):
    """While the kernel tears down a leader just killed (SIGKILL), its environment reads empty: its record read as
    naming a process "not launched for this record" (DamagedState, which a sweep's status poll raised). A leader
    that ends while its environment cannot be read is a dead server; one that runs on without its token is not."""
    import signal
    import threading

    from tests.helpers.fixtures import launched
    from tools.serving.records.state import DamagedState, ProcessRecord, read_record

    def record(proc, token):
        path = tmp_path / f"{proc.pid}.json"
        path.write_text(json.dumps({"pid": proc.pid, "pgid": proc.pid, "launch": token,
                                    "create_time": psutil.Process(proc.pid).create_time()}))
        return path

    monkeypatch.setattr(psutil.Process, "environ", lambda self: {})  # as during the teardown
    dying, token = launched(["sleep", "30"])
    path = record(dying, token)
    threading.Timer(0.3, lambda: dying.send_signal(signal.SIGKILL)).start()
    assert read_record(path, ProcessRecord).pid == dying.pid  # not damaged
    dying.wait()
    running, token = launched(["sleep", "30"])
    try:
        with pytest.raises(DamagedState, match="not the process launched for this record"):
            read_record(record(running, token), ProcessRecord)
    finally:
        running.kill()
        running.wait()
