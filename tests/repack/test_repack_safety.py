"""No build may destroy data: where an output may go, what --force may replace, the swap under signals and
crashes, leftovers of killed builds, builds stopped in worker threads, and the command line's edge cases."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from repack.grid import grid
from tools.cli import repack_cli as cli
from tools.core import atomic, atomic_leftovers as leftovers, atomic_renames as renames
from repack.build.build import BuildOptions, build_checkpoint
from repack.source.checkpoint import open_checkpoint
from repack.errors import RepackError
from repack.stand_ins.synthetic import write_small_checkpoint

from tests.helpers.fixtures import default_signals, one_line_error, reaped, repack_cli

ROOT = Path(__file__).resolve().parents[2]
FULL = ["--text-only", "--embed-int4", "--embed-tokens"]




def _tree(p: Path) -> dict[str, bytes]:
    """Every file below p with its content: what 'nothing touched' compares."""
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def _clean(folder: Path) -> bool:
    """No temporary folder and no lock file of a build is left in `folder`."""
    return _leftovers(folder) == [] and not [p for p in folder.iterdir() if ".lock-" in p.name]


def _kind(out: Path) -> str:
    """Which of the two test builds OUT holds, checked complete: 'old' (bf16 linears) or 'new' (full build)."""
    rep = json.loads((out / "repack-report.json").read_text())
    assert sorted(os.listdir(out)) == rep["files"]
    open_checkpoint(out)
    return "old" if not rep["options"]["quantize_linears"] else "new"


@pytest.fixture
def src(tmp_path) -> Path:
    return write_small_checkpoint(tmp_path / "qat")


@pytest.fixture
def fresh_stop(monkeypatch):
    monkeypatch.setattr(atomic, "_stop", threading.Event())


# -- 1. where an output may go, what --force may replace ------------------------------------------------------

def test_output_above_the_source_is_refused_and_nothing_is_touched(tmp_path, capsys):
    models = tmp_path / "models"
    src = write_small_checkpoint(models / "qat")
    (models / "notes.txt").write_text("keep me")
    before = _tree(models)
    rc, err = repack_cli(capsys, "build", src, models, *FULL, "--force")
    assert rc == 2
    one_line_error(err, str(models), "above the source")
    assert _tree(models) == before and _clean(tmp_path) and _clean(models)


def test_the_article_scripts_refuse_too(tmp_path):
    models = tmp_path / "models"
    src = write_small_checkpoint(models / "qat")
    before = _tree(models)
    for args in (["repack/repack_q4_0.py", "repack", str(src), str(models), "--force"],
                 ["repack/text_only.py", str(src), str(models), "--force"],
                 ["repack/embed_int4.py", str(src), str(models), "--embed-tokens", "--force"]):
        r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert r.returncode == 2, (args, r.stderr)
        one_line_error(r.stderr, "above the source")
    assert _tree(models) == before and _clean(tmp_path)


@pytest.mark.parametrize("where", ["same", "inside", "link-to-source", "link-above-source"])
def test_output_is_never_the_source_inside_or_around_it(tmp_path, capsys, where):
    models = tmp_path / "models"
    src = write_small_checkpoint(models / "qat")
    before = _tree(tmp_path)
    out = {"same": src, "inside": src / "sub" / "out", "link-to-source": tmp_path / "ln",
           "link-above-source": tmp_path / "ln2" / "qat-parent"}[where]
    if where == "link-to-source":
        out.symlink_to(src)
    if where == "link-above-source":
        (tmp_path / "ln2").mkdir()
        out.symlink_to(models)
    rc, err = repack_cli(capsys, "build", src, out, *FULL, "--force")
    assert rc == 2
    one_line_error(err, "source")
    assert _tree(tmp_path) == before
    assert not (src / "sub").exists()


def test_protected_roots_and_folders_above_them_are_refused(src, tmp_path):
    root = tmp_path / "models"
    build_checkpoint(src, root / "a", BuildOptions())
    before = _tree(tmp_path)
    for out in (root, tmp_path, root / "a" / ".."):
        with pytest.raises(RepackError, match="root, the home or the working folder"):
            build_checkpoint(src, out, BuildOptions(force=True), protected_roots=[root])
    assert _tree(tmp_path) == before
    build_checkpoint(src, root / "a", BuildOptions(force=True), protected_roots=[root])  # inside a root: fine


def test_filesystem_root_is_refused(src):
    with pytest.raises(RepackError, match="file system root"):
        build_checkpoint(src, "/", BuildOptions(force=True))


def test_build_into_the_working_folder_is_refused(src, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("x")
    monkeypatch.chdir(work)
    for out in (".", "..", str(work)):
        rc, err = repack_cli(capsys, "build", src, out, "--force")
        assert rc == 2, err
        one_line_error(err, "working folder")
        assert "Traceback" not in err
    assert _tree(work) == {"mine.txt": b"x"} and (tmp_path / "qat" / "config.json").exists()


def test_force_replaces_only_an_empty_folder_or_exactly_a_build(src, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = repack_cli(capsys, "build", src, out, "--force")
    assert rc == 2
    one_line_error(err, "keep.txt", "--force replaces only")
    assert _tree(out) == {"keep.txt": b"mine"}

    (out / "keep.txt").unlink()  # an empty folder: replaced
    rc, err = repack_cli(capsys, "build", src, out, "--keep-linears", "--force")
    assert rc == 0, err
    rep = json.loads((out / "repack-report.json").read_text())
    assert rep["files"] == sorted(os.listdir(out)) and "repack-report.json" in rep["files"]
    rc, err = repack_cli(capsys, "build", src, out, "--force")  # exactly a build this tool wrote: replaced
    assert rc == 0, err
    assert _kind(out) == "new"

    (out / "notes.md").write_text("my notes on this build")  # a build plus a file of the user's: refused
    before = _tree(out)
    rc, err = repack_cli(capsys, "build", src, out, "--force", "--keep-linears")
    one_line_error(err, "notes.md", "does not list")
    assert rc == 2 and _tree(out) == before
    (out / "notes.md").unlink()

    rep.pop("files")  # a report without a file list (an older build): refused
    (out / "repack-report.json").write_text(json.dumps(rep))
    before = _tree(out)
    rc, err = repack_cli(capsys, "build", src, out, "--force")
    one_line_error(err, "no file list")
    assert rc == 2 and _tree(out) == before and _clean(tmp_path)


def test_force_refuses_a_symlinked_output(src, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "out").symlink_to(elsewhere)
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out", "--force")
    assert rc == 2
    one_line_error(err, "symbolic link")
    assert (tmp_path / "out").is_symlink() and elsewhere.is_dir()


def test_temporary_folders_live_beside_the_output(src, tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(atomic, "_step", lambda s: seen.extend(_leftovers(tmp_path / "m")))
    build_checkpoint(src, tmp_path / "m" / "out", BuildOptions())
    assert seen and all(n.startswith(f".out.partial-{os.getpid()}-") for n in seen)
    assert _clean(tmp_path) and _clean(tmp_path / "m")


# -- 2. the swap: OUT is always the old or the new build, and the message says which ---------------------------

STEPS_EXCHANGE = ["publish", "exchanged", "replaced"]
STEPS_JOURNAL = ["publish", "old-aside", "published", "replaced"]
WRITTEN_AFTER = {"publish": False, "exchanged": True, "old-aside": True, "published": True, "replaced": True}


def _no_exchange(monkeypatch):
    real = renames.renameat2

    def stand_in(a, b, flags):
        if flags == renames.RENAME_EXCHANGE:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(a, b, flags)

    monkeypatch.setattr(renames, "renameat2", stand_in)


@pytest.fixture
def old_build(src, tmp_path) -> Path:
    out = tmp_path / "out"
    build_checkpoint(src, out, BuildOptions(quantize_linears=False))
    assert _kind(out) == "old"
    return out


@pytest.mark.parametrize("mode,step", [("exchange", s) for s in STEPS_EXCHANGE] +
                         [("journal", s) for s in STEPS_JOURNAL])
def test_sigterm_at_each_step_of_the_swap(src, old_build, tmp_path, capsys, monkeypatch, mode, step):
    """A real SIGTERM to this process at each step: exit 143, and 'written' exactly when OUT is the new build."""
    if mode == "journal":
        _no_exchange(monkeypatch)
    monkeypatch.setattr(atomic, "_step", lambda s: os.kill(os.getpid(), signal.SIGTERM) if s == step else None)
    rc, err = repack_cli(capsys, "build", src, old_build, "--force")
    line = one_line_error(err, "SIGTERM")
    assert rc == 143
    if WRITTEN_AFTER[step]:
        assert "was written: it is complete" in line and _kind(old_build) == "new"
    else:
        assert "was not written" in line and _kind(old_build) == "old"
    assert _clean(tmp_path)


@pytest.mark.parametrize("mode,step", [("exchange", s) for s in STEPS_EXCHANGE] +
                         [("journal", s) for s in STEPS_JOURNAL])
def test_error_at_each_step_of_the_swap(src, old_build, tmp_path, monkeypatch, mode, step):
    """An exception at each step: OUT is the old build (rolled back) or the new one, and the exception says which."""
    if mode == "journal":
        _no_exchange(monkeypatch)

    def fail(s):
        if s == step:
            raise RuntimeError("injected")

    monkeypatch.setattr(atomic, "_step", fail)
    with pytest.raises(RuntimeError) as ei:
        build_checkpoint(src, old_build, BuildOptions(force=True))
    written = getattr(ei.value, "written", None)
    expect_new = step not in ("publish", "old-aside")
    assert (written is not None) == expect_new
    assert _kind(old_build) == ("new" if expect_new else "old")
    assert _clean(tmp_path)


_KILL_CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from tools.core import atomic, atomic_renames as renames
from tools.cli import repack_cli as cli
if {no_exchange}:
    real = renames.renameat2
    def stand_in(a, b, flags):
        if flags == renames.RENAME_EXCHANGE:
            raise OSError(22, "Invalid argument")
        return real(a, b, flags)
    renames.renameat2 = stand_in
def step(s):
    if s == {step!r}:
        os.kill(os.getpid(), signal.SIGKILL)
atomic._step = step
sys.exit(cli.main(["build", {src!r}, {out!r}, "--force"]))
"""


