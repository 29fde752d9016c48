"""The Turing clamp patcher, on copies of the installed vLLM's file and on variants of it (never the installed file
itself): today's file, a decision returning 64 at head 512 (vLLM PR #43257), one already fixed upstream (PR
#39018's shape), a reworded caller, and files it cannot understand. The patched code itself is run on a stand-in
Turing device to show the tiles it launches with fit."""

from __future__ import annotations

import ast
import errno
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools.core.errors import BadInput, ToolFailure
from tools.serving.turing import patch as turing_patch
from tools.serving.turing.decision import ClampRefused, TuringPlatform, find_decision

from tests.helpers.mounts import MOUNT

ROOT = Path(__file__).resolve().parents[3]
DOCSTRING = '    """Select tile size with Gemma3-specific optimization."""\n'
TILES = ("TILE_SIZE_PREFILL", "TILE_SIZE_DECODE")


def _installed() -> str:
    return turing_patch.installed_target().read_text()


def _with_decision_rule(rule: str) -> str:
    """Today's file with `rule` first in the tile-size decision (how upstream changes it)."""
    text = _installed()
    assert text.count(DOCSTRING) == 1
    return text.replace(DOCSTRING, DOCSTRING + rule)


TILE64 = "    if head_size >= 512 and is_prefill:\n        return 64\n"  # PR #43257's rule
FIXED_BY_SHARED = ("    if head_size >= 512 and torch.cuda.get_device_properties(0).shared_memory_per_block_optin "
                   "< 98304:\n        return 16\n")  # PR #39018's shape
FIXED_BY_CAPABILITY = ("    if head_size >= 512 and current_platform.get_device_capability().major < 8:\n"
                       "        return 16\n")


@pytest.fixture()
def target(tmp_path) -> Path:
    copy = tmp_path / "triton_unified_attention.py"
    shutil.copy2(turing_patch.installed_target(), copy)
    return copy


def _functions_reached(tree: ast.Module, name: str) -> list[ast.FunctionDef]:
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    out, todo = [], [name]
    while todo:
        fn = funcs.get(todo.pop())
        if fn is not None and fn not in out:
            out.append(fn)
            todo += [c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    return out


def _launch_tiles(text: str, major: int, head_size: int, element_size: int = 2) -> dict:
    """Runs the file's own code from the tile-size decision to the last statement that sets the tiles
    (the clamp, when patched), on a stand-in device of capability `major`.5."""
    tree = ast.parse(text)
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "unified_attention")

    def touches(s, ctx):
        return any(isinstance(n, ast.Name) and n.id in TILES and isinstance(n.ctx, ctx) for n in ast.walk(s))
    first = next(i for i, s in enumerate(func.body) if touches(s, ast.Store))
    end = 1 + max(i for i, s in enumerate(func.body) if touches(s, ast.Store))  # the clamp sets them too
    helpers = [ast.FunctionDef(**{**vars(f), "decorator_list": []}) for f in _functions_reached(tree, "_get_tile_size")]
    scope = dict(current_platform=TuringPlatform(major, 5), q=SimpleNamespace(element_size=lambda: element_size),
                 head_size=head_size, sliding_window_val=0, block_size=16, use_td=False, tuned_large_head=False,
                 BLOCK_M=16, launch_num_stages=None, torch=None)
    module = ast.fix_missing_locations(ast.Module(body=helpers + func.body[first:end], type_ignores=[]))
    exec(compile(module, "unified_attention", "exec"), scope)
    return {k: scope[k] for k in (*TILES, "launch_num_stages")}


def _fits(tile: int, head: int, element: int = 2) -> bool:
    return turing_patch.shared_bytes(tile, head, element) <= turing_patch.SHARED_BYTES


