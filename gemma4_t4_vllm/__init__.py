"""vLLM general plugin: the int4 embedding lookup on vLLM's CPU backend.

vLLM's `CompressedTensorsEmbeddingWNA16Int` gathers and dequantizes packed embedding rows with a Triton
kernel, which does not run on the CPU platform ("module 'triton' has no attribute 'next_power_of_2'").
On the CPU platform only, `register()` swaps that kernel for a torch gather with the same arithmetic, so a
build with int4 `embed_tokens` / `embed_tokens_per_layer` serves on a machine without a GPU. On every other
platform it does nothing.

Also on the CPU platform: vLLM picks its AMX int8 GEMM (sgl kernels) for W8A8 layers by the weight's shape and
the AMX tile ISA alone, but that kernel writes only bfloat16 output ("scale_C: scalar path not implemented" for a
float16 model, the dtype this project serves so that the CPU runs the T4's numbers). `register()` keeps such
layers on vLLM's oneDNN int8 GEMM when the model is float16 and the CPU has no AMX-FP16; elsewhere it changes
nothing.

Also on the CPU platform: where the kernel library vLLM loads for this CPU (the AVX2 one) has no W4A16 GEMM,
int4 linear layers run through the plugin's int4 matmul on weights converted once at load (gemma4_t4_vllm/wna16.py,
int4_matmul.py); and where vLLM has no WNA16 MoE kernel for a model's int4 experts (Gemma 4's gelu_tanh experts),
they run through the same matmul, kept int4 (gemma4_t4_vllm/moe_wna16.py).

vLLM calls `register()` in every process it starts (API server, engine core, workers) through the
`vllm.general_plugins` entry point declared in pyproject.toml, so the project must be pip-installed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gemma4_t4_vllm import moe_wna16, wna16
from gemma4_t4_vllm.packing import signed_levels

if TYPE_CHECKING:
    import torch

# Under "vllm." so that vLLM's logging configuration prints it into the engine log.
logger = logging.getLogger("vllm.gemma4_t4_vllm")

EMBEDDING_MODULE = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_embedding"
# Logged once per process when the swap happens, and once when a model creates an int4 embedding
# (tools.serving.server.engine_log reads the second: the int4 embedding method is in use, not only available). Nothing is logged inside the
# gather itself: it runs under torch.compile, which cannot trace logging calls.
PATCHED_MARK = "gemma4-t4: CPU platform, int4 embedding lookup replaced by a torch gather"
INT8_MODULE = "vllm.model_executor.kernels.linear.scaled_mm.cpu"
INT8_MARK = "gemma4-t4: float16 model without AMX-FP16: W8A8 layers use oneDNN's int8 GEMM"
FIRST_USE_MARK = "gemma4-t4: int4 embedding lookup runs as a torch gather (CompressedTensorsEmbeddingWNA16Int)"

_registered = False


def dequant_gather_torch(ids: "torch.Tensor", weight_packed: "torch.Tensor", weight_scale: "torch.Tensor",
                         hidden: int, num_bits: int) -> "torch.Tensor":
    """Rows `ids` of a pack-quantized table, dequantized: the arithmetic of vLLM's `_dequant_gather_kernel`.

    Value j of a row sits in int32 word j // (32/num_bits) at bits num_bits*(j % (32/num_bits)), LSB first,
    stored as level + 2**(num_bits-1); value = level * scale, computed in float32 and cast to the scale dtype.
    One scale per row (channel) when weight_scale has one column, else one per group of hidden/num_groups.
    """
    import torch

    ids = ids.reshape(-1).long()
    words = weight_packed.index_select(0, ids)                       # [n, hidden/pack] int32
    levels = signed_levels(words, num_bits)[:, :hidden]
    scales = weight_scale.index_select(0, ids).to(torch.float32)     # [n, num_groups]
    num_groups = weight_scale.shape[1]
    if num_groups > 1:
        scales = scales.repeat_interleave(hidden // num_groups, dim=1)
    return (levels.to(torch.float32) * scales).to(weight_scale.dtype)


def _on_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def register() -> None:
    """Entry point of the `vllm.general_plugins` group; idempotent."""
    global _registered
    if _registered:
        return
    _registered = True
    try:
        if not _on_cpu_platform():
            return
    except ImportError:
        return
    _int8_gemm_for_float16()
    wna16.install()
    moe_wna16.install()
    try:
        import importlib

        module = importlib.import_module(EMBEDDING_MODULE)
    except ImportError:
        # A vLLM without quantized embeddings: nothing to replace.
        return
    if not hasattr(module, "_dequant_gather_triton"):
        logger.warning("gemma4-t4: %s has no _dequant_gather_triton; int4 embeddings may not serve on CPU",
                       EMBEDDING_MODULE)
        return
    # `CompressedTensorsEmbeddingWNA16Int.embedding` looks the function up in its module at call time.
    module._dequant_gather_triton = dequant_gather_torch
    _announce_use(module)
    logger.info(PATCHED_MARK)


def _model_is_float16() -> bool:
    import torch
    from vllm.config import get_current_vllm_config

    model_config = getattr(get_current_vllm_config(), "model_config", None)
    return getattr(model_config, "dtype", None) == torch.float16


def _int8_gemm_for_float16() -> None:
    """W8A8 layers of a float16 model off the AMX int8 kernel where the CPU has no AMX-FP16 (module doc)."""
    import importlib

    import torch

    try:
        module = importlib.import_module(INT8_MODULE)
    except ImportError:
        return
    original = getattr(module, "check_cpu_sgl_kernel", None)
    if original is None or getattr(original, "_gemma4_t4", False):
        return
    amx_fp16 = getattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)
    logged: list[bool] = []

    def check_cpu_sgl_kernel(n: int, k: int, dtype: "torch.dtype") -> bool:
        if dtype == torch.int8 and not amx_fp16() and _model_is_float16():
            if not logged:
                logged.append(True)
                logger.info(INT8_MARK)
            return False
        return original(n, k, dtype)

    check_cpu_sgl_kernel._gemma4_t4 = True  # type: ignore[attr-defined]
    module.check_cpu_sgl_kernel = check_cpu_sgl_kernel


def _announce_use(module) -> None:
    """Logs FIRST_USE_MARK once, at weight creation (model loading, outside torch.compile)."""
    cls = getattr(module, "CompressedTensorsEmbeddingWNA16Int", None)
    if cls is None or getattr(cls.create_weights, "_gemma4_t4", False):
        return
    original = cls.create_weights
    announced = []

    def create_weights(self, layer, *args, **kwargs):
        if not announced:
            announced.append(True)
            logger.info(FIRST_USE_MARK)
        return original(self, layer, *args, **kwargs)

    create_weights._gemma4_t4 = True  # type: ignore[attr-defined]
    cls.create_weights = create_weights
