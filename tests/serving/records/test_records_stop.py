"""Records trusted only as far as they are checked, and a stop that stops what it can prove is the project's and
says what it could not: a router record naming another process group, a damaged router record, a damaged build
record (then deleted) while the build still serves on its port, and a user's own instance named like one of the
front door's slots. The front door and its builds are stand-in processes with records as start writes them
(tests/serving/conftest.py's fleet), each started from its folder under STATE_DIR as a launch starts it."""

from __future__ import annotations

import json

import psutil
import pytest

from tests.helpers.fixtures import free_port, state_env


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _door(fleet, port: int) -> tuple[dict, dict]:
    """The front door on `port` (a stand-in router process, its record) over build blue (serving, its record)."""
    blue = fleet("blue", free_port(), serve=True, door_port=port)
    router = fleet("router", port, serve=True, backends=("blue",))
    return router, blue


def _env(run, port: int, **extra: str) -> dict[str, str]:
    return state_env(run, **{"PORT": str(port), "FRONT_DOOR": "1", **extra})


def test_a_router_record_naming_a_strangers_group_is_damaged_and_signals_nobody(cli_here, tmp_path, fleet):
    """router.json with a live process's pid and start time and another process's group: stop kills neither,
    says the record is damaged (its pgid) in one line, rc != 0."""
    port = free_port()
    router, _ = _door(fleet, port)
    stranger = fleet("stranger", free_port())
    run = tmp_path / "run"
    (run / "router.json").write_text(json.dumps({**router, "pgid": stranger["pid"]}))
    r = cli_here(["stop", "--grace", "2"], _env(run, port))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "router.json is damaged" in line and "pgid" in line, line
    assert "field '?'" not in line and "value error" not in line.lower(), line  # pydantic's words, not ours
    assert _alive(router["pid"]) and _alive(stranger["pid"])


@pytest.mark.parametrize("damage", ['"pid": "abc"', "truncated"])
def test_a_damaged_router_record_stops_the_builds_and_names_the_router_it_could_not(cli_here, tmp_path, fleet,
                                                                                    damage):
    port = free_port()
    router, blue = _door(fleet, port)
    run = tmp_path / "run"
    text = (run / "router.json").read_text()
    (run / "router.json").write_text(text[:100] if damage == "truncated"
                                     else json.dumps({**router, "pid": "abc"}))

    r = cli_here(["status"], _env(run, port))
    assert r.returncode == 3 and f"pid {router['pid']}" in r.stdout and f"port {port}" in r.stdout, r.stdout

    r = cli_here(["stop", "--grace", "2"], _env(run, port))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "router.json is damaged" in line and f"pid {router['pid']}" in line, line
    assert f"port {port}" in line and f"kill -TERM -- -{router['pid']}" in line, line
    assert not _alive(blue["pid"]) and _alive(router["pid"])  # the build's record proves it; the router's not


def test_a_damaged_build_record_is_reported_and_its_build_found_until_it_is_ended(cli_here, tmp_path, fleet):
    port = free_port()
    router, blue = _door(fleet, port)
    run = tmp_path / "run"
    record = run / "blue" / "vllm.json"
    record.write_text(record.read_text()[:100])

    r = cli_here(["stop", "--grace", "2"], _env(run, port))
    assert r.returncode == 1, r.stderr
    [line] = r.stderr.strip().splitlines()
    assert "stopped the router" in line and "blue/vllm.json is damaged" in line, line
    assert f"pid {blue['pid']}" in line and f"port {blue['port']}" in line, line
    assert not _alive(router["pid"]) and _alive(blue["pid"])

    record.unlink()  # as the damaged record's line advises: its build is still found by status and stop
    r = cli_here(["status"], _env(run, port))
    assert r.returncode == 3 and f"pid {blue['pid']}" in r.stdout and "None" not in r.stdout, r.stdout
    r = cli_here(["stop", "--grace", "2"], _env(run, port))
    assert r.returncode == 1 and f"kill -TERM -- -{blue['pid']}" in r.stderr, r.stderr
    assert "no server recorded" not in r.stderr and _alive(blue["pid"])