def test_apply_check_revert_roundtrip(target):
    original = target.read_bytes()
    assert not turing_patch.check(target).applied and turing_patch.check(target).needed

    status = turing_patch.apply(target)
    assert status.applied and turing_patch.check(target).applied
    patched = target.read_text()
    assert patched.count(turing_patch.BEGIN_MARK) == 1 and turing_patch.END_MARK in patched
    ast.parse(patched)  # still a valid module
    backup = Path(status.backup)
    assert backup.read_bytes() == original
    assert (target.stat().st_mode & 0o777) == (backup.stat().st_mode & 0o777)

    turing_patch.apply(target)  # idempotent: a second apply changes nothing
    assert target.read_text() == patched

    assert not turing_patch.revert(target).applied
    assert target.read_bytes() == original and not backup.exists()
    assert not turing_patch.revert(target).applied  # reverting an unpatched file is a no-op
    assert target.read_bytes() == original


def test_revert_without_backup_removes_the_block(target):
    original = target.read_text()
    Path(turing_patch.apply(target).backup).unlink()
    turing_patch.revert(target)
    assert target.read_text() == original


def test_todays_file_launches_tiles_that_fit_turing(target):
    before = _launch_tiles(target.read_text(), 7, 512)
    assert not _fits(before["TILE_SIZE_PREFILL"], 512)  # what fails on a T4 without the clamp
    turing_patch.apply(target)
    patched = target.read_text()
    s = _launch_tiles(patched, 7, 512)
    assert (s["TILE_SIZE_PREFILL"], s["TILE_SIZE_DECODE"], s["launch_num_stages"]) == (16, 16, 1)
    # Head 256 fits at 32: (16 + 64) * 256 * 2 = 40960.
    assert _launch_tiles(patched, 7, 256)["TILE_SIZE_PREFILL"] == 32
    assert _launch_tiles(patched, 7, 4096)["TILE_SIZE_PREFILL"] == 16  # never below 16, even when 16 does not fit
    # Ampere and later run the original decision.
    assert _launch_tiles(patched, 8, 512) == {**before, "launch_num_stages": None}


def test_a_decision_of_64_at_head_512_is_reduced_until_it_fits(target):
    target.write_text(_with_decision_rule(TILE64))
    assert _launch_tiles(target.read_text(), 7, 512)["TILE_SIZE_PREFILL"] == 64
    assert turing_patch.apply(target).applied
    patched = target.read_text()
    s = _launch_tiles(patched, 7, 512)
    assert s["TILE_SIZE_PREFILL"] == 16 and _fits(16, 512) and not _fits(32, 512)
    # fp8 (1 byte): 64 does not fit, 32 does, and the clamp stops there rather than at 16.
    assert _launch_tiles(patched, 7, 512, element_size=1)["TILE_SIZE_PREFILL"] == 32
    assert _launch_tiles(patched, 8, 512)["TILE_SIZE_PREFILL"] == 64


def test_a_reworded_caller_is_still_found(target):
    """The next vLLM drops the block today's anchor was (use_td) and renames the stages variable."""
    text = re.sub(r"    if use_td:\n        TILE_SIZE_PREFILL = min\(.*\n        TILE_SIZE_DECODE = min\(.*\n", "",
                  _installed())
    text = text.replace("launch_num_stages", "stages_2d")
    assert "if use_td:\n        TILE_SIZE_PREFILL" not in text
    target.write_text(text)
    assert turing_patch.apply(target).applied
    patched = target.read_text()
    assert "        stages_2d = 1\n" in patched
    assert find_decision(text, target).stages == "stages_2d"


@pytest.mark.parametrize("rule", [FIXED_BY_SHARED, FIXED_BY_CAPABILITY], ids=["shared-memory", "capability"])
def test_an_upstream_fixed_decision_needs_no_clamp(target, rule):
    target.write_text(_with_decision_rule(rule))
    before = target.read_bytes()
    status = turing_patch.apply(target)
    assert not status.applied and not status.needed and "not needed" in status.message
    assert target.read_bytes() == before and not Path(str(target) + turing_patch.BACKUP_SUFFIX).exists()
    assert not turing_patch.check(target).needed


