"""Fixtures shared by the whole suite. Everything is built here; nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fixtures import ROOT, SERVE_MAX_MODEL_LEN, free_port


@pytest.hookimpl(trylast=True)  # after pytest's own configure: the temporary-folder factory is needed
def pytest_configure(config):
    """With xdist workers, compile (or load) the grid kernel once here, while the workers start and collect; they
    wait for it before their first test (pytest_runtestloop): after an edit of the kernel, two workers would
    otherwise both compile it at once (minutes of CPU each), and a test's job would time out. In a thread, not
    before the workers start: loading a current cache held back every worker's start by a second."""
    config.pluginmanager.register(_XdistGroups(), "gemma4-t4-xdist-groups")
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import fcntl
        import threading

        from repack.kernel_cache import warm

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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every vllm-marked test joins one xdist group (pyproject's `--dist loadgroup`): one worker runs them all, in
    collection order, against one set of session servers, so the two cores never host two vLLM halves at once.
    They are put first so that worker starts on them at once while the other takes everything else; a test that
    ends a shared server (marked ends_shared_server) runs after every other vllm test."""
    vllm = [item for item in items if item.get_closest_marker("vllm")]
    vllm.sort(key=lambda item: item.get_closest_marker("ends_shared_server") is not None)  # stable
    for item in vllm:
        item.add_marker(pytest.mark.xdist_group("vllm"))
        if getattr(config.option, "loadgroup", False) and hasattr(item, "_id"):
            # xdist 3.8.0 marks a group by rewriting item._nodeid, which pytest 9.2 no longer reads (the node id
            # is item._id): without this the group is silently ignored and both workers start vLLM servers.
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@vllm")
    rest = [item for item in items if not item.get_closest_marker("vllm")]
    items[:] = vllm + rest


class _XdistGroups:
    """The other xdist groups (tests marked `pytest.mark.xdist_group(name)`, e.g. fixtures.IN_PROCESS_TORCH) get the
    same node-id suffix the vllm group gets above, which pytest 9.2 needs for `--dist loadgroup` to see them."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        if not getattr(config.option, "loadgroup", False):
            return
        from _pytest.nodeid import NodeId

        for item in items:
            mark = item.get_closest_marker("xdist_group")
            if mark is None or item.get_closest_marker("vllm") or not hasattr(item, "_id"):
                continue  # vllm-marked tests keep the vllm group
            name = mark.args[0] if mark.args else mark.kwargs.get("name", "default")
            if not item.nodeid.endswith(f"@{name}"):
                item._id = NodeId.parse(f"{item.nodeid}@{name}")


@pytest.fixture(scope="session")
def tiny_qat(tmp_path_factory) -> Path:
    """The tiny multimodal QAT-like checkpoint (sharded, towers, tied head), built once per session (trained once
    per content address: tools.demo.tiny_model's cache)."""
    from tools.demo.tiny_model import cached_tiny_qat_checkpoint

    info = cached_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny") / "gemma-4-tiny-qat")
    assert info.accuracy > 0.95, f"tiny model did not learn its pattern (accuracy {info.accuracy:.3f})"
    return info.path


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """The same tiny model left off the grid: a stand-in for a base (non-QAT) bf16 checkpoint."""
    from tools.demo.tiny_model import cached_tiny_qat_checkpoint

    return cached_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny-base") / "gemma-4-tiny-base", on_grid=False).path


# --------------------------------------------------------------------------------------------------------------
# Serving fixtures: the two builds of `tiny_qat` the serving, measuring and MCP tests use, and a live vLLM server
# for each (vLLM's CPU backend on machines without a GPU). Servers are shared by the whole session: one start each.



def _build(src: Path, out: Path, **options) -> Path:
    from repack.build import BuildOptions, build_checkpoint

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


def _require_plugin() -> None:
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="vllm.general_plugins")}
    assert "gemma4_t4_cpu_int4_embedding" in names, (
        "the gemma4-t4 vLLM plugin is not installed: run `pip install -e .` (./setup.sh does)")


def _serve(cfg):
    """Starts a shared server for the session. On the CPU its model worker runs inside vLLM's engine process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0 for that start only): one Python process fewer to import vLLM into, 30 s ->
    23 s per start here, same greedy tokens (evidence/suite-speed.md). The product's own process layout is what
    every other start in the suite runs (the command line, the demo, the MCP server, instances, the decode sweep)."""
    from tools.serving.vllm_server import start_server, stop_server

    _require_plugin()
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read by the server process, copied at its launch
    try:
        start_server(cfg)
    finally:
        if old is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old
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
# GEMMA4_T4_START_LOG=<file>: one JSON line per vLLM server start (tests/start_log.py), to see where time goes.

_start_log = None


def pytest_sessionstart(session):
    global _start_log
    out = os.environ.get("GEMMA4_T4_START_LOG")
    # Not in xdist's controller: its temporary folder holds the workers', and it does not run their tests.
    controller = getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput")
    if out and not controller:
        from start_log import StartLog

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
