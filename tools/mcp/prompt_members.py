"""What the deploy prompts derive from a Gemma 4 member: the planner's verdict for one T4 and the vLLM flags it
serves with (repack/build/fit.py), and what is known of its fit on a CPU (deploy_cpu)."""

from __future__ import annotations

from typing import Any

from repack.build.fit import T4_MIB, plan_member

# The members whose builds this project has served on vLLM's CPU backend at their real shapes, and what they took:
# the fit of any other member on a CPU machine is not known.
CPU_MEASURED = {
    "E2B": ("E2B's builds have been served on vLLM's CPU backend at its real shapes (a synthetic source, "
            "evidence/real-shapes.md): "
            "7.8 GB of host memory after load for the all-4-bit build, 17.3 GB for the bf16-embedding one; compare "
            "them with this machine's free memory before start_vllm_server"),
    "E4B": ("E4B's all-4-bit build (4.26 GiB) was loaded by vLLM's CPU backend on a 2-core AVX2 machine (a synthetic "
            "source at E4B's shapes, evidence/real-shapes.md): 8.9 GB of host memory after load, at most 9.3 GB "
            "while it ran, ready in 179-197 s, and it decodes at 0.52 tok/s there on one shared core (the "
            "project's int4 matmul); its bf16-embedding build (8.58 GiB) did not fit that machine's 24 GB. Expect "
            "E4B to answer slowly on a small CPU, the tiny stand-in quickly"),
}

MEMBER_ARG = ("E2B", "The Gemma 4 member: E2B, E4B, 12B, 26B-A4B or 31B (plan_fit says which fit one T4)")


def _card_needed(m: Any) -> int:
    """The least GPU memory (MiB, at the T4's utilization) on which the planner fits one request of m's all-4-bit
    build: what a member that does not fit one T4 would need."""
    lo, hi = T4_MIB, 1 << 24
    while lo < hi:  # the planner's fit only grows with the memory
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if plan_member(m, memory_mib=mid).build("all-4-bit").fits else (mid + 1, hi)
    return lo


def member_values(m: Any) -> dict[str, Any]:
    """What a prompt derives from the member: the planner's verdict and vLLM's flags for one T4 (none where no
    build fits: `fits_t4` false, and the prompts that start a server on a T4 stop after plan_fit)."""
    plan = plan_member(m)
    f = plan.t4_flags
    four = plan.build("all-4-bit")
    out: dict[str, Any] = {"fits_t4": f is not None, "t4_warning": ""}
    if f is None:
        need = _card_needed(m)
        verdict = (f"the planner says {m.name} does not fit one T4 in any build: its smallest, the all-4-bit build, "
                   f"loads {four.load_gib:.2f} GiB of weights where vLLM may use {plan.card['budget_gib']:.2f} GiB "
                   f"of the T4's 15 GiB (planned on paper, not measured); one {plan.card['max_model_len']:,}-token "
                   f"request of it would need a GPU of about {need / 1024:.0f} GiB")
        out["fit"] = f"{verdict}: stop after plan_fit (its table says by how much)"
        out["plan_flags"] = "t4_flags null: no build fits, so the walk ends there"
        out["stop_note"] = (f"Stop here: {verdict}. No T4 flags exist for it, so nothing is fetched, built or "
                            f"served on a T4; a member that fits one T4 (plan_fit says which) takes this walk.")
        out["t4_warning"] = (f" Before anything else: {verdict}, so on a T4 do not take this walk; it serves only "
                             f"where both builds fit (a GPU with that memory; deploy_cpu says what is known of a "
                             f"CPU).")
    else:
        b = plan.build(f["build"])
        out["fit"] = (f"the planner puts {m.name}'s {b.build} build at {b.load_gib:.2f} GiB loaded and "
                      f"{b.kv_tokens:,} KV tokens on a T4; it serves with max_num_seqs {f['max_num_seqs']}")
        out |= {k: f[k] for k in ("gpu_memory_utilization", "max_model_len", "max_num_seqs")}
        out["plan_flags"] = "the flags the start below uses (t4_flags); stop when no build fits"
    out["cpu_fit"] = CPU_MEASURED.get(m.name) or (
        f"Whether {m.name} fits this machine is not known: no {m.name} build has been served on a CPU by this "
        f"project. Its all-4-bit build is {four.size_gib:.2f} GiB of weights (the planner), which vLLM's CPU backend "
        f"holds in host memory beside its KV cache (CPU_KVCACHE_SPACE_GIB) and more (E2B's 2.64 GiB build took "
        f"7.8 GB): compare with this machine's free memory before start_vllm_server")
    return out
