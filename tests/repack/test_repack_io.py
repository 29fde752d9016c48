"""Input and output edge cases of the build's file handling: special files in the source, how the output path
is resolved and named, the free-space check, and which temporary folders a build may sweep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.cli import repack_cli as cli
from repack.stand_ins.synthetic import write_small_checkpoint

from tests.helpers.fixtures import one_line_error, repack_cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def src(tmp_path) -> Path:
    return write_small_checkpoint(tmp_path / "qat")


def _cli_with_timeout(*args: object) -> subprocess.CompletedProcess:
    """`python -m repack ARGS` as a process of its own, so a hang fails the test instead of blocking it."""
    env = {**os.environ, "REPACK_NO_NUMBA": "1"}
    return subprocess.run([sys.executable, "-m", "repack", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=30, env=env)


# -- special files in the source ---------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["build", "probe"])
def test_a_fifo_shard_is_refused_not_waited_on(src, tmp_path, cmd):
    shard = src / "model.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    r = _cli_with_timeout(cmd, src, *([tmp_path / "out"] if cmd == "build" else []))
    assert r.returncode == 2, r.stderr
    one_line_error(r.stderr, str(shard), "not a regular file")
    assert not (tmp_path / "out").exists()


def test_a_side_file_linking_to_a_fifo_is_refused(src, tmp_path):
    os.mkfifo(src / "pipe")
    (src / "tokenizer_config.json").symlink_to("pipe")
    r = _cli_with_timeout("build", src, tmp_path / "out")
    assert r.returncode == 2, r.stderr
    one_line_error(r.stderr, "tokenizer_config.json", "not a regular file")


# -- what the sweep of dead builds' leftovers may touch ----------------------------------------------------------

TOKEN = "999999-1-0123abcd"


def _tree(p: Path) -> dict[str, bytes]:
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


@pytest.mark.parametrize("where", [f".qat.partial-{TOKEN}", f".x.old-{TOKEN}", f".y.partial-{TOKEN}/qat"])
@pytest.mark.parametrize("lock", [False, True])
def test_the_sweep_never_touches_the_source(tmp_path, capsys, where, lock):
    """A source named like a dead build's leftover (even with an unlocked lock file beside it), or inside one, is
    neither removed nor renamed; the build reads it and succeeds."""
    src = write_small_checkpoint(tmp_path / where)
    before = _tree(src)
    top = tmp_path / where.split("/")[0]
    if lock:
        (tmp_path / top.name.replace(".partial-", ".lock-").replace(".old-", ".lock-")).touch()
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out")
    assert rc == 0, err
    assert _tree(src) == before and not (tmp_path / "x").exists()
    assert "removed" not in err and "restored" not in err


def test_probe_does_not_report_its_own_source_as_a_leftover(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / f".qat.partial-{TOKEN}")
    (tmp_path / f".qat.lock-{TOKEN}").touch()
    assert cli.main(["probe", str(src), "--json"]) == 0
    import json
    assert json.loads(capsys.readouterr().out)["stale_partials"] == []


def test_the_sweep_skips_links_and_folders_that_are_not_a_builds(src, tmp_path, capsys):
    """A link named like a leftover (even to a folder of data) is not a build's temporary folder: kept, with the
    lock file that names it. A leftover-named file beside its lock, the lock free, is a dead writer's temporary
    file (every command's output is written so): swept with its lock."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "keep").write_text("x")
    (tmp_path / f".d.old-{TOKEN}").symlink_to(data)
    (tmp_path / f".d.lock-{TOKEN}").touch()
    (tmp_path / f".e.partial-{TOKEN}").write_text("not a folder")
    (tmp_path / f".e.lock-{TOKEN}").touch()
    rc, err = repack_cli(capsys, "build", src, tmp_path / "out")
    assert rc == 0, err
    assert (tmp_path / f".d.old-{TOKEN}").is_symlink() and not (tmp_path / "d").exists()
    assert (data / "keep").read_text() == "x" and (tmp_path / f".d.lock-{TOKEN}").exists()
    assert not (tmp_path / f".e.partial-{TOKEN}").exists() and not (tmp_path / f".e.lock-{TOKEN}").exists()


# -- the output path -----------------------------------------------------------------------------------------------

def test_dotdot_after_a_symlink_is_resolved_as_the_kernel_does(src, tmp_path, capsys):
    """X/lnk/../out, lnk pointing into the source, is the source's subfolder to the kernel, not X/out: refused."""
    (src / "deeper").mkdir()
    (tmp_path / "X").mkdir()
    (tmp_path / "X" / "lnk").symlink_to(src / "deeper")
    rc, err = repack_cli(capsys, "build", src, f"{tmp_path}/X/lnk/../out")
    assert rc == 2
    one_line_error(err, "inside the source folder")
    assert not (src / "out").exists() and not (tmp_path / "X" / "out").exists()


def test_the_path_written_is_the_one_reported(src, tmp_path, capsys):
    (tmp_path / "elsewhere" / "deeper").mkdir(parents=True)
    (tmp_path / "X").mkdir()
    (tmp_path / "X" / "lnk").symlink_to(tmp_path / "elsewhere" / "deeper")
    rc, err = repack_cli(capsys, "build", src, f"{tmp_path}/X/lnk/../out")
    assert rc == 0, err
    real = tmp_path / "elsewhere" / "out"
    assert (real / "repack-report.json").is_file() and not (tmp_path / "X" / "out").exists()
    assert f"wrote {real} " in err
    import json
    assert json.loads((real / "repack-report.json").read_text())["output"] == str(real)


def test_an_output_name_too_long_for_its_temporary_name_is_refused_up_front(src, tmp_path, capsys):
    out = tmp_path / ("b" * 230)
    out.mkdir()  # a legal name here...
    out.rmdir()
    rc, err = repack_cli(capsys, "build", src, out)  # ...but not with the temporary name's 40 more bytes
    assert rc == 2
    one_line_error(err, "230 bytes", "at most 215 bytes")
    assert list(tmp_path.iterdir()) == [src]
    rc, err = repack_cli(capsys, "build", src, tmp_path / ("b" * 215))
    assert rc == 0, err


# -- free space --------------------------------------------------------------------------------------------------

def _with_tower_shard(src: Path) -> Path:
    """src with a second shard holding only a tower tensor: unchanged by a build that keeps the towers, so it is
    reused by a hard link where the output's file system allows one."""
    import json
    import struct

    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    name, rows, cols = "model.vision_tower.encoder.layers.1.mlp.up_proj.linear.weight", 1024, 1024
    raw = json.dumps({name: {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, rows * cols * 2]}}).encode()
    raw += b" " * (-len(raw) % 8)
    with open(src / "model-00002-of-00002.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + bytes(rows * cols * 2))
    b = (src / "model-00001-of-00002.safetensors").read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    wm = {k: "model-00001-of-00002.safetensors" for k in json.loads(b[8:8 + n]) if k != "__metadata__"}
    wm[name] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return src


@pytest.fixture
def other_fs(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_the_space_check_counts_a_link_that_becomes_a_copy(src, tmp_path, other_fs, monkeypatch):
    import shutil
    from collections import namedtuple

    from repack.build.build import BuildOptions, build_checkpoint
    from repack.errors import RepackError

    _with_tower_shard(src)
    opt = BuildOptions(text_only=False)
    rep = build_checkpoint(src, tmp_path / "same_fs", opt)
    assert rep.hardlinked_shards == 1
    # room for what a build writes when the link works, not for the 2 MiB copy it makes across file systems
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, rep.bytes_written + (1 << 20)))
    with pytest.raises(RepackError, match="the build needs .* GB and only"):
        build_checkpoint(src, other_fs / "out", opt)
    assert list(other_fs.iterdir()) == []
    build_checkpoint(src, tmp_path / "again", opt)  # on the source's file system the same room is enough
