"""What the deploy prompts derive from a Gemma 4 member: the planner's verdict for one T4 and the vLLM flags it
serves with (repack/fit.py)."""

from __future__ import annotations

from typing import Any

from repack.fit import plan_member

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
    return {"fit": fit, "gpu_memory_utilization": f["gpu_memory_utilization"],
            "max_model_len": f["max_model_len"], "max_num_seqs": f["max_num_seqs"]}
