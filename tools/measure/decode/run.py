"""The decode benchmark: single-stream time per output token, and what a speculative drafter adds to it.

Twenty shipped chat prompts (tools/measure/data/decode-prompts.json), one request at a time through the chat
API, streamed: per prompt the time to first token (TTFT), time per output token after it (TPOT), output tokens,
end-to-end time and the generated token ids. Around the run the server's `/metrics` are read twice; the deltas
of vLLM's speculative-decoding counters give the acceptance rate, the mean accepted length (bonus token
included, vLLM's convention) and the acceptance per draft position. The result goes to an evidence folder
(tools/measure/evidence.py). The counters are read in tools/measure/spec_metrics.py; drafter settings side by
side are tools/measure/decode/sweep.py's.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, Field, create_model

from tools.core.api_key import auth_headers
from tools.core.errors import BadInput, ToolFailure, param
from tools.core.names import check_name
from tools.measure import evidence, provenance as prov_mod
from tools.measure.decode.params import DecodeParams, checkpoint_sampling, request_errors
from tools.core.output_check import check_output_folder
from tools.core.progress import Progress
from tools.measure.roofline import SPECULATIVE_NOTE, Roofline, roofline_or_reason
from tools.measure.spec_metrics import read_spec_counters, spec_delta, speculative_from_argv
from tools.measure.endpoint import Endpoint, resolve_endpoint
from tools.serving.config import ServeConfig

PROMPTS_FILE = Path(__file__).resolve().parents[1] / "data" / "decode-prompts.json"


# --------------------------------------------------------------------------------------------------------------
# Results


class PromptRecord(BaseModel):
    id: str = Field(description="The prompt's id in the shipped set")
    kind: str = Field(description="code, prose, list, translation, short or long")
    ttft_ms: float = Field(description="Time to the first streamed token")
    tpot_ms: float | None = Field(description="(end-to-end - TTFT) / (output tokens - 1); none for one token")
    e2e_ms: float = Field(description="Request sent to last chunk received")
    output_tokens: int = Field(description="Generated tokens (the server's usage count)")
    prompt_tokens: int | None = Field(None, description="Prompt tokens (the server's usage count)")
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list, description="Generated token ids, in order")
    text: str = Field("", description="Generated text")


class DecodeResult(BaseModel):
    run_id: str
    run_dir: str = Field(description="The evidence folder")
    label: str
    model: str | None = None
    sampling: Literal["greedy", "checkpoint"]
    sampling_params: dict[str, Any] = Field(description="What each request sent: temperature, top_k, top_p")
    speculative_config: dict[str, Any] | None = Field(None, description="The server's --speculative-config, "
                                                                        "when known")
    max_tokens: int
    prompts: list[PromptRecord] = Field(default_factory=list)
    median_ttft_ms: float | None = None
    median_tpot_ms: float | None = Field(None, description="Median over prompts of the time per output token")
    decode_tok_s: float | None = Field(None, description="Output tokens after the first / their decode time, "
                                                         "summed over prompts")
    mean_output_tokens: float | None = None
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    per_position_acceptance: list[float] = Field(default_factory=list)
    spec_metrics_found: bool = Field(False, description="Whether /metrics had the speculative counters at all")
    roofline: Roofline | None = Field(None, description="decode_tok_s as a share of the memory-bandwidth roofline "
                                                        "(tools/measure/roofline.py), with its method")
    roofline_note: str | None = Field(None, description="Why there is no roofline figure, when there is none")
    wall_s: float | None = None
    files: dict[str, str] = Field(default_factory=dict)


# The MCP reply: the result without the per-prompt records (token ids and texts stay in the run folder).
DecodeSummary = create_model("DecodeSummary", __doc__="A decode run without its per-prompt records.",
                             **{n: (f.annotation, f) for n, f in DecodeResult.model_fields.items() if n != "prompts"})


# --------------------------------------------------------------------------------------------------------------
# Prompts and sampling


def load_prompts(n: int = 20, path: Path = PROMPTS_FILE) -> list[dict[str, str]]:
    items = json.loads(Path(path).read_text())
    return items[:n]


def sampling_params(params: DecodeParams, model_root: str | None) -> dict[str, Any]:
    # Explicit for greedy too: vLLM applies the checkpoint's generation_config as the request default.
    if params.sampling == "greedy":
        return {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
    path = params.generation_config
    if path is None:
        if not model_root or not Path(model_root).is_dir():
            raise BadInput(f"the served model {model_root!r} is not a local folder: pass {param('generation_config')} "
                           f"PATH for {param('sampling', 'checkpoint')}", detail={"model_root": model_root},
                           field="generation_config")
        path = str(Path(model_root) / "generation_config.json")
    return checkpoint_sampling(path)


# --------------------------------------------------------------------------------------------------------------
# One request


def stream_chat(client: httpx.Client, base_url: str, model: str, prompt: str, *, max_tokens: int,
                sampling: dict[str, Any], seed: int | None, timeout: float) -> dict[str, Any]:
    """One streamed chat request; returns ttft/e2e (ms), token ids, text, usage tokens, finish reason."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True, **sampling}
    if seed is not None and sampling.get("temperature", 0) > 0:
        body["seed"] = seed
    ids: list[int] = []
    text: list[str] = []
    ttft = None
    usage_tokens = None
    prompt_tokens = None
    finish = None
    t0 = time.perf_counter()
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            raise ToolFailure(f"the server at {base_url} answered {r.status_code} to a chat request: "
                              f"{r.text[:300]}", detail={"status": r.status_code})
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if chunk.get("usage"):
                usage_tokens = chunk["usage"].get("completion_tokens")
                prompt_tokens = chunk["usage"].get("prompt_tokens")
            for ch in chunk.get("choices") or []:
                new = ch.get("token_ids") or []
                content = (ch.get("delta") or {}).get("content") or ""
                if (new or content) and ttft is None:
                    ttft = time.perf_counter() - t0
                ids.extend(int(t) for t in new)
                text.append(content)
                finish = ch.get("finish_reason") or finish
    e2e = time.perf_counter() - t0
    n = int(usage_tokens) if usage_tokens is not None else len(ids)
    ttft = e2e if ttft is None else ttft
    return {"ttft_ms": ttft * 1e3, "e2e_ms": e2e * 1e3, "output_tokens": n, "token_ids": ids,
            "text": "".join(text), "finish_reason": finish, "prompt_tokens": prompt_tokens}


