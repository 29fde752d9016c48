"""The vLLM general plugin: its torch gather against a reference decoder, and its registration on the CPU."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import numpy as np
import pytest

from fixtures import IN_PROCESS_TORCH

pytestmark = IN_PROCESS_TORCH  # torch and vLLM, imported by the tests (not at collection, on every worker)


def _pack_reference(levels: np.ndarray) -> np.ndarray:
    """Levels in [-8, 7], [rows, cols] -> int32 words [rows, cols/8]: value j in word j//8 at bits 4*(j%8)."""
    rows, cols = levels.shape
    nib = (levels + 8).astype(np.uint64).reshape(rows, cols // 8, 8)
    words = np.zeros((rows, cols // 8), dtype=np.uint64)
    for k in range(8):
        words |= nib[:, :, k] << np.uint64(4 * k)
    return words.astype(np.uint32).view(np.int32)


@pytest.mark.parametrize("groups, dtype_name", [(6, "float16"), (1, "bfloat16"), (6, "bfloat16")])
def test_gather_matches_reference(groups, dtype_name):
    import torch

    from gemma4_t4_vllm import dequant_gather_torch

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(0)
    vocab, hidden = 64, 192
    levels = rng.integers(-8, 8, size=(vocab, hidden))
    levels[3] = -8  # nibble 0 everywhere: words of zero
    levels[4] = 7   # nibble 15 everywhere: every word has its top bit set, a negative int32
    scales = rng.uniform(0.001, 0.05, size=(vocab, groups)).astype(np.float32)
    packed = torch.from_numpy(_pack_reference(levels))
    scale_t = torch.from_numpy(scales).to(dtype)
    ids = torch.tensor([[5, 3, 4], [63, 0, 5]])

    out = dequant_gather_torch(ids, packed, scale_t, hidden, 4)

    assert out.dtype == dtype and out.shape == (6, hidden)
    flat = ids.reshape(-1).numpy()
    ref_scale = scale_t.float().numpy().repeat(hidden // groups, axis=1)
    ref = (levels[flat].astype(np.float32) * ref_scale[flat])
    ref = torch.from_numpy(ref).to(dtype)
    assert torch.equal(out, ref)
    assert (packed[4] < 0).all() and (packed[3] == 0).all()


def test_gather_of_8_bit_words():
    import torch

    from gemma4_t4_vllm import dequant_gather_torch

    rng = np.random.default_rng(1)
    levels = rng.integers(-128, 128, size=(4, 64))
    words = ((levels + 128).astype(np.uint64).reshape(4, 16, 4) << (np.arange(4, dtype=np.uint64) * 8)).sum(-1)
    packed = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    scale = torch.full((4, 2), 0.5, dtype=torch.float16)
    out = dequant_gather_torch(torch.tensor([2, 1]), packed, scale, 64, 8)
    assert torch.equal(out, torch.from_numpy(levels[[2, 1]] * 0.5).half())


def test_entry_point_is_declared():
    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert names.get("gemma4_t4_cpu_int4_embedding") == "gemma4_t4_vllm:register", (
        "run `pip install -e .` (./setup.sh does) so vLLM loads the plugin")


def test_register_swaps_the_triton_gather_on_cpu(monkeypatch):
    import gemma4_t4_vllm
    from gemma4_t4_vllm import EMBEDDING_MODULE, dequant_gather_torch

    module = importlib.import_module(EMBEDDING_MODULE)
    original = module._dequant_gather_triton
    create = module.CompressedTensorsEmbeddingWNA16Int.create_weights
    monkeypatch.setattr(gemma4_t4_vllm, "_registered", False)
    monkeypatch.setattr(module, "_dequant_gather_triton", original)
    monkeypatch.setattr(module.CompressedTensorsEmbeddingWNA16Int, "create_weights", create)

    monkeypatch.setattr(gemma4_t4_vllm, "_on_cpu_platform", lambda: False)
    gemma4_t4_vllm.register()
    assert module._dequant_gather_triton is original  # on a GPU the plugin does nothing

    monkeypatch.setattr(gemma4_t4_vllm, "_registered", False)
    monkeypatch.setattr(gemma4_t4_vllm, "_on_cpu_platform", lambda: True)
    gemma4_t4_vllm.register()
    gemma4_t4_vllm.register()  # idempotent
    assert module._dequant_gather_triton is dequant_gather_torch
    assert getattr(module.CompressedTensorsEmbeddingWNA16Int.create_weights, "_gemma4_t4", False)