@pytest.mark.parametrize("mode,step", [("exchange", s) for s in STEPS_EXCHANGE] +
                         [("journal", s) for s in STEPS_JOURNAL])
def test_sigkill_at_each_step_then_the_next_build_recovers(src, old_build, tmp_path, capsys, mode, step):
    """SIGKILL at each step of a real `repack build` process; the next build beside it (run in this process) rolls
    forward or back and says what it removed: OUT is complete in every case and nothing is left over."""
    code = _KILL_CHILD.format(root=str(ROOT), no_exchange=mode == "journal", step=step, src=str(src),
                              out=str(old_build))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    left = _leftovers(tmp_path)
    assert bool(left) == (step != "replaced"), left  # a build killed before its cleanup leaves a folder
    if mode == "journal" and step == "old-aside":
        assert not old_build.exists()  # the crash window the journal exists for
    else:
        assert _kind(old_build) == ("new" if WRITTEN_AFTER[step] else "old")
    rc, err = repack_cli(capsys, "build", src, tmp_path / "other", "--keep-linears")
    assert rc == 0, err
    assert _clean(tmp_path)
    assert _kind(old_build) == ("new" if WRITTEN_AFTER[step] and step != "old-aside" else "old")
    for name in left:
        assert name in err
    if mode == "journal" and step == "old-aside":
        assert "restored" in err


