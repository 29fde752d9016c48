"""Output paths a careless or hostile user gives: a folder where a file is wanted, a file where a folder is, a
parent that is a file, a read-only place, a full disk, a mount point. Every writer of an evidence folder answers
each with one line naming the path (OutputRefused or ToolFailure), never a traceback, and leaves nothing of its
own behind. Read-only and full places are real tmpfs mounts where this sandbox may mount (it runs as root, so
chmod would not stop a write); elsewhere the file system's errno is injected."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.fixtures import ROOT
from tests.helpers.mounts import MOUNT, fill, inject_write_error, listing
from tools.core import atomic_files
from tools.core.errors import ToolFailure
from tools.measure import evidence


def _read_only(tmp_path: Path, mounts, monkeypatch) -> Path:
    place = tmp_path / "ro"
    if MOUNT:
        mounts(place, "ro")
    else:
        place.mkdir()
        inject_write_error(monkeypatch, errno.EROFS)
    return place


def _full(tmp_path: Path, mounts, monkeypatch) -> Path:
    place = tmp_path / "full"
    if MOUNT:
        mounts(place)
        fill(place)
    else:
        place.mkdir()
        inject_write_error(monkeypatch, errno.ENOSPC)
    return place


BIG = {"record": "x" * 200_000}  # more than the full place can ever take


def _case(kind: str, tmp_path: Path, mounts, monkeypatch) -> tuple[Path, Path]:
    """(the target a file writer gets, the folder whose contents must be as before)."""
    if kind == "folder-exists":
        (tmp_path / "target.json").mkdir()
        return tmp_path / "target.json", tmp_path
    if kind == "parent-is-file":
        (tmp_path / "plain").write_text("a file\n")
        return tmp_path / "plain" / "target.json", tmp_path
    if kind == "read-only":
        place = _read_only(tmp_path, mounts, monkeypatch)
        return place / "target.json", place
    if kind == "full":
        place = _full(tmp_path, mounts, monkeypatch)
        return place / "target.json", place
    if kind == "mount-point":
        if not MOUNT:
            pytest.skip("this sandbox cannot mount")
        return mounts(tmp_path / "target.json"), tmp_path
    raise AssertionError(kind)


def _one_line(exc: BaseException, path: Path) -> None:
    msg = str(exc)
    assert isinstance(exc, ToolFailure), repr(exc)
    assert "\n" not in msg and str(path) in msg and "Traceback" not in msg, msg


KINDS = ["folder-exists", "parent-is-file", "read-only", "full", "mount-point"]
WRITERS = {
    "write_json": lambda p: evidence.write_json(p, BIG),
    "write_text": lambda p: evidence.write_text(p, BIG["record"]),
    "write_texts": lambda p: evidence.write_texts((p, BIG["record"]), (p.with_name("second.md"), "x")),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("writer", list(WRITERS))
def test_file_writers_refuse_in_one_line_and_leave_nothing(writer, kind, tmp_path, mounts, monkeypatch):
    target, place = _case(kind, tmp_path, mounts, monkeypatch)
    before = listing(place)
    with pytest.raises(ToolFailure) as e:
        WRITERS[writer](target)
    _one_line(e.value, target if kind != "parent-is-file" else target)
    assert listing(place) == before


RUN_KINDS = ["out-is-file", "parent-is-file", "read-only", "full"]


@pytest.mark.parametrize("kind", RUN_KINDS)
def test_evidence_run_refuses_in_one_line_and_leaves_nothing(kind, tmp_path, mounts, monkeypatch):
    """EvidenceRun as decode and decode-sweep use it: create, records, finish; abandon on a failure."""
    place = tmp_path
    if kind == "out-is-file":
        out = tmp_path / "out"
        out.write_text("a file\n")
    elif kind == "parent-is-file":
        (tmp_path / "plain").write_text("a file\n")
        out = tmp_path / "plain" / "out"
    elif kind == "read-only":
        out = place = _read_only(tmp_path, mounts, monkeypatch)
    else:
        out = place = _full(tmp_path, mounts, monkeypatch)
    before = listing(place)
    with pytest.raises(ToolFailure) as e:
        run = evidence.EvidenceRun.create(out, "decode-x")
        try:
            run.write_raw("00-a", BIG)
            run.write_summary({"ok": True}, "# t\n")
            run.finish()
        except BaseException:
            run.abandon()
            raise
    _one_line(e.value, out)
    assert listing(place) == before


def test_an_evidence_run_whose_name_is_a_mount_point_gets_a_name_of_its_own(tmp_path, mounts):
    """A taken name (here a mount point) is never written into: the run is published as NAME-2 beside it."""
    if not MOUNT:
        pytest.skip("this sandbox cannot mount")
    mounts(tmp_path / "decode-x")
    run = evidence.EvidenceRun.create(tmp_path, "decode-x")
    run.write_raw("00-a", {"v": 1})
    assert run.finish() == tmp_path / "decode-x-2"
    assert os.listdir(tmp_path / "decode-x") == [] and sorted(os.listdir(tmp_path)) == ["decode-x", "decode-x-2"]


def test_a_dead_writers_temporary_file_is_swept_by_the_next_write(tmp_path):
    """A writer killed with SIGKILL mid-write leaves its temporary and lock; the next write there removes them."""
    code = ("import os, sys; from tools.core import atomic_files as a; "
            "real = os.replace; os.replace = lambda *x: os._exit(9); a.write_file(sys.argv[1], 'half')")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t.json")], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 9 and any(".partial-" in n for n in os.listdir(tmp_path))
    evidence.write_json(tmp_path / "other.json", {"v": 1})
    assert sorted(os.listdir(tmp_path)) == ["other.json"]


def test_decode_sweep_out_under_a_file_is_one_line_from_the_command_line(tmp_path):
    (tmp_path / "plain").write_text("a file\n")
    r = subprocess.run([sys.executable, "-m", "tools.cli", "decode-sweep", "--draft-tokens", "0",
                        "--out", str(tmp_path / "plain" / "ev")], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), STATE_DIR=str(tmp_path / "run")), timeout=120)
    assert r.returncode in (1, 2), r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert str(tmp_path / "plain") in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["plain"]


def _streamed(p: Path) -> None:
    """TempFile as fidelity's reference writer would stream a record: pieces, then publish."""
    f = atomic_files.TempFile.open(p)
    for _ in range(4):
        f.write(BIG["record"])
    f.publish()


@pytest.mark.parametrize("kind", KINDS)
def test_a_streamed_file_refuses_in_one_line_and_leaves_nothing(kind, tmp_path, mounts, monkeypatch):
    target, place = _case(kind, tmp_path, mounts, monkeypatch)
    before = listing(place)
    with pytest.raises(ToolFailure) as e:
        _streamed(target)
    _one_line(e.value, target)
    assert listing(place) == before


def test_a_streamed_file_is_published_whole_and_never_over_one_that_appeared(tmp_path):
    f = atomic_files.TempFile.open(tmp_path / "ref.json")
    f.write("{}")
    (tmp_path / "ref.json").write_text("theirs")
    with pytest.raises(FileExistsError):
        f.publish(replace=False)
    assert sorted(os.listdir(tmp_path)) == ["ref.json"] and (tmp_path / "ref.json").read_text() == "theirs"
    _streamed(tmp_path / "ref.json")
    assert sorted(os.listdir(tmp_path)) == ["ref.json"] and len((tmp_path / "ref.json").read_text()) == 800_000
