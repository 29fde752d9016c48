"""Bad input: a one-line error, exit status 2, and nothing written. Atomicity under failures and signals."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from repack.build import build as build_mod
from repack.grid import grid
from repack.source import safetensors_io
from tools.cli import repack_cli as cli
from repack.build.build import BuildOptions, build_checkpoint
from repack.stand_ins.synthetic import grid_words, write_small_checkpoint

from tests.helpers.fixtures import default_signals, one_line_error, reaped, repack_cli

ROOT = Path(__file__).resolve().parents[2]
FULL = ["--text-only", "--embed-int4", "--embed-tokens"]
UP0 = "model.language_model.layers.0.mlp.up_proj.weight"


def _build_cli(src: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    rc = cli.main(["build", str(src), str(out), *extra])
    err = capsys.readouterr().err
    return rc, err


def _assert_nothing_written(out: Path) -> None:
    assert not out.exists()
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == []



@pytest.fixture
def good(tmp_path) -> Path:
    return write_small_checkpoint(tmp_path / "src")


def test_small_checkpoint_builds(good, tmp_path, capsys):
    rc, err = _build_cli(good, tmp_path / "out", capsys, *FULL)
    assert rc == 0, err
    t = build_mod.open_checkpoint(tmp_path / "out").tensors
    assert "lm_head.weight_packed" in t and "model.layers.1.mlp.down_proj.weight_packed" in t


def test_not_a_folder(tmp_path, capsys):
    f = tmp_path / "file.txt"
    f.write_text("x")
    rc, err = _build_cli(f, tmp_path / "out", capsys, *FULL)
    assert rc == 2
    one_line_error(err, str(f), "not a folder")
    rc, err = _build_cli(tmp_path / "missing", tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, "no such folder")
    _assert_nothing_written(tmp_path / "out")


def test_no_config(good, tmp_path, capsys):
    (good / "config.json").unlink()
    rc, err = _build_cli(good, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, "no config.json")
    _assert_nothing_written(tmp_path / "out")


def test_truncated_header(good, tmp_path, capsys):
    st = good / "model.safetensors"
    st.write_bytes(st.read_bytes()[:100])  # the length prefix promises more header than is left
    rc, err = _build_cli(good, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, "model.safetensors", "truncated")
    st.write_bytes(b"\x01\x02")
    rc, err = _build_cli(good, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, "model.safetensors", "truncated")
    _assert_nothing_written(tmp_path / "out")


def test_corrupt_header(good, tmp_path, capsys):
    st = good / "model.safetensors"
    raw = bytearray(st.read_bytes())
    raw[8:20] = b"#not json!#{"
    st.write_bytes(bytes(raw))
    rc, err = _build_cli(good, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, "model.safetensors", "corrupt safetensors header")
    _assert_nothing_written(tmp_path / "out")


def test_tensor_bytes_past_end_of_file(good, tmp_path, capsys):
    st = good / "model.safetensors"
    data = st.read_bytes()
    st.write_bytes(data[:-1000])
    rc, err = _build_cli(good, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, "model.safetensors", "past the end of the file")
    _assert_nothing_written(tmp_path / "out")


def test_unsupported_dtype_in_header(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src", extra={"model.language_model.odd": ("Q4_0", (4,), b"\0" * 4)})
    rc, err = _build_cli(src, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, "model.language_model.odd", "unsupported dtype 'Q4_0'")
    _assert_nothing_written(tmp_path / "out")


def test_non_bf16_target(tmp_path, capsys):
    f32 = np.zeros((128, 64), dtype="<f4").tobytes()
    src = write_small_checkpoint(tmp_path / "src", extra={UP0: ("F32", (128, 64), f32)})
    rc, err = _build_cli(src, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, UP0, "is F32", "BF16")
    _assert_nothing_written(tmp_path / "out")


def test_last_dimension_not_divisible_by_32(tmp_path, capsys):
    w = grid_words(128, 64, np.random.default_rng(0))[:, :48].copy()
    src = write_small_checkpoint(tmp_path / "src", extra={UP0: ("BF16", (128, 48), w.tobytes())})
    rc, err = _build_cli(src, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, UP0, "[128, 48]", "multiple of 32")
    _assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("tensor,row,group", [(UP0, 77, 1), ("model.language_model.embed_tokens_per_layer.weight", 5, 0)])
def test_off_grid_group_aborts_naming_tensor_row_group(tmp_path, capsys, tensor, row, group):
    src = write_small_checkpoint(tmp_path / "src", off_grid=(tensor, row, group))
    rc, err = _build_cli(src, tmp_path / "out", capsys, *FULL)
    assert rc == 2
    one_line_error(err, tensor, f"row {row}", f"group {group}", "bf16 ulps off")
    _assert_nothing_written(tmp_path / "out")


def test_base_model_is_refused(tiny_base, tmp_path, capsys):
    rc, err = _build_cli(tiny_base, tmp_path / "out", capsys, *FULL)
    assert rc == 2
    one_line_error(err, "off the 4-bit grid", "row", "group")
    _assert_nothing_written(tmp_path / "out")
    rc = cli.main(["probe", str(tiny_base)])
    assert rc == 0 and "verdict: base" in capsys.readouterr().out


def test_probe_tells_qat_from_base(tiny_qat, tmp_path):
    from repack.build.probe import probe_checkpoint

    qat = probe_checkpoint(tiny_qat)
    assert qat.verdict == "qat" and qat.text_off_grid == 0 and qat.text_on_grid == 53
    mixed = probe_checkpoint(write_small_checkpoint(tmp_path / "m", off_grid=(UP0, 3, 0)), rows_per_tensor=200)
    assert mixed.verdict == "mixed"
    assert [t.name for t in mixed.tensors if t.on_grid is False and not t.tower] == [UP0]


def test_probe_says_a_build_is_already_packed_not_ready_to_repack(bf16_text_build, emb4_build, capsys):
    """A linears-only build keeps its bf16 embeddings, which sit on the grid: it once read "qat, ready to repack"."""
    from repack.build.probe import probe_checkpoint

    for build in (bf16_text_build, emb4_build):
        report = probe_checkpoint(build)
        assert report.verdict == "packed" and report.packed_tensors > 0, build
        assert cli.main(["probe", str(build)]) == 0
        out = capsys.readouterr().out
        assert "verdict: packed - already packed" in out and "ready to repack" not in out


def test_full_disk_found_before_writing(good, tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    rc, err = _build_cli(good, tmp_path / "out", capsys, *FULL)
    assert rc == 2
    one_line_error(err, " KiB free", "headroom")  # the command's preflight, before the build opens OUT
    _assert_nothing_written(tmp_path / "out")
    from repack.errors import RepackError

    with pytest.raises(RepackError, match="only 0.00 GB is free"):  # the library's own check, from exact sizes
        build_checkpoint(good, tmp_path / "out", BuildOptions(text_only=True, embed_int4=True, embed_tokens=True))
    _assert_nothing_written(tmp_path / "out")


def test_full_disk_while_writing(good, tmp_path, capsys, monkeypatch):
    """ENOSPC in the middle of the data: injected into the positional writer after a few blocks."""
    calls = {"n": 0}
    real = os.pwrite

    def pwrite(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 4:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(safetensors_io.os, "pwrite", pwrite)
    rc, err = _build_cli(good, tmp_path / "out", capsys, *FULL)
    assert rc == 2 and calls["n"] > 4
    # the output is named, not its temporary folder, with the room the build needs
    line = one_line_error(err, f"{tmp_path / 'out'}: no space left", "the build needs", "GB")
    assert ".partial-" not in line
    _assert_nothing_written(tmp_path / "out")


def test_full_disk_on_a_real_small_file_system(tmp_path, capsys, monkeypatch):
    """A 256 KiB tmpfs where mounting is allowed (root); elsewhere the allocation fails with ENOSPC by injection."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                             capture_output=True).returncode == 0
    if not mounted:
        def no_space(fd, off, size):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(safetensors_io.os, "posix_fallocate", no_space)
    monkeypatch.setattr(build_mod, "_free_bytes", lambda out: None)  # reach the writer, not the pre-check
    from repack.source import checks

    monkeypatch.setattr(checks, "free_bytes", lambda p: (p, 1 << 40))  # nor the command's preflight
    big = write_small_checkpoint(tmp_path / "big", extra={
        "model.language_model.embed_tokens_per_layer.weight":
            ("BF16", (4096, 128), grid_words(4096, 128, np.random.default_rng(1)).tobytes())})
    try:
        rc, err = _build_cli(big, mnt / "out", capsys, "--keep-linears")
        assert rc == 2
        one_line_error(err, "no space left on the device")
        _assert_nothing_written(mnt / "out")
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)


