"""The Turing clamp patcher, on copies of the real file of the installed vLLM (never the installed file itself)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools.serving import turing_patch
from tools.core.errors import ToolFailure

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def target(tmp_path) -> Path:
    real = turing_patch.installed_target()
    copy = tmp_path / "triton_unified_attention.py"
    shutil.copy2(real, copy)
    return copy


def test_apply_check_revert_roundtrip(target):
    original = target.read_bytes()
    assert not turing_patch.check(target).applied

    status = turing_patch.apply(target)
    assert status.applied and turing_patch.check(target).applied
    patched = target.read_text()
    assert patched.count(turing_patch.BEGIN) == 1 and turing_patch.END in patched
    ast.parse(patched)  # still a valid module
    backup = Path(status.backup)
    assert backup.read_bytes() == original

    # Idempotent: a second apply changes nothing.
    turing_patch.apply(target)
    assert target.read_text() == patched

    reverted = turing_patch.revert(target)
    assert not reverted.applied
    assert target.read_bytes() == original
    assert not backup.exists()
    # Reverting an unpatched file is a no-op.
    assert not turing_patch.revert(target).applied
    assert target.read_bytes() == original


def test_revert_without_backup_removes_the_block(target):
    original = target.read_text()
    status = turing_patch.apply(target)
    Path(status.backup).unlink()
    turing_patch.revert(target)
    assert target.read_text() == original


def test_refuses_a_file_without_the_expected_code(target):
    text = target.read_text()
    target.write_text(text.replace("TILE_SIZE_DECODE = min(TILE_SIZE_DECODE, block_size)", "pass"))
    before = target.read_bytes()
    with pytest.raises(ToolFailure, match="does not contain the code the Turing clamp expects"):
        turing_patch.apply(target)
    assert target.read_bytes() == before  # nothing written
    assert not Path(str(target) + turing_patch.BACKUP_SUFFIX).exists()


def test_a_hand_edited_clamp_is_not_reported_as_applied(target):
    turing_patch.apply(target)
    target.write_text(target.read_text().replace("> 60000", "> 90000"))
    status = turing_patch.check(target)
    assert not status.applied and "modified or partial" in status.message
    with pytest.raises(ToolFailure, match="--revert"):
        turing_patch.apply(target)
    turing_patch.revert(target)  # the backup brings the original back
    assert turing_patch.apply(target).applied


def _run_clamp(major: int, head_size: int, element_size: int = 2) -> dict:
    """Executes the inserted block with a stand-in platform of the given compute capability."""
    cap = SimpleNamespace(major=major, minor=5)
    scope = dict(current_platform=SimpleNamespace(get_device_capability=lambda: cap),
                 q=SimpleNamespace(element_size=lambda: element_size), head_size=head_size, BLOCK_M=16,
                 TILE_SIZE_PREFILL=32, TILE_SIZE_DECODE=32, launch_num_stages=None)
    body = "\n".join(line[4:] for line in turing_patch.CLAMP.splitlines())
    exec(compile(body, "clamp", "exec"), scope)
    return scope


def test_clamp_arithmetic():
    # Turing, head 512, fp16: (16 + 2*32) * 512 * 2 = 81920 > 60000 -> 16; (16 + 32) * 1024 = 49152 fits.
    s = _run_clamp(7, 512)
    assert (s["TILE_SIZE_PREFILL"], s["TILE_SIZE_DECODE"], s["launch_num_stages"]) == (16, 16, 1)
    # Head 256 fits at 32 tiles: (16 + 64) * 512 = 40960.
    s = _run_clamp(7, 256)
    assert (s["TILE_SIZE_PREFILL"], s["launch_num_stages"]) == (32, 1)
    # Never below 16, even when 16 does not fit.
    assert _run_clamp(7, 4096)["TILE_SIZE_PREFILL"] == 16
    # Ampere and later: untouched.
    s = _run_clamp(8, 512)
    assert (s["TILE_SIZE_PREFILL"], s["TILE_SIZE_DECODE"], s["launch_num_stages"]) == (32, 32, None)


def test_command_line(target):
    script = [sys.executable, str(ROOT / "patch_triton_turing.py")]
    check = subprocess.run(script + ["--check", "--target", str(target)], capture_output=True, text=True)
    assert check.returncode == 1 and "not applied" in check.stdout
    assert subprocess.run(script + ["--target", str(target)], capture_output=True).returncode == 0
    assert subprocess.run(script + ["--check", "--target", str(target)], capture_output=True).returncode == 0
    assert subprocess.run(script + ["--revert", "--target", str(target)], capture_output=True).returncode == 0
    target.write_text("x = 1\n")
    bad = subprocess.run(script + ["--target", str(target)], capture_output=True, text=True)
    assert bad.returncode == 2
    assert len(bad.stderr.strip().splitlines()) == 1 and "another vLLM version" in bad.stderr