def _dead_owner() -> tuple[int, int]:
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = leftovers.start_ms(p.pid)
    finally:
        p.kill()
        p.wait()
    return p.pid, start


def test_a_crashed_replacement_of_out_is_rolled_back_before_out_is_judged(src, old_build, tmp_path, capsys):
    """The journal's crash window (OUT moved aside, the new build not yet renamed in), its owner dead: the next
    build of the same OUT restores the old build first, then treats OUT as existing."""
    pid, start = _dead_owner()
    token = f"{pid}-{start}-0badc0de"
    (tmp_path / f".out.lock-{token}").touch()  # its lock file, no longer locked
    os.rename(old_build, tmp_path / f".out.old-{token}")
    (tmp_path / f".out.partial-{token}").mkdir()
    (tmp_path / f".out.partial-{token}" / "model-00001-of-00001.safetensors").write_bytes(b"x" * 1000)
    rc, err = repack_cli(capsys, "build", src, old_build)
    assert rc == 2
    assert f"restored {os.path.realpath(old_build)}" in err and f".out.partial-{token}" in err
    assert "already exists" in err.splitlines()[-1]
    assert _kind(old_build) == "old" and _clean(tmp_path)


def test_renameat2_through_the_raw_syscall(tmp_path, monkeypatch):
    """Where libc lacks the renameat2 wrapper (glibc < 2.28), the syscall number is used."""
    import ctypes
    import platform

    if platform.machine() not in renames._SYS_RENAMEAT2:
        pytest.skip(f"no renameat2 syscall number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    monkeypatch.setattr(renames, "_libc", type("NoWrapper", (), {"syscall": libc.syscall})())
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "y").write_text("b")
    renames.renameat2(a, b, renames.RENAME_EXCHANGE)
    assert (a / "y").read_text() == "b" and (b / "x").read_text() == "a"
    with pytest.raises(FileExistsError):
        renames.renameat2(a, b, renames.RENAME_NOREPLACE)