# --------------------------------------------------------------------------------------------------------------
# The run


def summarize(records: list[PromptRecord]) -> dict[str, float | None]:
    tpots = [r.tpot_ms for r in records if r.tpot_ms is not None]
    dec_tokens = sum(r.output_tokens - 1 for r in records if r.output_tokens > 1)
    dec_ms = sum(r.e2e_ms - r.ttft_ms for r in records if r.output_tokens > 1)
    return {"median_ttft_ms": statistics.median(r.ttft_ms for r in records) if records else None,
            "median_tpot_ms": statistics.median(tpots) if tpots else None,
            "decode_tok_s": dec_tokens / (dec_ms / 1e3) if dec_ms > 0 else None,
            "mean_output_tokens": statistics.fmean(r.output_tokens for r in records) if records else None}


def run_decode(params: DecodeParams | None = None, *, progress: Progress | None = None,
               serve_config: ServeConfig | None = None, server_argv: list[str] | None = None,
               extra_provenance: dict[str, Any] | None = None, endpoint: Endpoint | None = None,
               **overrides: Any) -> DecodeResult:
    """Run the decode benchmark against a live server and save its evidence folder.

    serve_config names the server tools/ started (default: tpu.env's): the default base_url and its argv for the
    provenance; server_argv is given by a caller that started the server itself; endpoint, by a caller that
    resolved it already (the MCP tool, once per call).
    """
    params = DecodeParams(**{**(params or DecodeParams()).model_dump(), **overrides})
    check_name(params.label)
    check_output_folder(params.out)  # before any request: the run would end unwritten
    if params.sampling == "checkpoint" and params.generation_config:  # a bad file before any request
        checkpoint_sampling(params.generation_config)
    endpoint = endpoint or resolve_endpoint(params, serve_config)
    base_url = endpoint.base_url
    if endpoint.config is not None:  # the server measured: its start record goes into the provenance
        serve_config = endpoint.config
    server, model = prov_mod.served_model(base_url, params.model)
    sampling = sampling_params(params, server.model_root)
    prompts = load_prompts(params.prompts)

    run = evidence.EvidenceRun.create(params.out, evidence.run_id("decode", params.label))
    t0 = time.monotonic()
    try:
        spec = _write_provenance(run, params, base_url, sampling, serve_config=serve_config,
                                 server_argv=server_argv, extra_provenance=extra_provenance)
        records, (before, after) = _measure(run, params, base_url, model, prompts, sampling, progress)
        stats, found = spec_delta(before, after)
        res = DecodeResult(run_id=run.name, run_dir=str(run.path), label=params.label, model=model,
                           sampling=params.sampling, sampling_params=sampling, speculative_config=spec,
                           max_tokens=params.max_tokens, prompts=records, **summarize(records),
                           drafts=stats.drafts, draft_tokens=stats.draft_tokens,
                           accepted_tokens=stats.accepted_tokens, acceptance_rate=stats.acceptance_rate,
                           mean_accepted_length=stats.mean_accepted_length,
                           per_position_acceptance=stats.per_position, spec_metrics_found=found,
                           wall_s=time.monotonic() - t0)
        res.roofline, res.roofline_note = decode_roofline(res, server.model_root)
        res.files = run.write_summary(res, markdown_run(res))
        res.files["provenance"] = str(run.path / "provenance.json")
        run.finish()
    except BaseException:
        run.abandon()
        raise
    return res