@pytest.mark.parametrize("edit", [
    lambda t: re.sub(r"_get_tile_size\(\n\s+head_size, sliding_window_val, q.element_size\(\), is_prefill=\w+\n\s+\)",
                     "32", t),  # the decision inlined: nothing to find
    lambda t: t.replace('launch_kwargs["num_stages"] = launch_num_stages', "pass"),  # no stages to set
    lambda t: "x = 1\n",
    lambda t: t + "\ndef broken(:\n",
], ids=["no-decision", "no-stages", "other-module", "not-python"])
def test_refuses_a_file_it_cannot_understand(target, edit):
    target.write_text(edit(_installed()))
    before = target.read_bytes()
    with pytest.raises(ClampRefused) as exc:
        turing_patch.apply(target)
    assert isinstance(exc.value, BadInput) and str(target) in str(exc.value)
    assert "\n" not in str(exc.value) and "tile-size decision" in str(exc.value)
    assert target.read_bytes() == before  # nothing written
    assert not Path(str(target) + turing_patch.BACKUP_SUFFIX).exists()
    with pytest.raises(ClampRefused):
        turing_patch.check(target)


def test_a_hand_edited_clamp_is_not_reported_as_applied(target):
    turing_patch.apply(target)
    target.write_text(target.read_text().replace("> 60000", "> 90000"))
    status = turing_patch.check(target)
    assert not status.applied and "modified or partial" in status.message
    with pytest.raises(ToolFailure, match="--revert"):
        turing_patch.apply(target)
    turing_patch.revert(target)  # the backup brings the original back
    assert turing_patch.apply(target).applied


def test_command_line(target):
    script = [sys.executable, str(ROOT / "patch_triton_turing.py")]
    check = subprocess.run(script + ["--check", "--target", str(target)], capture_output=True, text=True)
    assert check.returncode == 1 and "not applied" in check.stdout
    assert subprocess.run(script + ["--target", str(target)], capture_output=True).returncode == 0
    assert subprocess.run(script + ["--check", "--target", str(target)], capture_output=True).returncode == 0
    assert subprocess.run(script + ["--revert", "--target", str(target)], capture_output=True).returncode == 0
    target.write_text(_with_decision_rule(FIXED_BY_CAPABILITY))
    fixed = subprocess.run(script + ["--check", "--target", str(target)], capture_output=True, text=True)
    assert fixed.returncode == 0 and "not needed" in fixed.stdout
    target.write_text("x = 1\n")
    bad = subprocess.run(script + ["--target", str(target)], capture_output=True, text=True)
    assert bad.returncode == 2 and target.read_text() == "x = 1\n"
    assert len(bad.stderr.strip().splitlines()) == 1 and "another vLLM version" in bad.stderr
    assert str(target) in bad.stderr and "TILE_SIZE" in bad.stderr


@pytest.mark.parametrize("op", [turing_patch.apply, turing_patch.check, turing_patch.revert])
def test_a_file_that_is_not_utf8_is_refused_untouched(tmp_path, op):
    f = tmp_path / "triton_unified_attention.py"
    data = b"x = 1\n# \xff\xfe latin-1 bytes\n"
    f.write_bytes(data)
    with pytest.raises(BadInput, match="not UTF-8") as exc:
        op(f)
    assert str(f) in str(exc.value) and len(str(exc.value).splitlines()) == 1
    assert f.read_bytes() == data and [p.name for p in tmp_path.iterdir()] == [f.name]  # no backup either


def test_the_command_refuses_a_non_utf8_file_in_one_line(tmp_path):
    f = tmp_path / "triton_unified_attention.py"
    f.write_bytes(b"\xff\n")
    for flags in ([], ["--check"], ["--revert"]):
        res = subprocess.run([sys.executable, str(ROOT / "patch_triton_turing.py"), *flags, "--target", str(f)],
                             capture_output=True, text=True)
        assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert str(f) in res.stderr and "not UTF-8" in res.stderr and "Traceback" not in res.stderr
    assert f.read_bytes() == b"\xff\n"


