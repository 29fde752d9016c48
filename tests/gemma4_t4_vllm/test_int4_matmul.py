"""The plugin's int4 matmul (gemma4_t4_vllm/int4_matmul.py) against the dequantize-and-matmul reference: random
levels and scales at several shapes and group sizes, through the numba kernel where it takes the shape and through
the fallback where it does not."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.fixtures import IN_PROCESS_TORCH

pytestmark = IN_PROCESS_TORCH  # torch, imported by the tests (not at collection, on every worker)


def _weight(rng, n, k, group, dtype):
    """(compressed-tensors int32 words [n, k/8], scales [k/group, n] in dtype, the float32 weight [k, n])."""
    import torch

    levels = rng.integers(-8, 8, size=(n, k))
    levels[0] = -8
    levels[-1] = 7  # top bit set: negative int32 words
    nib = (levels + 8).astype(np.uint64).reshape(n, k // 8, 8) << (np.arange(8, dtype=np.uint64) * 4)
    words = torch.from_numpy(nib.sum(-1).astype(np.uint32).view(np.int32))
    scales = torch.from_numpy(rng.uniform(0.001, 0.05, size=(k // group, n)).astype(np.float32)).to(dtype)
    dense = levels.T.astype(np.float32) * np.repeat(scales.float().numpy(), group, axis=0)  # exact in float32
    return words, scales, torch.from_numpy(dense)


# (n, k, group, dtype, rows, the kernel takes it)
CASES = [
    (64, 128, 32, "float16", 1, True),
    (96, 256, 32, "float16", 3, True),      # T = 32
    (2048, 512, 32, "float16", 1, True),    # 32 tiles: split across threads
    (48, 96, 96, "bfloat16", 2, True),      # one group per channel, T = 16
    (40, 64, 16, "float16", 8, True),       # T = 8, the most rows the kernel takes
    (64, 128, 128, "float16", 9, False),    # a prefill: dequantized once for all rows
    (64, 96, 3, "float16", 2, False),       # an odd group splits a byte: fallback
    (64, 128, 8, "float32", 1, False),      # float32 scales: fallback
]


@pytest.mark.parametrize("n, k, group, dtype_name, rows, takes", CASES)
def test_int4_matmul_equals_the_dequantized_matmul(n, k, group, dtype_name, rows, takes):
    import torch

    from gemma4_t4_vllm import int4_matmul

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(n * k + group)
    words, scales, dense = _weight(rng, n, k, group, dtype)
    tiles = int4_matmul.to_tiles(words)
    t = int4_matmul.tile_width(n)
    assert tiles.dtype == torch.uint8 and tiles.shape == (n // t, k // 2, t)
    assert torch.equal(int4_matmul.dequantize(tiles, scales), dense)
    assert int4_matmul.gemv_takes(rows, tiles, scales) is takes

    torch.set_num_threads(2)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(dtype)
    exact = x.double() @ dense.double()
    out = int4_matmul.matmul(x, tiles, scales)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    # float32 sums of exact products, in another order than the reference's
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype)
    lin = int4_matmul.linear(x.reshape(rows, 1, k), tiles, scales, bias)
    assert lin.dtype == dtype and lin.shape == (rows, 1, n)
    torch.testing.assert_close(lin.reshape(rows, n), (out + bias.float()).to(dtype), rtol=0, atol=0)


def test_the_kernel_and_the_fallback_agree_and_the_switch_forces_the_fallback(monkeypatch):
    """The same product through both paths (the reference's environment switch forces the fallback), and the
    kernel really ran on the first: gemv_takes says so, and a poisoned fallback is not called."""
    import torch

    from gemma4_t4_vllm import int4_matmul

    rng = np.random.default_rng(5)
    words, scales, _ = _weight(rng, 256, 1024, 32, torch.float16)
    tiles = int4_matmul.to_tiles(words)
    x = torch.from_numpy(rng.standard_normal((2, 1024)).astype(np.float32)).half()
    fallback = int4_matmul._dequantized_matmul
    with monkeypatch.context() as m:
        m.setattr(int4_matmul, "_dequantized_matmul", lambda *a: pytest.fail("the fallback ran"))
        kernel = int4_matmul.matmul(x, tiles, scales)
    monkeypatch.setenv(int4_matmul.PATH_ENV, "dequantize")
    assert not int4_matmul.gemv_takes(2, tiles, scales)
    calls = []
    monkeypatch.setattr(int4_matmul, "_dequantized_matmul", lambda *a: calls.append(1) or fallback(*a))
    reference = int4_matmul.matmul(x, tiles, scales)
    assert calls == [1]
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-4)


def test_a_forward_compiled_first_in_a_fresh_process_keeps_the_op_whole():
    """vLLM compiles the first forward after loading: the op must exist by then. Registered on first call, it was
    registered inside the trace, and the compiled CPU start failed ("Attempted to inline function marked as
    skipped"). In a process of its own: in this one an earlier test has registered it."""
    import os
    import subprocess
    import sys

    from tests.helpers.fixtures import ROOT

    code = ("import torch\n"
            "from gemma4_t4_vllm import int4_matmul\n"
            "words = torch.randint(-2**31, 2**31 - 1, (64, 16), dtype=torch.int32)\n"
            "scales = torch.rand(4, 64, dtype=torch.float16) / 8\n"
            "tiles = int4_matmul.to_tiles(words)\n"
            "x = torch.randn(1, 128, dtype=torch.float16)\n"
            "f = torch.compile(lambda a: int4_matmul.linear(a, tiles, scales), fullgraph=True, backend='eager')\n"
            "assert torch.equal(f(x), int4_matmul.linear(x, tiles, scales))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]


def test_the_int4_matmul_runs_under_torch_compile():
    """CPU_COMPILE=1 serves through torch.compile: the matmul is one op in the graph (not traced into numba)."""
    import torch

    from gemma4_t4_vllm import int4_matmul

    rng = np.random.default_rng(6)
    words, scales, dense = _weight(rng, 64, 128, 32, torch.float16)
    tiles = int4_matmul.to_tiles(words)
    x = torch.from_numpy(rng.standard_normal((1, 128)).astype(np.float32)).half()
    compiled = torch.compile(lambda a: int4_matmul.linear(a, tiles, scales), fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), int4_matmul.linear(x, tiles, scales), rtol=0, atol=0)
