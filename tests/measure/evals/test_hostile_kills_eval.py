"""The kill matrix for `./vllm-t4 eval`: SIGINT, SIGTERM or SIGKILL while lm-eval waits on its first request. A
stand-in server describes itself as vLLM does (/v1/models naming a real tokenizer folder, /version) and holds
every completion request unanswered, so lm-eval is inside its run when the command is signalled. Every case:
lm-eval (the command's child, under tools.core.parent_watch) ends with the command; SIGINT and SIGTERM exit
130 / 143 with one last line, no traceback and nothing in --out; a SIGKILL leaves the run's temporary folder,
which the next write there, of any command, sweeps."""

from __future__ import annotations

import os
import threading

import psutil
import pytest

from tests.helpers.fixtures import ROOT
from tests.helpers.kill_matrix import SIGNALS, assert_ended, assert_swept_by_the_next_write, cli, signal_when
from tests.helpers.stand_ins.measure import lm_eval_stand_in, serve_in_thread



@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """(base URL, a list that receives each completion request as it arrives)."""
    arrived: list[str] = []
    release = threading.Event()  # until set, every completion request is held: lm-eval waits inside its run
    with serve_in_thread(lm_eval_stand_in(tmp_path_factory.mktemp("tokenizer"), arrived, release)) as url:
        yield url, arrived
        release.set()  # before the server shuts down: a held request ends


def _lm_eval(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [c for c in proc.children(recursive=True) if "lm_eval" in " ".join(c.cmdline())]
    except psutil.Error:
        return []


@pytest.mark.parametrize("sig", list(SIGNALS))
def test_a_killed_eval_ends_lm_eval_and_leaves_nothing_the_next_write_keeps(sig, held, tmp_path):
    base_url, arrived = held
    out = tmp_path / "ev"
    out.mkdir()
    n0 = len(arrived)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "hf"))
    proc = cli(["eval", "--tasks", "tiny_pattern_mc", "--base-url", base_url, "--out", str(out), "--limit", "4"],
               env)
    children: list[psutil.Process] = []

    def settle() -> None:
        children.extend(_lm_eval(psutil.Process(proc.pid)))
        assert children

    err = signal_when(proc, lambda: len(arrived) > n0, sig, "lm-eval's first request", timeout_s=240,
                      settle=settle)
    _, alive = psutil.wait_procs(children, timeout=20)
    for c in alive:
        c.kill()
    assert not alive, "lm-eval outlived the eval command"
    assert_ended(sig, proc.returncode, err)
    if sig != "SIGKILL":
        assert os.listdir(out) == []
    else:
        assert_swept_by_the_next_write(out)