def test_existing_output_refused_without_force(good, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = _build_cli(good, out, capsys)
    assert rc == 2
    one_line_error(err, "already exists", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    rc, err = _build_cli(good, out, capsys, "--force")  # --force replaces only an empty folder or a build
    assert rc == 2
    one_line_error(err, "keep.txt", "--force replaces only")
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    rc, _ = _build_cli(good, out, capsys, "--force")
    assert rc == 0 and (out / "config.json").exists()
    rc, _ = _build_cli(good, out, capsys, "--force")
    assert rc == 0 and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []


@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()])
def test_failure_mid_build_leaves_nothing(good, tmp_path, monkeypatch, exc):
    calls = {"n": 0}
    real = grid.quantize

    def failing(words, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise exc
        return real(words, *args)

    monkeypatch.setattr(grid, "quantize", failing)
    with pytest.raises(type(exc)):
        build_checkpoint(good, tmp_path / "out", BuildOptions())
    _assert_nothing_written(tmp_path / "out")


def test_sigterm_leaves_nothing(good, tmp_path):
    out = tmp_path / "out"
    script = (
        "import sys, time; sys.path.insert(0, %r)\n"
        "from repack.grid import grid\nfrom tools.cli import repack_cli as cli\n"
        "real = grid.quantize\n"
        "def slow(w, *args):\n"
        "    time.sleep(0.5); return real(w, *args)\n"
        "grid.quantize = slow\n"
        "sys.exit(cli.main(['build', %r, %r, '--text-only', '--embed-int4', '--embed-tokens']))\n"
    ) % (str(ROOT), str(good), str(out))
    p = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    with reaped(p):
        deadline = time.time() + 120
        while time.time() < deadline and not any(x.name.startswith(".out.partial-") for x in tmp_path.iterdir()):
            time.sleep(0.05)
        assert any(x.name.startswith(".out.partial-") for x in tmp_path.iterdir())
        time.sleep(0.3)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert "stopped by SIGTERM" in err and "was not written" in err
    _assert_nothing_written(out)


def test_commands_exit_2_as_scripts(tmp_path):
    """The article's scripts run from the project root and report bad input with status 2."""
    for args in (["repack/repack_q4_0.py", "repack", str(tmp_path / "nope"), str(tmp_path / "o")],
                 ["repack/text_only.py", str(tmp_path / "nope"), str(tmp_path / "o")],
                 ["repack/embed_int4.py", str(tmp_path / "nope"), str(tmp_path / "o"), "--embed-tokens"],
                 ["-m", "repack", "probe", str(tmp_path / "nope")]):
        r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        one_line_error(r.stderr, "no such folder")


# ---------------------------------------------------------------------------------------------- unusable paths


def test_over_long_name_in_the_source_or_the_output(good, tmp_path, capsys):
    """A path component longer than the file system allows is named as such, not a traceback."""
    long = "a" * 300
    rc, err = _build_cli(tmp_path / long, tmp_path / "out", capsys)
    assert rc == 2
    one_line_error(err, "File name too long")
    _assert_nothing_written(tmp_path / "out")
    rc, err = repack_cli(capsys, "probe", tmp_path / long)
    assert rc == 2
    one_line_error(err, "File name too long")
    rc, err = _build_cli(good, tmp_path / long / "out", capsys)
    assert rc == 2
    one_line_error(err, "File name too long")
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize("kind", ["loop", "broken", "folder"])
def test_a_config_json_that_is_there_but_unusable_is_named(good, tmp_path, capsys, kind):
    """The command's preflight says "no config.json" only when there is none: a loop, a broken link or a
    folder in its place is named as the probe names it."""
    cfg = good / "config.json"
    cfg.unlink()
    if kind == "loop":
        os.symlink("config.json", cfg)
    elif kind == "broken":
        os.symlink("nowhere.json", cfg)
    else:
        cfg.mkdir()
    needle = {"loop": "symlink loop", "broken": "broken symlink", "folder": "not a regular file"}[kind]
    rc, err = _build_cli(good, tmp_path / "out", capsys)
    assert rc == 2
    line = one_line_error(err, "config.json", needle)
    assert "no config.json" not in line
    _assert_nothing_written(tmp_path / "out")


def _unprivileged() -> list[str]:
    """A command prefix under which file permissions apply (root drops its override capabilities)."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: permissions cannot be tested")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps]


@pytest.mark.parametrize("mode", [0o311, 0o000])
def test_a_source_folder_that_cannot_be_listed_or_read(good, tmp_path, mode):
    out = tmp_path / "out"
    good.chmod(mode)
    try:
        r = subprocess.run([*_unprivileged(), sys.executable, "-m", "repack", "build", str(good), str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "REPACK_NO_NUMBA": "1"})
    finally:
        good.chmod(0o755)
    assert r.returncode == 2, r.stderr
    line = one_line_error(r.stderr, str(good), "Permission denied")
    assert "no config.json" not in line
    _assert_nothing_written(out)


@pytest.mark.parametrize("sig, rc, how", [(signal.SIGINT, 130, "interrupted"),
                                          (signal.SIGTERM, 143, "stopped by SIGTERM")])
def test_a_signal_stops_the_probe_with_one_line(good, sig, rc, how):
    """The probe exits as the build does on a signal: one line and 128 + the signal, no traceback."""
    script = (
        "import sys, time; sys.path.insert(0, %r)\n"
        "from repack.grid import grid\nfrom tools.cli import repack_cli as cli\n"
        "real = grid.quantize\n"
        "def slow(w, *args):\n"
        "    print('sampling', file=sys.stderr, flush=True); time.sleep(60); return real(w, *args)\n"
        "grid.quantize = slow\n"
        "sys.exit(cli.main(['probe', %r]))\n"
    ) % (str(ROOT), str(good))
    p = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env={**os.environ, "REPACK_NO_NUMBA": "1"}, preexec_fn=default_signals)
    with reaped(p):
        assert p.stderr.readline().strip() == "sampling"
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    assert p.returncode == rc, err
    one_line_error(err, how)
