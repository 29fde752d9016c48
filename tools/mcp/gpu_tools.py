"""Memory and GPU tools: what each running build takes (NVML on a GPU, the host's memory on every platform), and
the Turing (T4) attention clamp."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tools.core.errors import ToolFailure
from tools.core.params import OpParams
from tools.gpu import vram
from tools.gpu.vram import VramStatus
from tools.mcp.registry import Reply, tool
from tools.serving import PatchStatus, process_owners, running, turing_patch


@tool(toolset="deploy", title="Memory of the running builds", result=VramStatus, read_only=True,
      idempotent=True, ops="vram")
def vram_status(app, p) -> Reply:
    """Memory each running build takes: per GPU (NVML), and each instance's host memory beside its weights on
    disk."""
    try:
        cfg = app.config()
        owners, servers = process_owners(cfg), running(cfg)
    except ToolFailure:  # no serving config: the GPUs are still worth reading
        owners, servers = {}, {}
    st = vram.vram_status(owners=owners)
    st.host = [vram.host_memory(name, {pid for pid, owner in owners.items() if owner == name} | {s.pid}, s.model)
               for name, s in servers.items()]
    return Reply(st, st.summary_line())


class PatchParams(OpParams):
    action: Literal["check", "apply", "revert"] = Field(
        "check", description="check: read only; apply: patch vLLM's triton_unified_attention.py (backup kept); "
                             "revert: restore it")


@tool(toolset="gpu", title="Turing attention clamp", params=PatchParams, result=PatchStatus, destructive=True,
      idempotent=True, ops="patch_turing")
def patch_turing(app, p: PatchParams) -> Reply:
    """Check, apply or revert the T4 (sm_75) attention clamp in this vLLM: start_vllm_server refuses on a T4
    until it is applied. Not needed on CPU or newer GPUs."""
    res = {"check": turing_patch.check, "apply": turing_patch.apply, "revert": turing_patch.revert}[p.action]()
    return Reply(res, res.message)