def test_exchange_is_what_publishes_by_default(src, old_build, monkeypatch):
    calls = []
    real = renames.renameat2
    monkeypatch.setattr(renames, "renameat2", lambda a, b, f: (calls.append(f), real(a, b, f))[1])
    monkeypatch.setattr(atomic.os, "rename", lambda *a: pytest.fail("a plain rename was used"))
    build_checkpoint(src, old_build, BuildOptions(force=True))
    assert calls == [renames.RENAME_EXCHANGE] and _kind(old_build) == "new"


# -- 3. leftovers of killed builds; builds in worker threads ----------------------------------------------------

# every block of the grid kernel takes 0.3 s longer: a child build lives long enough to be signalled mid-way
_SLOW_QUANTIZE = """
real = grid.quantize
def slow(*args, **kwargs):
    time.sleep(0.3)
    return real(*args, **kwargs)
grid.quantize = slow
"""

_SLOW_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from repack.grid import grid
from tools.cli import repack_cli as cli
""" + _SLOW_QUANTIZE + """{extra}
sys.exit(cli.main(["build", {src!r}, {out!r}, "--text-only", "--embed-int4", "--embed-tokens"]))
"""
# copied blocks reach the kernel through pwrite, which answers EFAULT for a vanished page instead of SIGBUS:
# touched here first, every block reads the source as the grid kernel does
_TOUCH_COPIES = """
import os
from repack.build import build
real_copy = build._copy_block
def touching(mf, it, writers, start, length):
    if length > 0:
        mf.view(it.src, start, length).tobytes()
        if os.environ.get("MAPPED_MARK"):  # the source is mapped: what happens to it now happens under the map
            open(os.environ["MAPPED_MARK"], "a").close()
    return real_copy(mf, it, writers, start, length)
