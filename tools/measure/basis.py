"""What a run's figures stand for: the model (a family member, or the tiny stand-in shaped as one), the machine
(a GPU, or the CPU stand-in and its CPU) and the vLLM version, read from the run's provenance; where two runs
differ in any of them, and where a member has no T4 measurement at all. A ratio between runs that differ compares
machines or models, not builds: compare_sweeps says so in its first line and in every ratio it gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from repack.family.members import MEMBERS, identify_or_none
from repack.stand_ins.tiny_model import shape_of
from repack.stand_ins.tiny_shapes import MEMBER_OF
from tools.measure.provenance import cost_basis, measured_on

# The members measured on a T4 (the only T4 figures this project holds or can reach).
T4_EVIDENCE: dict[str, str] = {"E2B": "the article's, vLLM 0.29.0, evidence/article-t4"}
_MEMBER_IN_NAME = re.compile(r"gemma-4-(" + "|".join(re.escape(m) for m in MEMBERS) + r")(?![0-9A-Za-z])",
                             re.IGNORECASE)


@dataclass(frozen=True)
class Basis:
    model: str            # "E4B", "the tiny stand-in shaped as E4B", "a tiny stand-in", or the served name
    member: str | None    # the member the model is or stands in for; None where unknown
    known: bool           # the model was recognised (a member or a stand-in), not only named
    machine: str          # "Tesla T4", "CPU (<CPU model>)": vLLM's CPU backend
    platform: str         # cuda or cpu
    vllm: str | None
    cores: int | None = None  # on a CPU, how many cores its server had; None: unknown


def _config(prov: dict[str, Any]) -> dict[str, Any] | None:
    server = prov.get("server") or {}
    argv = prov.get("server_argv") or []
    places = [prov.get("checkpoint_config_path"), server.get("model_root") and f"{server['model_root']}/config.json",
              "--model" in argv[:-1] and f"{argv[argv.index('--model') + 1]}/config.json"]
    for place in filter(None, places):
        try:
            return json.loads(Path(place).read_text())
        except (OSError, ValueError):
            continue
    return None


def basis(prov: dict[str, Any] | None, model_name: str | None = None) -> Basis:
    """A run's basis from its provenance (and the model name it recorded)."""
    prov = prov or {}
    platform, _ = measured_on(prov)
    machine = prov.get("gpu_name") if platform == "cuda" else f"CPU ({prov.get('cpu_model') or 'model unknown'})"
    vllm = prov.get("vllm_version_server") or prov.get("vllm_version_client")
    b = _basis(prov, model_name, platform, str(machine), vllm)
    cores = prov.get("server_cpu_cores")
    return replace(b, cores=len(cores) if platform == "cpu" and isinstance(cores, list) and cores else None)


def _basis(prov: dict[str, Any], model_name: str | None, platform: str, machine: str, vllm: str | None) -> Basis:
    cfg = _config(prov)
    server = prov.get("server") or {}
    named = model_name or server.get("model_id") or server.get("model_root") or "an unnamed model"
    if cfg is not None:
        member = identify_or_none(cfg)
        if member is not None:
            return Basis(member.name, member.name, True, str(machine), platform, vllm)
        shape = shape_of(cfg)
        if shape is not None:
            return Basis(f"the tiny stand-in shaped as {MEMBER_OF[shape]}", MEMBER_OF[shape], True, str(machine),
                         platform, vllm)
        return Basis(f"a stand-in ({named})", None, True, str(machine), platform, vllm)
    m = _MEMBER_IN_NAME.search(" ".join(str(x) for x in (named, server.get("model_root"), *(prov.get("server_argv")
                                                                                            or [])) if x))
    if m:
        name = next(k for k in MEMBERS if k.lower() == m.group(1).lower())
        return Basis(name, name, True, str(machine), platform, vllm)
    return Basis(named, None, False, str(machine), platform, vllm)


def differences(a: Basis, b: Basis) -> list[tuple[str, str]]:
    """What differs between two runs' bases: (what, "a vs b") for models, platforms, vLLM versions and, on one
    CPU, how many cores the servers had (where both runs recorded it); models only where both were recognised (two
    builds of one member are the comparison's point)."""
    out = []
    if a.known and b.known and a.model != b.model:
        out.append(("models", f"{a.model} vs {b.model}"))
    if a.machine != b.machine:
        out.append(("platforms", f"{a.machine} vs {b.machine}"))
    if a.vllm and b.vllm and a.vllm != b.vllm:
        out.append(("vLLM versions", f"{a.vllm} vs {b.vllm}"))
    if a.machine == b.machine and a.cores and b.cores and a.cores != b.cores:
        out.append(("CPU cores", f"{a.cores} vs {b.cores}"))
    return out


def no_t4_measurement(b: Basis) -> str | None:
    """For figures not measured on a T4, of a member with no T4 measurement at all: says so and what stands in."""
    if b.platform == "cuda" or b.member is None or b.member in T4_EVIDENCE:
        return None
    return (f"no T4 measurement of {b.member} exists (the T4 figures are {', '.join(T4_EVIDENCE)}'s only, "
            f"{', '.join(T4_EVIDENCE.values())}): used instead, {b.model} on {b.machine}")


def priced_on(prov: dict[str, Any] | None, model_name: str | None, price_per_hour: float, price_given: bool) -> str:
    """How a run's cost figures were priced (provenance.cost_basis), and where its member has no T4 measurement,
    that the figures priced are what stands in for one."""
    return priced_basis(basis(prov, model_name), price_per_hour, price_given)


def priced_basis(b: Basis, price_per_hour: float, price_given: bool) -> str:
    """priced_on for a basis already read."""
    note = no_t4_measurement(b)
    return cost_basis(b.platform, price_per_hour, price_given) + (f"; {note}" if note else "")