def _write_provenance(run: evidence.EvidenceRun, params: DecodeParams, base_url: str, sampling: dict[str, Any], *,
                      serve_config: ServeConfig | None, server_argv: list[str] | None,
                      extra_provenance: dict[str, Any] | None) -> dict[str, Any] | None:
    """Writes the run's provenance.json (the server's, the drafter's and the run's settings); returns the
    server's speculative config."""
    prov = evidence.collect_provenance(base_url, serve_config=serve_config, server_argv=server_argv).to_dict()
    spec = speculative_from_argv(prov.get("server_argv"))
    extra = dict(extra_provenance or {})
    extra.setdefault("speculative_config", spec)
    drafter = (spec or {}).get("model")
    if drafter and Path(drafter).is_dir():
        extra.setdefault("drafter_config_sha256", prov_mod.config_sha256(drafter))
    start = prov.get("server_start_fields") or {}
    extra.setdefault("server_startup_s", start.get("startup_s"))
    extra.setdefault("decode_params", params.model_dump(mode="json"))
    extra.setdefault("sampling_params", sampling)
    evidence.write_json(run.dir / "provenance.json", {**prov, **extra})
    return spec


def _measure(run: evidence.EvidenceRun, params: DecodeParams, base_url: str, model: str,
             prompts: list[dict[str, str]], sampling: dict[str, Any], progress: Progress | None
             ) -> tuple[list[PromptRecord], tuple[dict[str, Any], dict[str, Any]]]:
    """The prompts one at a time, each record saved as it ends; with the counters read before and after."""
    records: list[PromptRecord] = []
    with httpx.Client(headers=auth_headers()) as client, request_errors(base_url, params.request_timeout_s):
        # One untimed request first: the first request after a start pays one-off costs.
        stream_chat(client, base_url, model, "Hello.", max_tokens=8, sampling=sampling, seed=params.seed,
                    timeout=params.request_timeout_s)
        before = read_spec_counters(client, base_url)
        for i, p in enumerate(prompts):
            if progress is not None:
                progress(i, len(prompts), f"prompt {p['id']}")
            r = stream_chat(client, base_url, model, p["prompt"], max_tokens=params.max_tokens,
                            sampling=sampling, seed=params.seed + i, timeout=params.request_timeout_s)
            n = r["output_tokens"]
            rec = PromptRecord(id=p["id"], kind=p.get("kind", ""), ttft_ms=r["ttft_ms"], e2e_ms=r["e2e_ms"],
                               tpot_ms=(r["e2e_ms"] - r["ttft_ms"]) / (n - 1) if n > 1 else None,
                               output_tokens=n, prompt_tokens=r.get("prompt_tokens"),
                               finish_reason=r["finish_reason"], token_ids=r["token_ids"],
                               text=r["text"])
            records.append(rec)
            run.write_raw(f"{i:02d}-{p['id']}", {"prompt": p, "sampling_params": sampling,
                                                 "record": rec.model_dump(mode="json")})
        after = read_spec_counters(client, base_url)
    if progress is not None:
        progress(len(prompts), len(prompts), "done")
    return records, (before, after)


