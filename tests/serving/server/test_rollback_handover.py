"""A plain replace whose B fails starts A again: that A is the service that was running, so once its way back is
launched it outlives the command, even a SIGKILL of the command while A is still loading (the start's guard,
tools.serving.server.guard, hands it over at its launch), and no replace record then says A was stopped.

Each command is `./vllm-t4` in a process of its own with tests/helpers/stand_ins/vllm_server.py where vLLM would be."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers.serving import Bench, until
from tools.serving.records import state
from tools.serving.server.guard import hand_over, owned_server
from tools.serving.server.server import server_status


@pytest.fixture
def bench(tmp_path):
    b = Bench(tmp_path)
    yield b
    b.stop()


def _guards_of(owner: int) -> list[psutil.Process]:
    """The server guards watching process `owner` (python -m tools.serving.server.guard STATE_FILE OWNER)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "tools.serving.server.guard" in cmd and cmd[-1:] == [str(owner)]:
            found.append(proc)
    return found


def _starts_of(bench: Bench, name: str) -> list[dict]:
    return [s for s in bench.starts() if Path(s["model"]).name == name]


def test_a_sigkill_while_the_rollback_s_a_loads_leaves_a_serving(bench, tmp_path):
    bench.build("a")
    bench.build("b", mode="exit")
    assert bench.run("start", "--model", str(bench.tmp / "a")).returncode == 0
    first = state.load_state(bench.cfg())
    first_a = first.pid
    assert first.startup_s is not None
    go = tmp_path / "go"  # A's second start loads until this file exists
    (bench.tmp / "a" / "behaviour.json").write_text(json.dumps({"answer": "ok", "until": str(go)}))
    p = bench.popen("start", "--model", str(bench.tmp / "b"), "--replace")
    guards: list[psutil.Process] = []
    try:
        until("b launched", lambda: bool(_starts_of(bench, "b")), p)
        until("a launched again", lambda: len(_starts_of(bench, "a")) == 2, p)
        guards = _guards_of(p.pid)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    # the command's guard has done what it does when its command is gone (and has ended)
    gone, alive = psutil.wait_procs(guards, timeout=30)
    assert alive == [], alive
    again = _starts_of(bench, "a")[-1]["pid"]
    assert again != first_a and psutil.pid_exists(again)
    rec = state.load_state(bench.cfg())
    assert rec is not None and rec.pid == again and rec.served_name == "a"
    # A's time to ready carried over to its new record (a front door's hold is bounded by it) until it has its own
    assert rec.startup_s == first.startup_s
    go.touch()
    deadline = time.monotonic() + 30
    while not server_status(bench.cfg()).healthy:
        assert time.monotonic() < deadline, server_status(bench.cfg()).message
        time.sleep(0.1)
    # A serves, recorded; B is gone; no replace record says A was stopped
    bench.check_true_and_nothing_orphaned("a")


def test_a_hand_over_releases_only_the_guard_of_its_own_thread(tmp_path):
    """server.py runs starts from threads, two for one instance at once (the instance's lock refuses one): the
    hand-over of one start's way back releases that start's guard only; the other stays until its block ends."""
    state_file = tmp_path / "vllm.json"
    inside = [threading.Event(), threading.Event()]
    go_hand, handed, leave = threading.Event(), threading.Event(), threading.Event()

    def block(n: int) -> None:
        with owned_server(state_file):
            inside[n].set()
            if n == 0:
                go_hand.wait(60)
                hand_over(state_file)
                handed.set()
            leave.wait(60)

    threads = [threading.Thread(target=block, args=(n,)) for n in (0, 1)]
    try:
        threads[0].start()
        assert inside[0].wait(60)
        (first,) = _guards_of(os.getpid())
        threads[1].start()  # entered after the first: the newest guard of this state file in the process
        assert inside[1].wait(60)
        (second,) = [g for g in _guards_of(os.getpid()) if g.pid != first.pid]
        go_hand.set()
        assert handed.wait(60)
        first.wait(30)  # the first thread's guard, released, ends
        assert second.is_running() and second.status() != psutil.STATUS_ZOMBIE  # the other one watches on
    finally:
        go_hand.set()
        leave.set()
        for t in threads:
            t.join(60)
    assert _guards_of(os.getpid()) == []
