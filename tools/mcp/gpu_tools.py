"""GPU tools: memory through NVML, and the Turing (T4) attention clamp."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tools.core.errors import ToolFailure
from tools.core.params import OpParams
from tools.gpu import vram
from tools.gpu.vram import VramStatus
from tools.mcp.registry import Reply, tool
from tools.serving import turing_patch
from tools.serving.instances import process_owners
from tools.serving.turing_patch import PatchStatus


@tool(toolset="gpu", title="GPU memory (NVML)", result=VramStatus, read_only=True, idempotent=True)
def vram_status(app, p) -> Reply:
    """Per-GPU memory and utilization, with each vLLM instance's processes marked (`instance`); use it to see
    what a build takes on the GPU. Without an NVIDIA driver: available=false and the reason, not an error."""
    try:
        owners = process_owners(app.config())
    except ToolFailure:  # no serving config: VRAM is still worth reading
        owners = {}
    st = vram.vram_status(owners=owners)
    return Reply(st, st.summary_line())


class PatchParams(OpParams):
    action: Literal["check", "apply", "revert"] = Field(
        "check", description="check: read only; apply: patch vLLM's triton_unified_attention.py (backup kept); "
                             "revert: restore it")


@tool(toolset="gpu", title="Turing attention clamp", params=PatchParams, result=PatchStatus, destructive=True,
      idempotent=True)
def patch_turing(app, p: PatchParams) -> Reply:
    """Check, apply or revert the T4 (sm_75) shared-memory clamp in this environment's vLLM; start_vllm_server
    refuses on a Turing GPU until it is applied. Not needed on CPU or newer GPUs."""
    res = {"check": turing_patch.check, "apply": turing_patch.apply, "revert": turing_patch.revert}[p.action]()
    return Reply(res, res.message)


