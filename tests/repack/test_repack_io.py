"""Input and output edge cases of the build's file handling: special files in the source, how the output path
is resolved and named, the free-space check, and which temporary folders a build may sweep."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from repack import cli
from repack.synthetic import write_small_checkpoint

from fixtures import one_line_error, repack_cli

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