def _odd_target(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / kind
    if kind == "directory":
        p.mkdir()
    elif kind == "fifo":
        os.mkfifo(p)
    else:  # a symlink loop
        (tmp_path / "other").symlink_to(p)
        p.symlink_to(tmp_path / "other")
    return p


@pytest.mark.parametrize("kind, said", [("directory", "is a directory"), ("fifo", "is a named pipe (fifo)"),
                                        ("loop", "is a symbolic link loop")])
@pytest.mark.parametrize("op", [turing_patch.apply, turing_patch.check, turing_patch.revert])
def test_a_target_that_is_not_a_file_says_what_it_is(tmp_path, kind, said, op):
    p = _odd_target(tmp_path, kind)
    with pytest.raises(BadInput, match=re.escape(said)) as exc:
        op(p)
    assert str(p) in str(exc.value) and "does not exist" not in str(exc.value)
    with pytest.raises(ToolFailure, match="does not exist"):
        op(tmp_path / "absent.py")


@pytest.mark.parametrize("op", [turing_patch.apply, turing_patch.check, turing_patch.revert])
def test_the_patchs_own_backup_and_record_are_refused_as_targets(target, op):
    """`--target FILE.gemma4-t4.orig` patched the backup itself (and left a backup of the backup): refused, naming
    the file to pass; the backup is left as it was."""
    turing_patch.apply(target)
    backup = target.with_name(target.name + turing_patch.BACKUP_SUFFIX)
    record = target.with_name(target.name + turing_patch.RECORD_SUFFIX)
    kept = backup.read_bytes()
    for own in (backup, record):
        with pytest.raises(BadInput) as exc:
            op(own)
        msg = str(exc.value)
        assert f"is the patch's {'backup' if own == backup else 'record'} of {target}, not a file to patch" in msg
        assert exc.value.field == "target" and f'pass target="{target}"' in msg and "\n" not in msg, msg
    assert backup.read_bytes() == kept
    assert not list(target.parent.glob(f"*{turing_patch.BACKUP_SUFFIX}{turing_patch.BACKUP_SUFFIX}*"))


# -- what the patch wrote earlier is checked before it is trusted ----------------------------------------------

UPGRADED = "\n# a newer vLLM's code\n"


def test_revert_after_an_upgrade_keeps_the_new_vllms_code(target):
    """Apply, the target upgraded over it (its backup left behind), apply again, revert: the new code stays."""
    old_backup = Path(turing_patch.apply(target).backup).read_bytes()
    newer = _installed() + UPGRADED
    target.write_text(newer)  # what pip does: a new file, the old backup still beside it
    status = turing_patch.apply(target)
    assert status.applied and Path(status.backup).read_text() == newer != old_backup.decode()
    assert "restored" in turing_patch.revert(target).message
    assert target.read_text() == newer


@pytest.mark.parametrize("backup_bytes", [b"", b"x = 1\n", None], ids=["empty", "foreign", "older-vllm"])
def test_a_backup_that_is_not_this_files_is_not_restored(target, backup_bytes):
    original = target.read_text()
    backup = Path(turing_patch.apply(target).backup)
    backup.write_bytes(_installed().encode() + b"# older\n" if backup_bytes is None else backup_bytes)
    status = turing_patch.revert(target)
    assert target.read_text() == original  # from the markers, not the backup
    assert "not used" in status.message and str(backup) in status.message and "\n" not in status.message
    assert not backup.exists()


def test_a_backup_for_another_patched_file_is_not_restored(target):
    """The backup is the original, but the patched file was changed since (a hand edit outside the block)."""
    turing_patch.apply(target)
    edited = target.read_text() + "# kept edit\n"
    target.write_text(edited)
    turing_patch.revert(target)
    assert target.read_text() == _installed() + "# kept edit\n"


def test_a_backup_without_its_record_is_not_restored(target):
    """A backup from before records were kept (or with its record lost) is not trusted."""
    original = target.read_text()
    status = turing_patch.apply(target)
    Path(status.backup).write_text("x = 1\n")
    Path(str(target) + turing_patch.RECORD_SUFFIX).unlink()
    assert "record" in turing_patch.revert(target).message
    assert target.read_text() == original


def test_damaged_markers_and_an_untrusted_backup_are_refused_untouched(target):
    turing_patch.apply(target)
    damaged = target.read_text().replace(turing_patch.END_MARK, "# gone")
    target.write_text(damaged)
    Path(str(target) + turing_patch.BACKUP_SUFFIX).write_bytes(b"")
    with pytest.raises(BadInput, match="markers are damaged") as exc:
        turing_patch.revert(target)
    assert "\n" not in str(exc.value) and "hash" in str(exc.value)
    assert target.read_text() == damaged


# -- the decision is the file's code: it runs bounded, in a child process ------------------------------------

def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "patch_triton_turing.py"), *args], capture_output=True,
                          text=True)