build._copy_block = touching
"""


def _start_slow_build(src: Path, out: Path, extra: str = "") -> subprocess.Popen:
    code = _SLOW_CHILD.format(root=str(ROOT), src=str(src), out=str(out), extra=extra)
    return subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_signals)


def _wait_for_partial(folder: Path, p: subprocess.Popen) -> str:
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        left = _leftovers(folder)
        if left:
            return left[0]
        time.sleep(0.05)
    raise AssertionError(f"no partial folder appeared (exit {p.poll()})")


def test_sigkill_leftover_is_reported_by_probe_and_removed_by_the_next_build(src, tmp_path, capsys):
    out = tmp_path / "out"
    p = _start_slow_build(src, out)
    with reaped(p):
        name = _wait_for_partial(tmp_path, p)
        assert name.startswith(f".out.partial-{p.pid}-")  # the owner's pid (and start time) in the name
        time.sleep(0.5)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
    assert _leftovers(tmp_path) == [name]
    size = sum(f.stat().st_size for f in (tmp_path / name).iterdir())
    assert size > 0
    # The killed build was a process of its own; probe and the next build run in this one (the commands' exit
    # statuses as scripts are test_commands_exit_2_as_scripts' and test_two_real_builds_of_one_output_at_once's).
    capsys.readouterr()
    rc = cli.main(["probe", str(src), "--json"])
    out_, err = capsys.readouterr()
    assert rc == 0, err
    stale = json.loads(out_)["stale_partials"]
    assert len(stale) == 1 and name in stale[0] and f"pid {p.pid}" in stale[0]
    assert _leftovers(tmp_path) == [name]  # probe only reads
    cli.main(["probe", str(src)])
    out_ = capsys.readouterr().out
    assert "stale partial build" in out_ and name in out_
    rc, err = repack_cli(capsys, "build", src, tmp_path / "b2", *FULL)
    assert rc == 0, err
    assert f"removed {tmp_path / name}" in err and f"pid {p.pid}" in err
    assert _clean(tmp_path)
    rep = json.loads((tmp_path / "b2" / "repack-report.json").read_text())
    assert len(rep["removed_partials"]) == 1 and name in rep["removed_partials"][0]


def test_sigbus_from_a_source_truncated_mid_build(tmp_path, tmp_path_factory, monkeypatch):
    """The source shrinks under the memory map: the build dies of SIGBUS; the next build beside it (even one that
    fails on its own bad source) removes the leftover."""
    src = write_small_checkpoint(tmp_path / "qat")
    shard = src / "model.safetensors"
    out = tmp_path / "out"
    # truncated only once the build has mapped the shard (before that it refuses the changed file: exit 2)
    mark = tmp_path_factory.mktemp("mark") / "mapped"
    monkeypatch.setenv("MAPPED_MARK", str(mark))
    p = _start_slow_build(src, out, _TOUCH_COPIES)
    with reaped(p):
        name = _wait_for_partial(tmp_path, p)
        deadline = time.time() + 240
        while not mark.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        os.truncate(shard, 4096)
        _, err = p.communicate(timeout=240)
    assert p.returncode == -signal.SIGBUS, err
    assert _leftovers(tmp_path) == [name] and not out.exists()
    r = subprocess.run([sys.executable, "-m", "repack", "build", str(src), str(tmp_path / "again")], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "past the end of the file" in r.stderr.splitlines()[-1], r.stderr
    assert f"removed {tmp_path / name}" in r.stderr and _clean(tmp_path)


_HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def _stand_in_leftover(folder: Path, name: str, token: str, lock: bool = True) -> Path:
    d = folder / f".{name}.partial-{token}"
    d.mkdir()
    (d / "f").write_bytes(b"x" * 10)
    if lock:
        (folder / f".{name}.lock-{token}").touch()
    return d


def test_liveness_is_the_lock_not_the_pid(src, tmp_path):
    """A partial whose lock is held is live even when the pid in its name is dead (a build in another PID
    namespace names itself by a pid of that namespace); one whose lock is free is stale whatever its pid says;
    one without a lock file is not a build's leftover and is left alone."""
    pid, start = leftovers.own_id()
    dead_pid, dead_start = _dead_owner()
    dead = f"{dead_pid}-{dead_start}-0123abcd"
    held = _stand_in_leftover(tmp_path, "a", dead)
    free = _stand_in_leftover(tmp_path, "b", f"{pid}-{start}-0123abcd")  # this process's identity, but unlocked
    foreign = _stand_in_leftover(tmp_path, "c", dead, lock=False)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(tmp_path / f".a.lock-{dead}")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert [lo.path.name for lo in leftovers.find_stale_partials(tmp_path)] == [free.name]
        rep = build_checkpoint(src, tmp_path / "out", BuildOptions())
        assert held.exists() and foreign.exists() and not free.exists()
        assert [free.name in ln for ln in rep.removed_partials] == [True]
        assert not (tmp_path / f".b.lock-{pid}-{start}-0123abcd").exists()
    finally:
        holder.kill()
        holder.wait()
    rep = build_checkpoint(src, tmp_path / "out2", BuildOptions())  # its owner gone, the held one is stale now
    assert not held.exists() and any(held.name in ln and f"pid {dead_pid}" in ln for ln in rep.removed_partials)
    assert foreign.exists() and _leftovers(tmp_path) == [foreign.name]


def test_job_cancelled_in_a_worker_thread_leaves_nothing(src, tmp_path):
    """The MCP job path: the progress callback raises at the next report; the thread's build cleans up."""
    class Cancelled(Exception):
        pass

    calls = {"n": 0}

    def progress(done, total, message):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Cancelled("job cancelled")

    errors = []
    t = threading.Thread(target=lambda: _catch(errors, build_checkpoint, src, tmp_path / "m" / "out",
                                               BuildOptions(threads=1), progress))
    t.start()
    t.join(120)
    assert [type(e).__name__ for e in errors] == ["Cancelled"]
    assert not (tmp_path / "m").exists()  # nor the parent folder it created


