"""Fixtures shared by the whole suite. Everything is built here; nothing is downloaded."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import reaper
from tests.helpers.fixtures import ROOT, SERVE_MAX_MODEL_LEN, free_port, in_process_engine, require_plugin


@pytest.hookimpl(trylast=True)  # after pytest's own configure: the temporary-folder factory is needed
def pytest_configure(config):
    """With xdist workers, compile (or load) the grid kernel once here, while the workers start and collect; they
    wait for it before their first test (pytest_runtestloop): after an edit of the kernel, two workers would
    otherwise both compile it at once (minutes of CPU each), and a test's job would time out. In a thread, not
    before the workers start: loading a current cache held back every worker's start by a second.
    First, the run's reaper (tests/helpers/reaper.py): whatever ends this run, no server a test started outlives it."""
    reaper.start(config)
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import fcntl
        import threading

        from repack.grid.kernel_cache import warm

        # In the run's temporary folder, the parent of each worker's own: pytest removes it with old runs.
        fd = os.open(config._tmp_path_factory.getbasetemp() / _KERNEL_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # taken before any worker starts; released when warm() returns

        def run() -> None:
            try:
                warm()
            finally:
                os.close(fd)

        threading.Thread(target=run, name="grid-kernel-warm", daemon=True).start()  # Ctrl-C does not wait for it


_KERNEL_LOCK = "grid-kernel.lock"


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    config = session.config
    if hasattr(config, "workerinput"):
        lock = config._tmp_path_factory.getbasetemp().parent / _KERNEL_LOCK
        if lock.exists():
            import fcntl

            with open(lock) as f:
                fcntl.flock(f, fcntl.LOCK_SH)  # the controller's warm() has returned


# The session's shared vLLM servers: every test using one runs in lane 0, so that one worker starts each of them.
SHARED_SERVERS = frozenset({"emb4_server", "bf16_server", "perturbed_server"})
VLLM_LANES = 2


def vllm_lane(item) -> int:
    """The xdist lane of a vllm-marked test: 0 for the tests on the shared servers and the modules marked
    `vllm_lane(0)` (to even out the lanes' lengths), 1 for the other tests, which start servers of their own."""
    mark = item.get_closest_marker("vllm_lane")
    if mark is not None:
        return int(mark.args[0]) % VLLM_LANES
    return 0 if SHARED_SERVERS & set(item.fixturenames) else 1


def _xdist_group(item) -> str | None:
    """The xdist group a test runs in: its vllm lane for a vllm-marked test (whatever other group it is marked
    with), else the name of its `pytest.mark.xdist_group` (e.g. fixtures.IN_PROCESS_TORCH), else none."""
    if item.get_closest_marker("vllm"):
        return f"vllm{vllm_lane(item)}"
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return mark.args[0] if mark.args else mark.kwargs.get("name", "default")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The vllm-marked tests run in two xdist groups (pyproject's `--dist loadgroup`), the lanes of vllm_lane: each
    lane runs on one worker, in collection order, and the two lanes run side by side, each lane's servers on a core
    of their own (pytest_runtest_setup). They are put first so that the workers start on them at once; the other
    tests follow. A test that ends a shared server (marked ends_shared_server) runs after every other vllm test."""
    vllm = [item for item in items if item.get_closest_marker("vllm")]
    vllm.sort(key=lambda item: item.get_closest_marker("ends_shared_server") is not None)  # stable
    rest = [item for item in items if not item.get_closest_marker("vllm")]
    items[:] = vllm + rest
    loadgroup = getattr(config.option, "loadgroup", False)
    for item in items:
        group = _xdist_group(item)
        if group is None:
            continue
        if item.get_closest_marker("vllm"):
            item.add_marker(pytest.mark.xdist_group(group))
        if loadgroup and hasattr(item, "_id") and not item.nodeid.endswith(f"@{group}"):
            # xdist 3.8.0 marks a group by rewriting item._nodeid, which pytest 9.2 no longer reads (the node id
            # is item._id): without this every group is silently ignored (both workers would start vLLM servers).
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{group}")


_USER_CPU_BIND = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")

# Tests of a build serving on its own port (the lifecycle, replace, the second command, the walks) read the
# project's tpu.env with FRONT_DOOR=0; the front door, tpu.env's shipped default, is tested where a test unsets it
# (tests/serving/frontdoor/test_service.py, the real front-door case in test_frontdoor.py).
os.environ["FRONT_DOOR"] = "0"


def lane_cores(config) -> list[str] | None:
    """VLLM_CPU_OMP_THREADS_BIND for each lane when the lanes run side by side (xdist workers, --dist loadgroup,
    at least two cores, no binding of the caller's): the cores split in two halves, one per lane. None otherwise,
    and vLLM binds as it would for a user (its "auto")."""
    if _USER_CPU_BIND is not None or not hasattr(config, "workerinput"):
        return None
    if not getattr(config.option, "loadgroup", False):
        return None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < VLLM_LANES:
        return None
    per = len(cores) // VLLM_LANES
    return [",".join(map(str, cores[i * per:(i + 1) * per])) for i in range(VLLM_LANES)]


def pytest_runtest_setup(item):
    """Before a vllm test's fixtures start servers: its lane's cores, for every vLLM server started from here on
    (the environment is inherited by the command line, the MCP server and vLLM's own processes). The two lanes'
    servers then never share a core; vLLM's OpenMP threads would otherwise all bind to vLLM's auto choice."""
    if not item.get_closest_marker("vllm"):
        return
    binds = lane_cores(item.config)
    if binds is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binds[vllm_lane(item)]


@pytest.fixture(scope="session")
def tiny_qat(tmp_path_factory) -> Path:
    """The tiny multimodal QAT-like checkpoint (sharded, towers, tied head), built once per session (trained once
    per content address: repack.stand_ins.tiny_model's cache)."""
    from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint

    info = cached_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny") / "gemma-4-tiny-qat")
    assert info.accuracy > 0.95, f"tiny model did not learn its pattern (accuracy {info.accuracy:.3f})"
    return info.path


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """The same tiny model left off the grid: a stand-in for a base (non-QAT) bf16 checkpoint."""
    from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint

    return cached_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny-base") / "gemma-4-tiny-base", on_grid=False).path


# --------------------------------------------------------------------------------------------------------------
# Serving fixtures: the two builds of `tiny_qat` the serving, measuring and MCP tests use, and a live vLLM server
# for each (vLLM's CPU backend on machines without a GPU). Servers are shared by the whole session: one start each.



def _build(src: Path, out: Path, **options) -> Path:
    from repack.build.build import BuildOptions, build_checkpoint

    build_checkpoint(src, out, BuildOptions(**options))
    return out


@pytest.fixture(scope="session")
def emb4_build(tiny_qat, tmp_path_factory) -> Path:
    """The one-pass int4-embedding build of `tiny_qat`: W4A16 linears, int4 embed_tokens and PLE, untied int4
    lm_head, text only."""
    out = tmp_path_factory.mktemp("emb4") / "gemma-4-tiny-text-emb4"
    return _build(tiny_qat, out, text_only=True, embed_int4=True, embed_tokens=True)


@pytest.fixture(scope="session")
def bf16_text_build(tiny_qat, tmp_path_factory) -> Path:
    """The text-only build with bf16 embeddings (W4A16 linears, tied head): the article's "-text" build."""
    out = tmp_path_factory.mktemp("text") / "gemma-4-tiny-text"
    return _build(tiny_qat, out, quantize_linears=True, text_only=True, embed_int4=False, embed_tokens=False)


@pytest.fixture(scope="session")
def serve_config_factory(tmp_path_factory):
    """make(model, served_name, **overrides) -> ServeConfig: the project's tpu.env with CPU-test settings, a free
    port and a state dir of its own."""
    from tools.serving.config import load_config

    def make(model: Path | str, served_name: str, **overrides):
        values = dict(model=str(model), served_name=served_name, host="127.0.0.1", port=free_port(),
                      state_dir=tmp_path_factory.mktemp(f"state-{served_name}"), max_model_len=SERVE_MAX_MODEL_LEN,
                      max_num_seqs=8, cpu_kvcache_space_gib=1, speculative_config="", extra_args="",
                      start_timeout_s=900.0)
        values.update(overrides)
        return load_config(ROOT / "tpu.env", **values)

    return make


def _serve(cfg):
    """Starts a shared server for the session. On the CPU its model worker runs inside vLLM's engine process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0 for that start only): one Python process fewer to import vLLM into, 30 s ->
    23 s per start here, same greedy tokens (evidence/suite-speed.md). The product's own process layout is what
    the command line, the demo, the MCP server and instances run (fixtures.in_process_engine says where else)."""
    from tools.serving.server.server import start_server
    from tools.serving.server.server import stop_server

    require_plugin()
    with pytest.MonkeyPatch.context() as mp:  # for this start only: read by the server process at its launch
        in_process_engine(mp)
        start_server(cfg)
    try:
        yield cfg
    finally:
        stop_server(cfg)


@pytest.fixture(scope="session")
def emb4_server(emb4_build, serve_config_factory):
    """A live vLLM server of `emb4_build` for the whole session; yields its ServeConfig (own port and state dir)."""
    yield from _serve(serve_config_factory(emb4_build, "gemma-4-tiny-text-emb4"))


@pytest.fixture(scope="session")
def bf16_server(bf16_text_build, serve_config_factory):
    """A live vLLM server of `bf16_text_build` for the whole session; yields its ServeConfig."""
    yield from _serve(serve_config_factory(bf16_text_build, "gemma-4-tiny-text"))


def perturb_scales(build: Path, out: Path) -> list[str]:
    """A copy of `build` with wrong scales: ×1.5 on every other output row of the first two decoder layers'
    weight_scale, and ×-1.5 on every other row of the lm_head's. The tiny model predicts its pattern so
    confidently that the layers' ×1.5 alone leaves every top-1 token in place (measured); the head's sign makes
    the top-1 fail wherever the predicted token is on a perturbed row."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(build, out)
    changed: list[str] = []
    for shard in sorted(out.glob("*.safetensors")):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if not name.endswith("weight_scale"):
                continue
            factor = -1.5 if name.startswith("lm_head") else 1.5
            if name.startswith("lm_head") or ".layers.0." in name or ".layers.1." in name:
                t = t.clone()
                t[::2] = (t[::2].float() * factor).to(t.dtype)
                tensors[name] = t
                changed.append(name)
        save_file(tensors, shard, metadata={"format": "pt"})
    assert changed, f"no weight_scale tensors found in {build}"
    return changed


@pytest.fixture(scope="session")
def perturbed_server(emb4_build, emb4_server, serve_config_factory, tmp_path_factory):
    """A live server of `emb4_build` with wrong scales (perturb_scales): the negative control of the fidelity
    metrics and the "other build" the token comparisons diverge from. Yields (ServeConfig, changed tensor names).
    The test that kills it is marked ends_shared_server, which runs it after every other vllm test."""
    bad = tmp_path_factory.mktemp("badscales") / "gemma-4-tiny-text-emb4-badscales"
    changed = perturb_scales(emb4_build, bad)
    for cfg in _serve(serve_config_factory(bad, "gemma-4-tiny-badscales", cpu_dtype=emb4_server.cpu_dtype)):
        yield cfg, changed


# --------------------------------------------------------------------------------------------------------------
# GEMMA4_T4_START_LOG=<file>: one JSON line per vLLM server start (tests/helpers/start_log.py), to see where time goes.

_start_log = None


def pytest_sessionstart(session):
    global _start_log
    out = os.environ.get("GEMMA4_T4_START_LOG")
    # Not in xdist's controller: its temporary folder holds the workers', and it does not run their tests.
    controller = getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput")
    if out and not controller:
        from tests.helpers.start_log import StartLog

        basetemp = session.config._tmp_path_factory.getbasetemp()
        _start_log = StartLog(Path(out).resolve(), str(basetemp))
        _start_log.start()


def pytest_runtest_logstart(nodeid, location):
    if _start_log is not None:
        _start_log.current = (nodeid, "setup")


def pytest_runtest_call(item):
    if _start_log is not None:
        _start_log.current = (item.nodeid, "call")


def pytest_runtest_teardown(item, nextitem):
    if _start_log is not None:
        _start_log.current = (item.nodeid, "teardown")


def pytest_sessionfinish(session, exitstatus):
    if _start_log is not None:
        _start_log.close()


@pytest.fixture
def mounts():
    """mount(path, *options): a small tmpfs at path, unmounted at the end."""
    done: list[Path] = []

    def mount(path: Path, *options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=64k",) + options), "tmpfs", str(path)],
                       check=True)
        done.append(path)
        return path

    yield mount
    for p in reversed(done):
        subprocess.run(["umount", "-l", str(p)], check=False)
