"""A server a command starts for itself (decode-sweep's, the demo's) ends with that command, however it ends.

The server runs in a session of its own (tools.serving.server.launch: so that stop can end it with its engine), so a
command killed with SIGKILL, which runs no clean-up, would leave it serving and its state file would refuse the
next start. `owned_server(state_file)` keeps a guard process beside the command for the block: it learns from the
state file each server the command starts (the leader's parent is the command), and when the command is gone
(the guard's end of a pipe from it closes) it ends each one still running with its group and removes the state
file that names it. A block that ends normally releases the guard: the command stopped its servers itself.
The Server object (tools.serving.server.server) is its user: its `with` block, and a start until it is ready.

A server started with `start` (or start_vllm_server) is meant to outlive the command: it is guarded only until it
is ready and recorded (the start's block), then handed over. A failed replace's way back (the server that was
running, launched again: tools.serving.server.launch.relaunch) is handed over before its launch (`hand_over`): the
command's death, even while it loads, must not end the service the replace was to keep.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

from tools.core.errors import ToolFailure
from tools.core.process import end_group, python_child_env, same_process
from tools.core.root import PROJECT_ROOT
from tools.serving.records.state import DamagedState, ServerState, our_group, read_record

_POLL_S = 0.1
_RELEASE = b"release\n"
# (thread, state file) -> the write ends of the pipes to its guards, for this process's owned_server blocks:
# server.py runs several at once, from threads (two for one instance: the instance's lock refuses one of them)
_guards: dict[tuple[int, str], list[int]] = {}
_guards_lock = threading.Lock()


def _key(state_file: str | Path) -> tuple[int, str]:
    return threading.get_ident(), str(Path(state_file).resolve())


def _release(w: int) -> None:
    try:
        os.write(w, _RELEASE)
    except OSError:  # the guard is gone
        pass


def hand_over(state_file: str | Path) -> None:
    """Releases the guard of `state_file` that this thread's owned_server block keeps: what this thread launches
    from here on outlives the process. Called before a launch there is no window: a command killed before the
    state file names the server ends the launch's gate, so nothing is left unrecorded (tools.serving.server.launch). A
    no-op where no such guard runs."""
    with _guards_lock:
        held = _guards.get(_key(state_file))
        w = held.pop() if held else None
    if w is not None:
        _release(w)


@contextmanager
def owned_server(state_file: str | Path) -> Iterator[None]:
    """For the block: every server this process starts that `state_file` records is ended with its group when
    this process is gone, even by SIGKILL (until `hand_over` from this thread)."""
    key = _key(state_file)
    r, w = os.pipe()
    try:
        guard = subprocess.Popen([sys.executable, "-m", "tools.serving.server.guard", str(state_file),
                                  str(os.getpid())], stdin=r, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 env=python_child_env(PROJECT_ROOT), start_new_session=True)
    finally:
        os.close(r)
    try:
        assert guard.stdout is not None
        if guard.stdout.readline() != b"ready\n":  # not before it watches: the start comes right after
            guard.wait()
            raise ToolFailure(f"the guard of the server recorded in {state_file} did not start "
                              f"(exit status {guard.returncode})")
        with _guards_lock:
            _guards.setdefault(key, []).append(w)
        yield
    finally:
        with _guards_lock:
            held = _guards.get(key, [])
            mine = w in held  # not handed over meanwhile
            if mine:
                held.remove(w)
            if not held:
                _guards.pop(key, None)
        if mine:
            _release(w)
        os.close(w)
        try:
            guard.wait(timeout=10)
        except subprocess.TimeoutExpired:
            guard.kill()
            guard.wait()
        if guard.stdout is not None:
            guard.stdout.close()


def _record(state_file: Path) -> ServerState | None:
    try:
        return read_record(state_file, ServerState)
    except DamagedState:
        return None  # being written, or damaged: nothing it names is signalled


def _owned_by(st: ServerState, owner: int) -> bool:
    proc = same_process(st.pid, st.create_time)
    try:
        return proc is not None and proc.ppid() == owner
    except psutil.Error:  # gone meanwhile
        return False


def guard(state_file: Path, owner: int) -> int:
    """The guard's loop: 0 once released, after ending the owner's servers once the owner is gone."""
    began = time.time()
    seen: dict[int, ServerState] = {}
    print("ready", flush=True)
    while True:
        if select.select([0], [], [], _POLL_S)[0]:
            data = os.read(0, 64)
            if data.startswith(_RELEASE):
                return 0
            if not data:
                break  # the owner is gone without releasing: its servers go too
        st = _record(state_file)
        if st is not None and st.pid not in seen and _owned_by(st, owner):
            seen[st.pid] = st
    # A server launched in the last poll interval before the owner died: started since the guard, not seen with
    # another parent, its leader now adopted by init.
    st = _record(state_file)
    if st is not None and st.pid not in seen and st.create_time >= began and same_process(st.pid, st.create_time):
        seen[st.pid] = st
    for st in seen.values():
        if same_process(st.pid, st.create_time) is None and not our_group(st):
            continue  # stopped by the owner, or died
        end_group(st.pgid, grace_s=5)
        now = _record(state_file)
        if now is not None and now.pid == st.pid:
            state_file.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(guard(Path(sys.argv[1]), int(sys.argv[2])))