def _catch(errors, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except BaseException as e:  # noqa: BLE001 - the test inspects it
        errors.append(e)


def test_cleanup_own_partials_stops_builds_in_threads(src, tmp_path, monkeypatch, fresh_stop):
    """A process exiting (server SIGTERM) calls cleanup_own_partials(): the worker's build stops and cleans up."""
    real = grid.quantize
    started = threading.Event()

    def slow(*args, **kwargs):
        started.set()
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(grid, "quantize", slow)
    errors = []
    t = threading.Thread(target=lambda: _catch(errors, build_checkpoint, src, tmp_path / "out",
                                               BuildOptions(threads=1)), daemon=True)
    t.start()
    assert started.wait(120) and _leftovers(tmp_path)
    removed = atomic.cleanup_own_partials(wait_s=60)
    t.join(60)
    assert removed == []  # the build removed its own folder
    assert [type(e) for e in errors] == [atomic.Stopped]
    assert _clean(tmp_path) and not (tmp_path / "out").exists()
    with pytest.raises(atomic.Stopped):  # and no new build starts in an exiting process
        build_checkpoint(src, tmp_path / "out", BuildOptions())


def test_cleanup_own_partials_removes_a_stuck_builds_folder(src, tmp_path, fresh_stop):
    release = threading.Event()
    entered = threading.Event()

    def progress(done, total, message):
        entered.set()
        release.wait(120)  # a thread that cannot react in time

    errors = []
    t = threading.Thread(target=lambda: _catch(errors, build_checkpoint, src, tmp_path / "out",
                                               BuildOptions(threads=1), progress), daemon=True)
    t.start()
    assert entered.wait(120)
    [name] = _leftovers(tmp_path)
    removed = atomic.cleanup_own_partials(wait_s=0.2)
    assert removed == [os.path.realpath(tmp_path / name)] and _clean(tmp_path)
    release.set()
    t.join(120)
    assert errors and not (tmp_path / "out").exists() and _clean(tmp_path)


_SERVER_CHILD = """
import os, signal, sys, threading, time
sys.path.insert(0, {root!r})
from repack.grid import grid
from tools.core import atomic
from repack.build.build import BuildOptions, build_checkpoint
""" + _SLOW_QUANTIZE + """def on_term(signum, frame):
    atomic.cleanup_own_partials()
    os._exit(143)
signal.signal(signal.SIGTERM, on_term)
threading.Thread(target=build_checkpoint, args=({src!r}, {out!r}, BuildOptions()), daemon=True).start()
while True:
    time.sleep(1)
"""


def test_server_sigterm_with_a_build_in_a_worker_thread_leaves_nothing(src, tmp_path):
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", _SERVER_CHILD.format(root=str(ROOT), src=str(src), out=str(out))],
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    with reaped(p):
        _wait_for_partial(tmp_path, p)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert _clean(tmp_path) and not out.exists()


# -- 8. the build side's edge cases ----------------------------------------------------------------------------

def test_two_builds_publishing_at_once(src, tmp_path, capsys, monkeypatch):
    """The other build publishes OUT between this one's checks and its rename: one line, exit 2, no leftovers."""
    out = tmp_path / "out"

    fired = []

    def other_publishes(s):
        if s == "publish" and not fired:
            fired.append(s)
            build_checkpoint(src, out, BuildOptions(quantize_linears=False))

    monkeypatch.setattr(atomic, "_step", other_publishes)
    rc, err = repack_cli(capsys, "build", src, out)
    assert rc == 2
    one_line_error(err, str(out), "another build wrote it")
    assert _kind(out) == "old" and _clean(tmp_path)


def test_two_real_builds_of_one_output_at_once(src, tmp_path):
    """Two `repack build` processes, same OUT, no --force: whatever the timing, one writes it and the other
    exits 2 with one line; no temporary folder is left."""
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, "-m", "repack", "build", str(src), str(out), *FULL], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], errs
    loser = errs[[p.returncode for p in procs].index(2)]
    line = one_line_error(loser, str(out))
    assert "already exists" in line or "another build wrote it" in line
    assert _kind(out) == "new" and _clean(tmp_path)


