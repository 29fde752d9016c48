"""Helpers the test modules import (conftest.py holds the pytest fixtures built on them)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tools.core import process

ROOT = Path(__file__).resolve().parents[2]
SERVE_MAX_MODEL_LEN = 512  # short contexts keep the CPU KV cache small; tests that need more ask for it

# Tests that import torch, vLLM, transformers or compressed-tensors into the test process, and the modules whose
# shared fixtures they use: one xdist worker runs them all (tests/conftest.py gives the group to xdist), so those
# imports (seconds each) and the fixtures are paid once per run instead of once per worker.
IN_PROCESS_TORCH = pytest.mark.xdist_group("torch")


def free_port() -> int:
    """A TCP port nothing holds right now on 127.0.0.1, outside the ephemeral range (tools.core.process)."""
    return process.free_port()


def repack_cli(capsys, *args) -> tuple[int, str]:
    """`python -m repack ARGS` in-process: its exit status and what it wrote to stderr."""
    from tools.cli import repack_cli as cli

    rc = cli.main([str(a) for a in args])
    return rc, capsys.readouterr().err


def one_line_error(err: str, *needles: str) -> str:
    """The one `error: ` line a refused command printed, containing every needle."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def launched(argv: list[str], **popen) -> tuple[subprocess.Popen, str]:
    """Starts a stand-in for a process the project launches as the project launches it: in its own session, with
    a launch token in its environment (records.identity.launch_env). Returns it and the token its record holds."""
    from tools.serving.records.identity import launch_env, new_launch

    token = new_launch()
    env = {**(popen.pop("env", None) or os.environ), **launch_env(token)}
    return subprocess.Popen(argv, start_new_session=True, env=env, **popen), token


def group_alive(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group `pgid`."""
    import os

    import psutil

    alive = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            continue
    return alive


def kill_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGKILL process group `pgid` and wait until none of it runs: killpg returns before the kernel has ended
    its processes, and a command run at once could still find them."""
    import os
    import signal
    import time

    os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while group_alive(pgid):
        assert time.monotonic() < deadline, f"process group {pgid} still runs {timeout:.0f} s after SIGKILL"
        time.sleep(0.02)


def stand_in_t4_hardware():
    """A Tesla T4 on a small host (compute capability 7.5, `ram` bytes of RAM, `swap` bytes of swap), as the
    serving code's Hardware sees it: the class is built on first use so importing this module stays light."""
    from tools.serving.preflight.hardware import Hardware

    class StandInT4(Hardware):
        def __init__(self, ram: int = 64 << 30, swap: int = 0) -> None:
            self.ram, self.swap = ram, swap

        def platform(self):
            return "cuda"

        def compute_capability(self):
            return (7, 5)

        def host_memory(self):
            return self.ram, self.swap

    return StandInT4


def stand_in_eval_run(folder: Path, label: str, per_doc: dict[int, float], *,
                      hashes: dict[int, str] | None = None) -> Path:
    """A run folder as run_eval writes it, with one task and per-document acc values."""
    import json
    import math

    from tools.measure.evals.results import EvalResult, TaskScore

    lm = folder / "lm_eval" / "m"
    lm.mkdir(parents=True)
    samples = lm / "samples_t_2026-01-01T00-00-00.jsonl"
    samples.write_text("".join(json.dumps({"doc_id": d, "filter": "none", "acc": v,
                                           "doc_hash": (hashes or {}).get(d, f"h{d}")}) + "\n"
                               for d, v in per_doc.items()))
    vals = list(per_doc.values())
    mean = sum(vals) / len(vals)
    se = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1) / len(vals))
    res = EvalResult(run_id=folder.name, run_dir=str(folder), label=label, model="m", base_url="u",
                     tasks=["t"], started="s",
                     scores=[TaskScore(task="t", metric="acc", value=mean, stderr=se, n=len(vals))],
                     files={"samples:t": str(samples)})
    (folder / "summary.json").write_text(json.dumps(res.to_dict()))
    return folder


def stand_in_sweep_run(folder: Path, label: str, cells: dict[tuple[int, int], list[float]], *, model: str = "m",
                   provenance: dict | None = None):
    """A finished sweep run folder as run_sweep writes it (summary.json, summary.md): per (input_len, concurrency)
    its repeats' output tok/s. Returns the SweepResult."""
    from tools.measure.sweep.params import CellResult, RepeatResult, SweepResult, aggregate
    from tools.measure.sweep.report import write_run

    built = []
    for (length, c), tok_s in cells.items():
        reps = [RepeatResult(repeat=i, seed=i, status="ok", num_prompts=4,
                             metrics={"output_throughput": t, "p99_ttft_ms": 1000.0 / t, "completed": 4})
                for i, t in enumerate(tok_s)]
        median, spread = aggregate(reps)
        built.append(CellResult(input_len=length, output_len=16, concurrency=c, num_prompts=4, status="ok",
                                repeats=reps, median=median, spread_pct=spread))
    res = SweepResult(run_id=folder.name, run_dir=str(folder), label=label, params={"output_len": 16, "repeats": 3},
                      model=model, started="2026-12-01T00:00:00+00:00", finished="2026-12-01T00:01:00+00:00",
                      cells=built, provenance=provenance or {})
    folder.mkdir(parents=True, exist_ok=True)
    write_run(res, folder, plot=False)
    return res


def require_plugin() -> None:
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    assert "gemma4_t4_cpu_int4_embedding" in names, (
        "the gemma4-t4 vLLM plugin is not installed: run `pip install -e .` (./setup.sh does)")


@contextmanager
def reaped(p: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """Kills the process group of `p` (started with start_new_session) if it still runs on the way out: a test
    that fails midway leaves no build behind."""
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def in_process_engine(mp: pytest.MonkeyPatch) -> None:
    """For the vLLM CPU servers a test starts where their process layout is not what it checks: the model worker
    runs inside vLLM's engine process (VLLM_ENABLE_V1_MULTIPROCESSING=0, read by the server at its launch), one
    Python process fewer to import vLLM and torch into, the same greedy tokens (evidence/suite-speed.md). Bound to
    a lane's cores, vLLM binds no OpenMP threads itself in this layout: as many threads as those cores."""
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if bind and all(c.isdigit() for c in bind.split(",")):
        mp.setenv("OMP_NUM_THREADS", str(len(bind.split(","))))


_DEFAULTED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def default_signals() -> None:
    """`preexec_fn` of every child a test signals: SIGINT, SIGTERM and SIGHUP at their defaults, whatever the test
    runner inherited. A runner started as `cmd &` from a script, under nohup or by some CI services ignores SIGINT
    (or SIGHUP); its children would inherit that, and a command keeps a signal it was started with ignored
    (docs/testing.md), so a kill test would test the runner's start instead of the command."""
    for sig in _DEFAULTED:
        signal.signal(sig, signal.SIG_DFL)
def state_env(state_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of a command run against the servers whose state files are under `state_dir`."""
    env = dict(os.environ, STATE_DIR=str(state_dir), PYTHONPATH=str(ROOT))
    env.update(extra)
    return env
