"""vLLM's speculative-decoding figures: its /metrics counters, their deltas over a run (acceptance rate, mean
accepted length with the bonus token, acceptance per draft position), and the speculative config a server was
started with. The decode benchmark and the serving sweep both report them."""

from __future__ import annotations

import json
from typing import Any

import httpx
from pydantic import BaseModel, Field

from tools.core.errors import ToolFailure
from tools.core.metrics import samples, total
from tools.measure import evidence

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class SpecDecodeStats(BaseModel):
    drafts: float = Field(0.0, description="Delta of vllm:spec_decode_num_drafts_total over the run")
    draft_tokens: float = Field(0.0, description="Delta of vllm:spec_decode_num_draft_tokens_total")
    accepted_tokens: float = Field(0.0, description="Delta of vllm:spec_decode_num_accepted_tokens_total")
    acceptance_rate: float | None = Field(None, description="accepted_tokens / draft_tokens (none: no drafts)")
    mean_accepted_length: float | None = Field(None, description="1 + accepted_tokens / drafts: tokens per "
                                                                 "target step, bonus token included")
    per_position: list[float] = Field(default_factory=list, description="Acceptance per draft position: "
                                                                        "accepted at position k / drafts")


def parse_spec_counters(text: str) -> dict[str, Any]:
    """The speculative-decoding counters in a Prometheus text page, summed over engines and models:
    {name: value} for the three totals the page has and {"per_pos": {position: value}}."""
    found = samples(text, "vllm:spec_decode")
    out: dict[str, Any] = {name: v for name in SPEC_COUNTERS if (v := total(found, name)) is not None}
    per_pos: dict[int, float] = {}
    for s in found:
        if s.name == PER_POS and "position" in s.labels:
            pos = int(s.labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + s.value
    out["per_pos"] = per_pos
    return out


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> tuple[SpecDecodeStats, bool]:
    """Stats from two counter snapshots; the flag says whether the server exposes the counters at all."""
    found = any(k in after for k in SPEC_COUNTERS)
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    drafts, draft_tokens, accepted = (d[k] for k in SPEC_COUNTERS)
    positions = sorted(after.get("per_pos", {}))
    per_pos = [after["per_pos"][p] - before.get("per_pos", {}).get(p, 0.0) for p in positions]
    stats = SpecDecodeStats(drafts=drafts, draft_tokens=draft_tokens, accepted_tokens=accepted,
                            acceptance_rate=accepted / draft_tokens if draft_tokens else None,
                            mean_accepted_length=1 + accepted / drafts if drafts else None,
                            per_position=[v / drafts for v in per_pos] if drafts else [])
    return stats, found


def read_spec_counters(client: httpx.Client, base_url: str) -> dict[str, Any]:
    try:
        r = client.get(f"{base_url}/metrics", timeout=30)
        r.raise_for_status()
    except httpx.HTTPError as exc:
        raise ToolFailure(f"the server at {base_url} did not serve /metrics ({type(exc).__name__}): the "
                          f"acceptance figures need it", detail={"base_url": base_url}) from exc
    return parse_spec_counters(r.text)


def speculative_from_argv(argv: list[str] | None) -> dict[str, Any] | None:
    raw = evidence.argv_option(argv, "--speculative-config")
    if not raw:
        return None
    try:
        val = json.loads(raw)
    except ValueError:
        return {"unparsed": raw}
    return val if isinstance(val, dict) else {"value": val}