def test_rename_race_enotempty(src, tmp_path, capsys, monkeypatch):
    """The rename itself finds OUT taken (the kernel's ENOTEMPTY/EEXIST), even without renameat2."""
    out = tmp_path / "out"
    real = os.rename

    fired = []

    def racing(a, b):
        if Path(b).name == "out" and not fired:
            fired.append(b)
            build_checkpoint(src, out, BuildOptions(quantize_linears=False))
        return real(a, b)

    def no_renameat2(a, b, flags):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(renames, "renameat2", no_renameat2)
    monkeypatch.setattr(atomic.os, "rename", racing)
    rc, err = repack_cli(capsys, "build", src, out)
    assert rc == 2
    one_line_error(err, "another build wrote it")
    assert _kind(out) == "old" and _clean(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_output_folders_get_the_umask_mode(src, tmp_path, umask):
    old = os.umask(umask)
    try:
        build_checkpoint(src, tmp_path / "new-parent" / "out", BuildOptions())
    finally:
        os.umask(old)
    for d in (tmp_path / "new-parent", tmp_path / "new-parent" / "out"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~umask, d


def test_failed_build_removes_the_parent_folders_it_created(tmp_path, capsys):
    bad = write_small_checkpoint(tmp_path / "bad", off_grid=("model.language_model.layers.0.mlp.up_proj.weight", 1, 0))
    (tmp_path / "a").mkdir()
    rc, err = repack_cli(capsys, "build", bad, tmp_path / "a" / "b" / "c" / "out")
    assert rc == 2
    one_line_error(err, "off the 4-bit grid")
    assert list((tmp_path / "a").iterdir()) == []  # a existed before: kept; b and c removed


def test_sigterm_exits_143_and_sighup_129(src, tmp_path):
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129)):
        out = tmp_path / f"out{code}"
        p = _start_slow_build(src, out)
        with reaped(p):
            _wait_for_partial(tmp_path, p)
            p.send_signal(sig)
            _, err = p.communicate(timeout=120)
        assert p.returncode == code, err
        one_line_error(err, signal.Signals(sig).name, "was not written")
        assert not out.exists() and _clean(tmp_path)


def test_symlink_loop_is_reported_as_such(tmp_path, capsys, src):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    rc, err = repack_cli(capsys, "build", loop, tmp_path / "out")
    assert rc == 2
    one_line_error(err, "symlink loop")
    rc, err = repack_cli(capsys, "build", src, loop / "out")
    assert rc == 2
    one_line_error(err, "symlink loop")
    rc, err = repack_cli(capsys, "probe", loop)
    assert rc == 2
    one_line_error(err, "symlink loop")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "1e-12", "big", "1e300", "1e30"])
def test_bad_max_shard_size_is_a_usage_error(src, tmp_path, capsys, value):
    try:  # argparse refuses what is not a number; the parameter model what is not a positive size it can hold
        rc = cli.main(["build", str(src), str(tmp_path / "out"), f"--max-shard-size={value}"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert "--max-shard-size" in err and "error:" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


# -- the tiny model's --force: only a folder it wrote (its marker), never any folder with a config.json -------------

@pytest.mark.parametrize("kind", ["repack-build", "fetched-source", "file"])
def test_tiny_model_force_replaces_only_a_folder_it_wrote(tmp_path, capsys, monkeypatch, kind):
    from repack import tiny_model as tiny_cli
    from repack.stand_ins import tiny_model

    made = []
    monkeypatch.setattr(tiny_model, "cached_tiny_qat_checkpoint",
                        lambda out, **kw: made.append(out) or tiny_model.TinyModelInfo(Path(out), 1.0, [], 0))
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("notes")
    else:
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / ("repack-report.json" if kind == "repack-build" else "fetch-manifest.json")).write_text("{}")
    before = _tree(out) if out.is_dir() else out.read_bytes()
    for flags in ([], ["--force"]):
        assert tiny_cli.main([str(out), *flags]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and str(out) in err
        assert ("this tool did not write it" in err or "not a folder" in err) if flags else "--force" in err, err
    assert (_tree(out) if out.is_dir() else out.read_bytes()) == before and not made


def test_tiny_model_force_replaces_its_own_folder_and_an_empty_one(tmp_path, capsys, monkeypatch):
    from repack import tiny_model as tiny_cli
    from repack.stand_ins import tiny_model

    made = []
    monkeypatch.setattr(tiny_model, "cached_tiny_qat_checkpoint",
                        lambda out, **kw: made.append(out) or tiny_model.TinyModelInfo(Path(out), 1.0, [], 0))
    (tmp_path / "empty").mkdir()
    assert tiny_cli.main([str(tmp_path / "empty")]) == 0
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text("{}")
    tiny_model.mark(own, "source")
    assert tiny_cli.main([str(own)]) == 2  # without --force: refused even so
    assert tiny_cli.main([str(own), "--force"]) == 0
    assert made == [str(tmp_path / "empty"), str(own)]