def mean_context_tokens(records: list[PromptRecord]) -> int:
    """The mean context over the decode steps of the run: each prompt plus half its output."""
    if not records:
        return 0
    return round(statistics.fmean((r.prompt_tokens or 0) + r.output_tokens / 2 for r in records))


def decode_roofline(res: DecodeResult, model_root: str | None) -> tuple[Roofline | None, str | None]:
    """The run's decode rate as a share of the roofline of the served build, or why there is none."""
    if res.speculative_config:
        return None, SPECULATIVE_NOTE
    if not res.decode_tok_s:
        return None, "no decode rate measured"
    return roofline_or_reason(res.decode_tok_s, model_root, mean_context_tokens(res.prompts))


def roofline_line(res: DecodeResult) -> str:
    if res.roofline is not None:
        return "Decode tok/s as a share of the roofline: " + res.roofline.line()
    return f"Roofline: none ({res.roofline_note or 'not computed'})"


def fmt(v: float | None, spec: str = ".2f", none: str = "—") -> str:
    return none if v is None else format(v, spec)


def markdown_run(res: DecodeResult) -> str:
    lines = [f"# Decode benchmark {res.run_id}", "",
             f"{res.label}: {len(res.prompts)} prompts, one at a time, max {res.max_tokens} tokens, sampling "
             f"{res.sampling} {json.dumps(res.sampling_params)}; speculative config "
             f"{json.dumps(res.speculative_config) if res.speculative_config else 'none'}", "",
             "| median TTFT ms | median TPOT ms | decode tok/s | mean tokens | acceptance | mean accepted length |",
             "|---:|---:|---:|---:|---:|---:|",
             f"| {fmt(res.median_ttft_ms, '.1f')} | {fmt(res.median_tpot_ms)} | {fmt(res.decode_tok_s, '.1f')} "
             f"| {fmt(res.mean_output_tokens, '.1f')} | {pct(res.acceptance_rate)} "
             f"| {fmt(res.mean_accepted_length)} |", "", roofline_line(res), ""]
    if res.per_position_acceptance:
        lines += ["Acceptance per draft position: "
                  + ", ".join(f"{k}: {pct(v)}" for k, v in enumerate(res.per_position_acceptance)), ""]
    lines += ["| prompt | kind | TTFT ms | TPOT ms | tokens | e2e ms | finish |", "|---|---|---:|---:|---:|---:|---|"]
    for p in res.prompts:
        lines.append(f"| {p.id} | {p.kind} | {p.ttft_ms:.1f} | {fmt(p.tpot_ms)} | {p.output_tokens} "
                     f"| {p.e2e_ms:.0f} | {p.finish_reason or ''} |")
    return "\n".join(lines) + "\n"


def pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


