"""The kill matrix for a command that writes evidence: `./vllm-t4 decode` against a stand-in server (lists a
model, serves /metrics, streams a short answer slowly) gets SIGINT, SIGTERM or SIGKILL while its run folder is
being filled: before its first record (the untimed first request) and between records. SIGINT and SIGTERM end it
with 130 / 143, one line after its progress lines, no traceback and nothing left in --out; SIGKILL leaves its `.partial` folder, which the
next run there sweeps. The stand-in stands for vLLM: the lifecycle under test (the run folder, the signals) is the
command's own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.fixtures import ROOT, default_signals
from tests.helpers.kill_matrix import SIGNALS, assert_ended, assert_swept_by_the_next_write, cli, signal_when
from tests.helpers.stand_ins.measure import DecodeStandIn, serve_in_thread


@pytest.fixture(scope="module")
def server():
    with serve_in_thread(DecodeStandIn) as url:
        yield url


def _partial(out: Path) -> Path | None:
    found = [p for p in out.iterdir() if ".partial-" in p.name and p.is_dir()] if out.is_dir() else []
    return found[0] if found else None


def _reached(out: Path, phase: str) -> bool:
    part = _partial(out)
    if part is None or not (part / "provenance.json").exists():
        return False
    records = list((part / "raw").glob("*.json")) if (part / "raw").is_dir() else []
    return not records if phase == "before-first-record" else len(records) >= 1


PHASES = ["before-first-record", "between-records"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", list(SIGNALS))
def test_decode_killed_at_each_phase_leaves_nothing_the_next_write_keeps(sig, phase, server, tmp_path):
    out = tmp_path / "ev"
    out.mkdir()
    proc = cli(["decode", "--base-url", server, "--out", str(out), "--prompts", "4", "--max-tokens", "3"])
    err = signal_when(proc, lambda: _reached(out, phase), sig, phase, timeout_s=60)
    assert_ended(sig, proc.returncode, err)
    if sig != "SIGKILL":
        assert os.listdir(out) == []
    else:
        assert_swept_by_the_next_write(out)


def test_a_kill_case_passes_under_a_runner_that_ignores_sigint(server, tmp_path):
    """The suite started as `pytest &` from a script, under nohup or by a CI service ignores SIGINT; the command
    a test signals still starts with it at its default (fixtures.default_signals), so the case tests the command."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        test_decode_killed_at_each_phase_leaves_nothing_the_next_write_keeps("SIGINT", "between-records", server,
                                                                            tmp_path)
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_command_started_with_sigint_ignored_keeps_it_ignored(server, tmp_path):
    """The POSIX convention (docs/testing.md): SIGINT sent to a command whose parent ignored it is not an interrupt;
    the run goes on to its whole result, and SIGTERM still ends a command."""
    out = tmp_path / "ev"
    out.mkdir()

    def ignore_sigint() -> None:
        default_signals()
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "decode", "--base-url", server, "--out", str(out),
                             "--prompts", "3", "--max-tokens", "3"], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=ignore_sigint)
    err = signal_when(proc, lambda: _reached(out, "between-records"), "SIGINT", "between-records", timeout_s=60)
    assert proc.returncode == 0, err
    (run,) = out.iterdir()
    assert ".partial" not in run.name
    assert len(list((run / "raw").glob("*.json"))) == 3, sorted(p.name for p in run.rglob("*"))
