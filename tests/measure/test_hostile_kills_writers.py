"""The kill matrix for the other commands that write evidence against a running server: `./vllm-t4 compare record`
(one token record, written whole at the end) and `./vllm-t4 fidelity record` (REF.json, streamed a window at a
time into a temporary beside it). A stand-in server answers what they ask (/v1/models, /tokenize, /detokenize,
/v1/chat/completions with token ids and logprobs, /v1/completions with prompt_logprobs), each answer slowly enough
that the test can signal the command before its first record and between records; the stand-in counts the
requests it started and answered, which is how the test knows the phase. SIGINT and SIGTERM end the command with
130 / 143, one line after its progress lines, no traceback and nothing left beside --out; SIGKILL leaves at most
the temporary (and its lock file), which the next run of the same command, to completion, sweeps.

Not here: `./vllm-t4 sweep`, whose cells run vLLM's `bench serve` in a worker that imports vLLM and loads the
served model's tokenizer (seconds a cell even on a stand-in), and whose run folder is resumable by design (a killed
sweep keeps every finished repeat), so "nothing left" is not its contract."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers.fixtures import ROOT
from tests.helpers.kill_matrix import SIGNALS, assert_ended, cli, signal_when
from tests.helpers.stand_ins.measure import serve_in_thread, writer_stand_in

PHASES = ["before-first-record", "between-records"]


@pytest.fixture
def server():
    """A fresh stand-in per case: a killed client's last request (still sleeping) never counts in the next."""
    counts: Counter = Counter()
    with serve_in_thread(writer_stand_in(counts)) as url:
        yield url, counts


def _reached(counts: Counter, path: str, phase: str) -> bool:
    started, answered = counts[f"started {path}"], counts[f"answered {path}"]
    if phase == "before-first-record":
        return started >= 1 and answered == 0
    return answered >= 1 and started > answered


def _run(argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _kill_at(argv: list[str], counts: Counter, path: str, phase: str, sig: str) -> tuple[int, str]:
    proc = cli(argv)
    err = signal_when(proc, lambda: _reached(counts, path, phase), sig, phase, timeout_s=60)
    return proc.returncode, err


def _leftovers(folder: Path, name: str) -> list[str]:
    """What a killed write of folder/name may leave: its temporary and the lock file beside it, nothing else."""
    left = sorted(os.listdir(folder))
    assert all(f.startswith(f".{name}.partial-") or f.startswith(f".{name}.lock-") for f in left), left
    return left


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", list(SIGNALS))
def test_compare_record_killed_at_each_phase_leaves_nothing_the_next_run_keeps(sig, phase, server, tmp_path):
    url, counts = server
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    out = tmp_path / "ev"
    out.mkdir()
    argv = ["compare", "record", "--base-url", url, "--out", str(out / "tokens.json"), "--prompts", str(prompts),
            "--max-tokens", "2", "--top-logprobs", "2"]
    rc, err = _kill_at(argv, counts, "/v1/chat/completions", phase, sig)
    assert_ended(sig, rc, err)
    assert _leftovers(out, "tokens.json") == []  # written whole at the end: even SIGKILL leaves nothing
    if sig == "SIGKILL":
        done = _run(argv)
        assert done.returncode == 0, done.stderr
        assert os.listdir(out) == ["tokens.json"]
        assert len(json.loads((out / "tokens.json").read_text())["generations"]) == 2
    else:
        assert os.listdir(out) == []


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("sig", list(SIGNALS))
def test_fidelity_record_killed_at_each_phase_leaves_nothing_the_next_run_keeps(sig, phase, server, tmp_path):
    url, counts = server
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 3)
    out = tmp_path / "ev"
    out.mkdir()
    argv = ["fidelity", "record", "--base-url", url, "--out", str(out / "REF.json"), "--corpus", str(corpus),
            "--window", "16", "--max-corpus-tokens", "32", "--top-k", "2"]
    rc, err = _kill_at(argv, counts, "/v1/completions", phase, sig)
    assert_ended(sig, rc, err)
    left = _leftovers(out, "REF.json")
    if sig == "SIGKILL":
        assert any(".partial-" in f for f in left), left  # a SIGKILL runs no clean-up ...
        done = _run(argv)  # ... the next record there sweeps it
        assert done.returncode == 0, done.stderr
        assert os.listdir(out) == ["REF.json"]
        assert json.loads((out / "REF.json").read_text())["footer"]["complete"] is True
    else:
        assert left == []