@pytest.mark.parametrize("rule, said", [
    ("    raise KeyboardInterrupt\n", "raised KeyboardInterrupt"),
    ("    raise SystemExit(0)\n", "called exit(0)"),
    ("    __import__('os')._exit(0)\n", "without an answer"),
    ("    print('TILE 16')\n    raise ValueError('bad\\nhead')\n", "raised ValueError: bad head"),
], ids=["keyboard-interrupt", "system-exit-0", "os-exit", "value-error"])
def test_a_decision_that_raises_or_exits_is_one_line(target, rule, said):
    target.write_text(_with_decision_rule(rule))
    check = _script("--check", "--target", str(target))
    assert check.returncode == 1 and "Traceback" not in check.stderr + check.stdout, check
    assert check.stdout.count("\n") == 1 and "not applied" in check.stdout and said in check.stdout, check.stdout
    applied = _script("--target", str(target))  # cannot tell: the clamp goes in (it acts only when over)
    assert applied.returncode == 0 and said in applied.stdout and "Traceback" not in applied.stderr
    assert turing_patch.check(target).applied


def test_a_decision_that_never_returns_is_ended(target, monkeypatch):
    from tools.serving.turing import decision as turing_decision

    monkeypatch.setattr(turing_decision, "DECISION_TIMEOUT_S", 2.0)
    target.write_text(_with_decision_rule("    while True:\n        pass\n"))
    status = turing_patch.check(target)
    assert not status.applied and "did not return within 2 s" in status.message
    assert turing_patch.apply(target).applied


# -- exit statuses: bad input 2, a failure of the machine 1 ---------------------------------------------------

def test_a_full_disk_exits_1_and_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    import importlib

    from tests.helpers.mounts import MOUNT, fill, inject_write_error

    place = tmp_path / "full"
    mounted = False
    if MOUNT:
        place.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", str(place)], check=True)
        mounted = True
    else:
        place.mkdir()
        inject_write_error(monkeypatch, errno.ENOSPC)
    try:
        f = place / "triton_unified_attention.py"
        f.write_text(_installed())
        before = f.read_bytes()
        if mounted:
            fill(place)
        script = importlib.import_module("patch_triton_turing")
        rc = script.main(["--target", str(f)])
        assert rc == 1
        assert f.read_bytes() == before
        assert sorted(p.name for p in place.iterdir()) == sorted([f.name] + (["filler"] if mounted else []))
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(place)], check=False)


def test_a_missing_target_given_is_bad_input(tmp_path):
    res = _script("--check", "--target", str(tmp_path / "absent.py"))
    assert res.returncode == 2 and "does not exist" in res.stderr and len(res.stderr.splitlines()) == 1


# -- the executables at the top run on the project's virtualenv --------------------------------------------------

EXECUTABLES = sorted(p.name for p in ROOT.iterdir() if p.is_file() and os.access(p, os.X_OK) and p.name != "setup.sh")


def _bare_python(tmp_path: Path) -> dict:
    """An environment whose `python3` is this interpreter without any site-packages (no psutil, no vLLM)."""
    bin_dir = tmp_path / "bare-bin"
    bin_dir.mkdir()
    py = bin_dir / "python3"
    py.write_text(f"#!/bin/sh\nexec {os.path.realpath(sys.executable)} -S \"$@\"\n")
    py.chmod(0o755)
    probe = subprocess.run([str(py), "-c", "import psutil"], capture_output=True)
    assert probe.returncode != 0  # the stand-in system Python really lacks the project's packages
    return {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
            "PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin"}


def _checkout(tmp_path: Path, name: str, *, venv: bool) -> Path:
    """A checkout whose .venv is the virtualenv running the tests (or none): the executable copied, the packages
    linked."""
    root = tmp_path / "checkout"
    root.mkdir()
    shutil.copy2(ROOT / name, root / name)
    for pkg in ("tools", "repack", "gemma4_t4_vllm"):
        (root / pkg).symlink_to(ROOT / pkg)
    shutil.copy2(ROOT / "tpu.env", root / "tpu.env")
    if venv:
        assert sys.prefix != sys.base_prefix, "the suite runs on the project's virtualenv"
        (root / ".venv").symlink_to(sys.prefix)
    return root


