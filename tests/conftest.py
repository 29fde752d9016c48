"""Fixtures shared by the whole suite. Everything is built here; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from fixtures import ROOT, SERVE_MAX_MODEL_LEN, free_port


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
    from tools.serving.vllm_server import start_server, stop_server

    _require_plugin()
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
