"""What the deploy prompts derive from a Gemma 4 member: the planner's verdict for one T4 and the vLLM flags it
serves with (repack/fit.py), and what is known of its fit on a CPU (deploy_cpu)."""

from __future__ import annotations

from typing import Any

from repack.fit import plan_member

# The members whose builds this project has served on vLLM's CPU backend at their real shapes, and what they took:
# the fit of any other member on a CPU machine is not known.
CPU_MEASURED = {
    "E2B": ("E2B's builds have been served on vLLM's CPU backend at its real shapes (a synthetic source, "
            "evidence/real-shapes.md): "
            "7.8 GB of host memory after load for the all-4-bit build, 17.3 GB for the bf16-embedding one; compare "
            "them with this machine's free memory before start_vllm_server"),
}

MEMBER_ARG = ("E2B", "The Gemma 4 member: E2B, E4B, 12B, 26B-A4B or 31B (plan_fit says which fit one T4)")


def member_values(m: Any) -> dict[str, Any]:
    """What a prompt derives from the member: the planner's verdict and vLLM's flags for one T4."""
    plan = plan_member(m)
    f = plan.t4_flags
    if f is None:
        fit = (f"the planner says {m.name} does not fit one T4 in any build: stop after plan_fit (its table says "
               f"by how much)")
        f = {"gpu_memory_utilization": 0.9, "max_model_len": 16384, "max_num_seqs": 1}
    else:
        b = plan.build(f["build"])
        fit = (f"the planner puts {m.name}'s {b.build} build at {b.load_gib:.2f} GiB loaded and {b.kv_tokens:,} KV "
               f"tokens on a T4; it serves with max_num_seqs {f['max_num_seqs']}")
    four = plan.build("all-4-bit")
    cpu_fit = CPU_MEASURED.get(m.name) or (
        f"Whether {m.name} fits this machine is not known: no {m.name} build has been served on a CPU by this "
        f"project. Its all-4-bit build is {four.size_gib:.2f} GiB of weights (the planner), which vLLM's CPU backend "
        f"holds in host memory beside its KV cache (CPU_KVCACHE_SPACE_GIB) and more (E2B's 2.64 GiB build took "
        f"7.8 GB): compare with this machine's free memory before start_vllm_server")
    return {"fit": fit, "cpu_fit": cpu_fit, "gpu_memory_utilization": f["gpu_memory_utilization"],
            "max_model_len": f["max_model_len"], "max_num_seqs": f["max_num_seqs"]}
