"""`fetch` against hostile outputs: the models root itself, a file, a folder under a file, a read-only mount, a
full disk, a mount point, a bad HF_ENDPOINT. Each is one line naming the output (or the variable), before the hub
is asked where the output alone decides it, and nothing is left behind: no `.NAME.partial-*` or `.NAME.old-*`.
Read-only, full and mount-point cases are real tmpfs mounts where the sandbox may mount, else skipped (a fault
injected into os.link / copy stands in for the full disk)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.helpers.mounts import MOUNT, listing
from tools.core.errors import BadInput, ToolFailure
from tools.serving.hub import fetch
from tools.serving.hub.fetch import FetchParams, fetch_checkpoint

REPO = "acme/tiny"
NOWHERE = "http://127.0.0.1:9"  # nothing listens: a check that asked the hub would fail as "no network"


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", NOWHERE)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)


def _refused_before_the_hub(params: FetchParams, *needles: str) -> str:
    with pytest.raises(BadInput) as e:
        fetch_checkpoint(params)
    msg = str(e.value)
    assert "\n" not in msg and "network" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_the_models_root_itself_is_never_the_output(offline_hub, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    for out in (".", str(models), str(tmp_path)):
        _refused_before_the_hub(FetchParams(repo_id=REPO, out=out, roots=[str(models)]), "models root")
    assert models.is_dir() and list(models.iterdir()) == []


@pytest.mark.parametrize("kind", ["a-file", "parent-a-file", "holds-something-else", "read-only", "mount-point"])
def test_an_output_no_fetch_could_publish_is_refused_before_the_hub(kind, offline_hub, tmp_path, mounts):
    if kind in ("read-only", "mount-point") and not MOUNT:
        pytest.skip("this sandbox cannot mount")
    models = tmp_path / "models"
    models.mkdir()
    out = models / "tiny"
    if kind == "a-file":
        out.write_text("x")
    elif kind == "parent-a-file":
        (models / "plain").write_text("x")
        out = models / "plain" / "tiny"
    elif kind == "holds-something-else":
        out.mkdir()
        (out / "mine.txt").write_text("x")
    elif kind == "read-only":
        mounts(models / "ro", "ro")
        out = models / "ro" / "tiny"
    else:
        mounts(out)
    before = listing(models)
    _refused_before_the_hub(FetchParams(repo_id=REPO, out=str(out), roots=[str(models)]), str(out))
    assert listing(models) == before


def test_an_endpoint_that_is_not_a_url_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "notaurl")
    _refused_before_the_hub(FetchParams(repo_id=REPO, out=str(tmp_path / "m" / "x")), "HF_ENDPOINT")
    assert not (tmp_path / "m").exists()


def _snapshot(tmp_path: Path, size: int = 200_000) -> tuple[Path, list[str]]:
    snap = tmp_path / "snapshot"
    snap.mkdir()
    (snap / "config.json").write_text("{}")
    (snap / "model.safetensors").write_bytes(b"\0" * size)
    return snap, ["config.json", "model.safetensors"]


def _manifest() -> dict:
    return {"repo_id": REPO, "revision": "main", "commit": "0" * 40}


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, mounts, monkeypatch):
    snap, names = _snapshot(tmp_path)
    if MOUNT:  # another file system than the snapshot's: the files are copied, and the copy runs out of room
        place = mounts(tmp_path / "full")
    else:
        place = tmp_path / "full"
        place.mkdir()

        def no_room(*a, **kw):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(fetch.os, "link", no_room)
        monkeypatch.setattr(fetch.shutil, "copy2", no_room)
    with pytest.raises(ToolFailure) as e:
        fetch._publish(snap, names, place / "tiny", _manifest(), {}, None)
    msg = str(e.value)
    assert "\n" not in msg and str(place / "tiny") in msg and "no space" in msg, msg
    assert listing(place) == []


def test_an_empty_mount_point_as_output_leaves_no_old_folder(tmp_path, mounts):
    """Published onto a mount point (the exchange fails with EBUSY): one line, and no `.tiny.old-*` beside it."""
    if not MOUNT:
        pytest.skip("this sandbox cannot mount")
    snap, names = _snapshot(tmp_path, size=10)
    models = tmp_path / "models"
    out = mounts(models / "tiny")
    with pytest.raises(ToolFailure) as e:
        fetch._publish(snap, names, out, _manifest(), {}, None)
    assert "\n" not in str(e.value) and str(out) in str(e.value)
    assert sorted(os.listdir(models)) == ["tiny"] and os.listdir(out) == []


def test_a_published_fetch_takes_the_umasks_mode(tmp_path):
    snap, names = _snapshot(tmp_path, size=10)
    old = os.umask(0o022)
    try:
        fetch._publish(snap, names, tmp_path / "models" / "tiny", _manifest(), {}, None)
    finally:
        os.umask(old)
    assert (tmp_path / "models" / "tiny").stat().st_mode & 0o777 == 0o755
    assert sorted(os.listdir(tmp_path / "models")) == ["tiny"]


def test_a_build_that_appears_at_the_output_during_a_fetch_is_kept(tmp_path):
    """The fetch replaces only an empty folder: a repack build (its report listing every file) written at the
    output after the fetch checked it is no fetch's to replace."""
    snap, names = _snapshot(tmp_path)
    out = tmp_path / "models" / "tiny"
    out.mkdir(parents=True)
    (out / "config.json").write_text('{"a build": 1}')
    (out / "repack-report.json").write_text('{"files": ["config.json", "repack-report.json"]}')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(BadInput) as e:
        fetch._publish(snap, names, out, _manifest(), {}, None)
    assert "\n" not in str(e.value) and str(out) in str(e.value) and "empty folder" in str(e.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]  # no partial folder left
    (out / "config.json").unlink()
    (out / "repack-report.json").unlink()
    fetch._publish(snap, names, out, _manifest(), {}, None)  # an empty folder: replaced
    assert sorted(p.name for p in out.iterdir()) == sorted([*names, fetch.MANIFEST])