@pytest.mark.parametrize("front_door", ["1", "0"])
def test_stop_leaves_a_users_own_instance_named_like_a_slot(cli_here, tmp_path, fleet, front_door):
    """`start --instance green --port P` is the user's own, not the door's: a plain stop (FRONT_DOOR=1, or 0 with
    the door started before still on PORT) ends the door and its build only."""
    port = free_port()
    router, blue = _door(fleet, port)
    green = fleet("green", free_port(), serve=True)
    r = cli_here(["stop", "--grace", "2"], _env(tmp_path / "run", port, FRONT_DOOR=front_door))
    assert r.returncode == 0, r.stderr
    assert _alive(green["pid"]) and not _alive(blue["pid"]) and not _alive(router["pid"])


def test_a_start_while_a_stop_ends_the_doors_build_advises_start_after_it(cli_here, tmp_path, fleet):
    """`stop &` then `start`: the door's router already gone, its build still being stopped (its instance's lock
    held): start is refused naming that command and advising a plain start once it ends, not told the build was
    left by a door that is gone."""
    from tools.serving.records import state
    from tools.serving.config import load_config

    port = free_port()
    blue = fleet("blue", free_port(), serve=True, door_port=port)
    run = tmp_path / "run"
    env = _env(run, port)
    with state.instance_lock(load_config(state_dir=str(run), instance="blue"), "stop"):
        r = cli_here(["start", "--model", str(tmp_path)], env)
    assert r.returncode == 1 and "being changed by another command" in r.stderr and "stop" in r.stderr, r.stderr
    assert "without the front door" not in r.stderr and r.stderr.rstrip().endswith("then `./vllm-t4 start`")
    assert _alive(blue["pid"])


def test_a_record_naming_another_users_process_is_damaged_and_signals_nobody(cli_here, tmp_path, fleet):
    """router.json naming a live process of another user (its pid, start time, own group): not the project's;
    stop signals nothing of it and names the record in one line, rc 1."""
    import os
    import subprocess

    if os.getuid() != 0:
        pytest.skip("starting another user's process needs root")
    port = free_port()
    router, blue = _door(fleet, port)
    theirs = subprocess.Popen(["sleep", "300"], start_new_session=True, user=65534, group=65534)
    try:
        run = tmp_path / "run"
        (run / "router.json").write_text(json.dumps({**router, "pid": theirs.pid, "pgid": theirs.pid,
                                                     "create_time": psutil.Process(theirs.pid).create_time()}))
        r = cli_here(["stop", "--grace", "2"], _env(run, port))
        [line] = r.stderr.strip().splitlines()
        assert r.returncode == 1 and "router.json is damaged" in line and "another user" in line, r.stderr
        assert theirs.poll() is None and not _alive(blue["pid"])
    finally:
        theirs.kill()
        theirs.wait()


def test_status_through_the_door_fails_while_another_instances_record_is_damaged(cli_here, tmp_path, fleet):
    """The front door serving over a healthy build once made a plain status exit 0 though instance x's record
    was damaged: it says so and exits 3, as for a single instance."""
    port = free_port()
    _door(fleet, port)
    run = tmp_path / "run"
    r = cli_here(["status"], _env(run, port))
    assert r.returncode == 0, r.stdout
    (run / "x").mkdir()
    (run / "x" / "vllm.json").write_text('{"pid": "abc"}')
    r = cli_here(["status"], _env(run, port))
    assert r.returncode == 3 and "x/vllm.json is damaged" in r.stdout, r.stdout
    assert "the record of instance x is damaged" in r.stdout, r.stdout


def test_a_users_own_server_started_in_state_dir_is_not_reported_as_the_projects(cli_here, tmp_path):
    """A `setsid python3 -m http.server` whose working folder is STATE_DIR made status exit 3 and stop exit 1
    ("could not be stopped"), as a server of the project's no record names: only what carries a launch token is
    (status: not running, exit 3 as for any stopped service)."""
    import subprocess
    import sys
    import time

    from tests.helpers.fixtures import default_signals

    run = tmp_path / "run"
    run.mkdir()
    port = free_port()
    theirs = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)], cwd=run,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              preexec_fn=default_signals)
    try:
        deadline = time.monotonic() + 30
        while not any(c.laddr.port == port for c in psutil.Process(theirs.pid).net_connections(kind="inet")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = cli_here(["status"], _env(run, free_port()))
        assert r.stdout.startswith("not running (no server recorded") and str(theirs.pid) not in r.stdout, r.stdout
        r = cli_here(["stop", "--grace", "1"], _env(run, free_port()))
        assert r.returncode == 0 and str(theirs.pid) not in r.stderr, r.stderr
        assert theirs.poll() is None
    finally:
        theirs.kill()
        theirs.wait()