def test_the_executables_at_the_top_are_the_known_ones():
    assert {"patch_triton_turing.py", "vllm-t4"} <= set(EXECUTABLES)  # what the next test runs, at least


@pytest.mark.parametrize("name", EXECUTABLES)
def test_an_executable_runs_the_projects_virtualenv_not_the_system_python(tmp_path, name):
    env = _bare_python(tmp_path)
    root = _checkout(tmp_path, name, venv=True)
    res = subprocess.run([str(root / name), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr and "usage" in res.stdout.lower(), res


def test_the_patch_finds_the_virtualenvs_vllm_from_a_bare_system_python(tmp_path):
    env = _bare_python(tmp_path)
    root = _checkout(tmp_path, "patch_triton_turing.py", venv=True)
    res = subprocess.run([str(root / "patch_triton_turing.py"), "--check"], capture_output=True, text=True,
                         env=env, cwd=tmp_path)
    assert res.returncode in (0, 1) and "Traceback" not in res.stderr, res
    assert f"{root / '.venv'}/lib/" in res.stdout and str(turing_patch.RELATIVE_PATH) in res.stdout, res.stdout


@pytest.mark.parametrize("name", ["server.py", "patch_triton_turing.py"])
def test_a_script_started_by_a_bare_python3_runs_on_the_projects_virtualenv(tmp_path, name):
    """`python3 server.py` (its docstring's command) with a python3 lacking the project's packages ended in a
    traceback: it runs on the .venv beside it, as the executables do, and without one says so in one line."""
    env = _bare_python(tmp_path)
    python3 = str(tmp_path / "bare-bin" / "python3")
    root = _checkout(tmp_path, name, venv=True)
    res = subprocess.run([python3, str(root / name), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 0 and "usage" in res.stdout.lower() and "Traceback" not in res.stderr, res
    (root / ".venv").unlink()
    res = subprocess.run([python3, str(root / name), "--help"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1 and "./setup.sh" in res.stderr, res
    assert res.stderr.startswith(f"{name}: ") and "Traceback" not in res.stderr


def test_without_a_virtualenv_the_patch_says_to_set_up_in_one_line(tmp_path):
    env = _bare_python(tmp_path)
    root = _checkout(tmp_path, "patch_triton_turing.py", venv=False)
    res = subprocess.run([str(root / "patch_triton_turing.py"), "--check", "--target", str(root / "x.py")],
                         capture_output=True, text=True, env=env, cwd=tmp_path)
    assert res.returncode == 1 and len(res.stderr.splitlines()) == 1 and "./setup.sh" in res.stderr, res


# -- three at once: the lock, and a backup that is the bytes the patch was made from -----------------------------

def _op_in_child(name: str, target: str, barrier) -> None:
    barrier.wait()  # the three start together, as `for i in 1 2 3; do ./patch_triton_turing.py & done` does
    try:
        getattr(turing_patch, name)(target)
    except ToolFailure:  # e.g. apply reads a half-reverted file; what is asserted is the state left behind
        pass


def _state_keeps_the_original(target: Path, original: bytes, patched: bytes) -> None:
    backup = Path(str(target) + turing_patch.BACKUP_SUFFIX)
    record = Path(str(target) + turing_patch.RECORD_SUFFIX)
    assert target.read_bytes() in (original, patched)
    if target.read_bytes() == patched:
        assert backup.read_bytes() == original
        assert json.loads(record.read_text())["backup_sha256"] == hashlib.sha256(original).hexdigest()


def test_three_at_once_never_lose_the_original(target):
    """apply, check and revert, three processes at once, 20 rounds (the first three applies to an unpatched file,
    the case that lost the backup): after each round the file is the original or its patched form, a patched file's
    backup is the original, and a last revert gives back the original bytes."""
    import multiprocessing

    original = target.read_bytes()
    patched = turing_patch.patched_text(original.decode(), find_decision(original.decode(), target)).encode()
    # forkserver: each child forked from a small process of its own, not from this worker (which may hold torch's
    # threads: a fork of a threaded process can stall on a lock another thread held)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    rounds = [("apply",) * 3] + [tuple(random.Random(r).choice(("apply", "check", "revert")) for _ in range(3))
                                 for r in range(19)]
    for ops in rounds:
        barrier = ctx.Barrier(3)
        procs = [ctx.Process(target=_op_in_child, args=(name, str(target), barrier)) for name in ops]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert [p.exitcode for p in procs] == [0, 0, 0], ops
        _state_keeps_the_original(target, original, patched)
    status = turing_patch.revert(target)
    assert target.read_bytes() == original, status.message
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no backup, record or lock left


def test_a_backup_holding_the_clamp_is_not_restored(target):
    """What three applies at once left before the lock: a backup (and its record) of the patched file itself.
    revert does not say "restored" with the file still patched; it removes the block."""
    original = target.read_bytes()
    turing_patch.apply(target)
    patched = target.read_bytes()
    Path(str(target) + turing_patch.BACKUP_SUFFIX).write_bytes(patched)
    digest = hashlib.sha256(patched).hexdigest()
    Path(str(target) + turing_patch.RECORD_SUFFIX).write_text(json.dumps(
        {"target": target.name, "backup_sha256": digest, "patched_sha256": digest}))
    status = turing_patch.revert(target)
    assert target.read_bytes() == original
    assert "restored" not in status.message and "holds the clamp itself" in status.message


@pytest.mark.skipif(not MOUNT, reason="needs root to mount a read-only tmpfs")
def test_a_read_only_install_still_answers_what_needs_no_write(tmp_path, mounts):
    """The lock lives beside the file: where no lock can be made (a read-only vLLM), apply of a file that needs no
    clamp and revert of an unpatched one answer as before, writing nothing."""
    place = mounts(tmp_path / "ro")
    f = place / "triton_unified_attention.py"
    f.write_text(_with_decision_rule(FIXED_BY_CAPABILITY))
    subprocess.run(["mount", "-o", "remount,ro", str(place)], check=True)
    assert not turing_patch.apply(f).needed
    assert "nothing to revert" in turing_patch.revert(f).message
    assert sorted(p.name for p in place.iterdir()) == [f.name]


# -- bad input named in one line, exit 2, nothing written ----------------------------------------------------------

def _one_line_naming(res: subprocess.CompletedProcess, rc: int, *named: str) -> None:
    assert res.returncode == rc and res.stderr.startswith("patch_triton_turing.py: "), res
    assert len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    assert all(n in res.stderr for n in named), res.stderr


def test_a_target_nothing_can_be_written_beside_is_named_not_its_lock():
    """/proc/self/status is a regular file, but its folder takes no new file (ENOENT): the line names the target."""
    res = _script("--target", "/proc/self/status")
    _one_line_naming(res, 2, "/proc/self/status")
    assert res.stderr.startswith("patch_triton_turing.py: /proc/self/status: "), res.stderr


def test_a_lock_whose_name_is_too_long_is_refused_untouched(tmp_path):
    f = tmp_path / ("t" * 250 + ".py")  # a name the folder takes, but not with LOCK_SUFFIX after it
    f.write_text(_installed())
    before = f.read_bytes()
    for flags in ([], ["--revert"]):
        res = _script(*flags, "--target", str(f))
        _one_line_naming(res, 2, str(f), "File name too long")
    assert f.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [f.name]


@pytest.mark.parametrize("code, kind", [(errno.ENOENT, BadInput), (errno.ENOTDIR, BadInput), (errno.EINVAL, BadInput),
                                        (errno.ENOSPC, ToolFailure), (errno.EIO, ToolFailure)],
                         ids=["enoent", "enotdir", "einval", "enospc", "eio"])
@pytest.mark.parametrize("op", [turing_patch.apply, turing_patch.revert])
def test_any_error_making_the_lock_names_the_target(target, monkeypatch, code, kind, op):
    """The folder's (ENOSPC, EIO) is a failure of the machine, exit 1; anything else is the target's, exit 2;
    either way one line naming the target and nothing written."""
    def failing(path):
        raise OSError(code, os.strerror(code), str(path))
    monkeypatch.setattr(turing_patch, "flocked", failing)
    before = target.read_bytes()
    with pytest.raises(kind) as exc:
        op(target)
    assert isinstance(exc.value, BadInput) == (kind is BadInput)
    assert str(exc.value).startswith(f"{target}: ") and os.strerror(code) in str(exc.value)
    assert "\n" not in str(exc.value)
    assert target.read_bytes() == before and [p.name for p in target.parent.iterdir()] == [target.name]


def test_check_and_revert_refuse_a_file_they_cannot_understand_as_apply_does(target):
    """Refused (exit 2, one line on stderr) is not "not applied" (exit 1, on stdout), nor "nothing to revert"
    (exit 0: --revert of a file that is no vLLM attention module said so, and removed files beside it)."""
    target.write_text("x = 1\n")
    for flags in (["--check"], [], ["--revert"]):
        res = _script(*flags, "--target", str(target))
        _one_line_naming(res, 2, str(target), "tile-size decision")
        assert res.stdout == ""
    assert target.read_text() == "x = 1\n" and [p.name for p in target.parent.iterdir()] == [target.name]


@pytest.mark.parametrize("flags", [[], ["--check"], ["--revert"]])
def test_an_empty_target_is_bad_input_naming_the_option(flags):
    res = _script(*flags, "--target", "")
    _one_line_naming(res, 2, "--target")
    assert "directory" not in res.stderr


@pytest.mark.parametrize("op", [turing_patch.apply, turing_patch.check, turing_patch.revert])
def test_an_empty_target_is_refused_by_the_library_too(op):
    with pytest.raises(BadInput, match="empty") as exc:
        op("")
    assert exc.value.field == "target"


@pytest.mark.parametrize("op", [turing_patch.apply, turing_patch.check, turing_patch.revert])
def test_a_symlinked_target_is_refused_naming_the_file_it_points_to(target, op):
    """Patching through a link would replace the link with a patched copy and leave vLLM's file unpatched: the
    line names the file to pass instead, and nothing is written beside either."""
    link = target.parent / "link" / "triton_unified_attention.py"
    link.parent.mkdir()
    link.symlink_to(target)
    before = target.read_bytes()
    with pytest.raises(BadInput, match="symbolic link") as exc:
        op(link)
    assert str(link) in str(exc.value) and str(target) in str(exc.value) and "\n" not in str(exc.value)
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_bytes() == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["link", target.name]
    assert [p.name for p in link.parent.iterdir()] == [link.name]


def test_the_command_refuses_a_symlinked_target_in_one_line(target):
    link = target.with_name("link.py")
    link.symlink_to(target)
    res = _script("--target", str(link))
    _one_line_naming(res, 2, str(link), f"--target {target}")
    assert link.is_symlink() and not turing_patch.check(target).applied


def test_a_symlinked_installed_file_is_a_failure_naming_the_file_to_patch(target, monkeypatch):
    """Not the caller's input (no --target): exit 1, the remedy naming the file the link points to."""
    link = target.with_name("link.py")
    link.symlink_to(target)
    monkeypatch.setattr(turing_patch, "installed_target", lambda: link)
    with pytest.raises(ToolFailure) as exc:
        turing_patch.apply()
    assert not isinstance(exc.value, BadInput) and str(target) in str(exc.value)
    assert link.is_symlink() and not turing_patch.check(target).applied


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_backup_record_that_is_no_file_is_damaged_never_read(target, kind):
    """The backup's record as a FIFO hung --revert for good; as a link to /dev/zero it was read until memory ran
    out (MemoryError). Either is a record that is missing or damaged: the clamp's block is taken out, the backup
    not trusted."""
    import os
    import time

    original = target.read_text()
    turing_patch.apply(target)
    record = Path(str(target) + turing_patch.RECORD_SUFFIX)
    record.unlink()
    os.mkfifo(record) if kind == "fifo" else record.symlink_to("/dev/zero")
    t0 = time.monotonic()
    assert "record" in turing_patch.revert(target).message
    assert time.monotonic() - t0 < 30 and target.read_text() == original
