"""Fixtures shared by the whole suite. Everything is built here; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_qat(tmp_path_factory) -> Path:
    """The tiny multimodal QAT-like checkpoint (sharded, towers, tied head), built once per session."""
    from tools.tiny_model import build_tiny_qat_checkpoint

    info = build_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny") / "gemma-4-tiny-qat")
    assert info.accuracy > 0.95, f"tiny model did not learn its pattern (accuracy {info.accuracy:.3f})"
    return info.path


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    """The same tiny model left off the grid: a stand-in for a base (non-QAT) bf16 checkpoint."""
    from tools.tiny_model import build_tiny_qat_checkpoint

    return build_tiny_qat_checkpoint(tmp_path_factory.mktemp("tiny-base") / "gemma-4-tiny-base", on_grid=False).path


# --------------------------------------------------------------------------------------------------------------
# Serving fixtures: the two builds of `tiny_qat` the serving, measuring and MCP tests use, and a live vLLM server
# for each (vLLM's CPU backend on machines without a GPU). Servers are shared by the whole session: one start each.

SERVE_MAX_MODEL_LEN = 512  # the tiny model has max_position_embeddings 1024


def _build_with_repack(src: Path, out: Path, **options) -> Path | None:
    try:
        from repack.build import BuildOptions, build_checkpoint
    except ImportError:
        return None
    build_checkpoint(src, out, BuildOptions(**options))
    return out


def _fallback_build(src: Path, out: Path, *, embed_int4: bool) -> Path:
    """Used only until `repack.build` exists: text-only W4A16 build of a tiny QAT-like checkpoint, optionally with
    int4 embedding tables and an untied int4 lm_head. Grid recovery is simple (best of 8 peak levels, then least
    squares), enough for the tiny model."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    def pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
        # tiny_model's projection leaves NaN in an all-zero row (PLE padding row): that row is zeros.
        x = torch.nan_to_num(w.float(), nan=0.0).reshape(w.shape[0], -1, 32)
        amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        best_err, best_q = None, None
        for m in range(1, 9):
            step = amax / m
            q = (x / step).round().clamp(-8, 7)
            den = (q * q).sum(-1, keepdim=True).clamp_min(1e-12)
            step = ((q * x).sum(-1, keepdim=True) / den).half().float()
            err = ((q * step).bfloat16().float() - x).abs().amax(-1, keepdim=True)
            if best_err is None:
                best_err, best_q, best_step = err, q, step
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_q = torch.where(better, q, best_q)
                best_step = torch.where(better, step, best_step)
        nib = (best_q + 8).to(torch.int64).reshape(w.shape[0], -1, 8)
        words = (nib << (torch.arange(8) * 4)).sum(-1)
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
        return {"weight_packed": words.contiguous(), "weight_scale": best_step.reshape(w.shape[0], -1).half(),
                "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}

    out.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            if not name.startswith("model.language_model."):
                continue
            name = "model." + name.removeprefix("model.language_model.")
            is_embedding = name.endswith(("embed_tokens.weight", "embed_tokens_per_layer.weight"))
            if t.ndim == 2 and (embed_int4 or not is_embedding):
                base = name.removesuffix(".weight")
                for suffix, value in pack(t).items():
                    tensors[f"{base}.{suffix}"] = value
                if name == "model.embed_tokens.weight":
                    for suffix, value in pack(t).items():
                        tensors[f"lm_head.{suffix}"] = value
            else:
                tensors[name] = t.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    text = dict(cfg["text_config"], architectures=["Gemma4ForCausalLM"], model_type="gemma4_text",
                dtype=cfg.get("dtype", "bfloat16"))
    targets = ["Linear", "Embedding", "re:.*lm_head$"] if embed_int4 else ["Linear"]
    text["tie_word_embeddings"] = not embed_int4
    text["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"format": "pack-quantized", "targets": targets,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                        "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}},
            "input_activations": None, "output_activations": None}},
        "ignore": [] if embed_int4 else ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}}
    (out / "config.json").write_text(json.dumps(text, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def emb4_build(tiny_qat, tmp_path_factory) -> Path:
    """The one-pass int4-embedding build of `tiny_qat`: W4A16 linears, int4 embed_tokens and PLE, untied int4
    lm_head, text only."""
    out = tmp_path_factory.mktemp("emb4") / "gemma-4-tiny-text-emb4"
    return (_build_with_repack(tiny_qat, out, text_only=True, embed_int4=True, embed_tokens=True)
            or _fallback_build(tiny_qat, out, embed_int4=True))


@pytest.fixture(scope="session")
def bf16_text_build(tiny_qat, tmp_path_factory) -> Path:
    """The text-only build with bf16 embeddings (W4A16 linears, tied head): the article's "-text" build."""
    out = tmp_path_factory.mktemp("text") / "gemma-4-tiny-text"
    return (_build_with_repack(tiny_qat, out, quantize_linears=True, text_only=True, embed_int4=False)
            or _fallback_build(tiny_qat, out, embed_int4=False))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def serve_config_factory(tmp_path_factory):
    """make(model, served_name, **overrides) -> ServeConfig: the project's tpu.env with CPU-test settings, a free
    port and a state dir of its own."""
    from tools.config import load_config

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
    from tools.vllm_server import start_server, stop_server

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
