"""The decode benchmark: single-stream time per output token, and what a speculative drafter adds to it.

Twenty shipped chat prompts (tools/measure/data/decode-prompts.json), one request at a time through the chat
API, streamed: per prompt the time to first token (TTFT), time per output token after it (TPOT), output tokens,
end-to-end time and the generated token ids. Around the run the server's `/metrics` are read twice; the deltas
of vLLM's speculative-decoding counters give the acceptance rate, the mean accepted length (bonus token
included, vLLM's convention) and the acceptance per draft position. The result goes to an evidence folder
(tools/measure/evidence.py).

`decode-sweep` restarts the server once per drafter setting (0 = no drafter) and sampling, runs the benchmark
and writes the article's table: time per token, drafts accepted, speedup against no drafter, and which greedy
answers differ from the no-drafter answers (speculative decoding must not change greedy output).
"""

from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

import httpx
from pydantic import BaseModel, Field, create_model

from tools.core.errors import ToolFailure
from tools.measure import evidence
from tools.measure.results import DEFAULT_OUT
from tools.core.params import OpParams
from tools.serving.endpoint import EndpointParams
from tools.core.errors import BadInput
from tools.serving.speculative import parse_speculative_config, validate_speculative_config

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "decode-prompts.json"
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

Progress = Callable[[int, int, str], None]


# --------------------------------------------------------------------------------------------------------------
# Parameters and results


class _DecodeRequests(OpParams):
    """What every decode run sends: the shipped prompts, the output length, the seeds."""

    prompts: int = Field(20, ge=1, le=20, description="How many of the twenty shipped prompts to send")
    max_tokens: int = Field(256, ge=2, description="Output tokens per request at most")
    seed: int = Field(0, description="Sampling seed of prompt i is seed + i (checkpoint sampling)")
    request_timeout_s: float = Field(600.0, description="Seconds per request before the run fails")


class DecodeParams(_DecodeRequests, EndpointParams):
    """Options of one decode benchmark: `./vllm-t4 decode` flags and the run_decode_bench MCP arguments."""

    CLI_BAD_INPUT: ClassVar[type[Exception] | None] = BadInput
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"model", "request_timeout_s", "generation_config"})
    MCP_DEFAULTS: ClassVar[dict[str, Any]] = {"out": "."}

    sampling: Literal["greedy", "checkpoint"] = Field(
        "greedy", description="greedy (temperature 0) or the checkpoint's generation_config.json (temperature, "
                              "top_k, top_p)")
    label: str = Field("decode", description="Name of this setting for tables and the run id (no spaces)")
    out: Path = Field(DEFAULT_OUT, description="Folder that receives the run folder (through MCP: under an "
                                               "evidence root, default the first)")
    generation_config: str | None = Field(None, description="generation_config.json to read for --sampling "
                                                            "checkpoint (default: the served model folder's)")
    model: str | None = Field(None, description="Served model name; default: the first of /v1/models")


class PromptRecord(BaseModel):
    id: str = Field(description="The prompt's id in the shipped set")
    kind: str = Field(description="code, prose, list, translation, short or long")
    ttft_ms: float = Field(description="Time to the first streamed token")
    tpot_ms: float | None = Field(description="(end-to-end - TTFT) / (output tokens - 1); none for one token")
    e2e_ms: float = Field(description="Request sent to last chunk received")
    output_tokens: int = Field(description="Generated tokens (the server's usage count)")
    finish_reason: str | None = None
    token_ids: list[int] = Field(default_factory=list, description="Generated token ids, in order")
    text: str = Field("", description="Generated text")


class SpecDecodeStats(BaseModel):
    drafts: float = Field(0.0, description="Delta of vllm:spec_decode_num_drafts_total over the run")
    draft_tokens: float = Field(0.0, description="Delta of vllm:spec_decode_num_draft_tokens_total")
    accepted_tokens: float = Field(0.0, description="Delta of vllm:spec_decode_num_accepted_tokens_total")
    acceptance_rate: float | None = Field(None, description="accepted_tokens / draft_tokens (none: no drafts)")
    mean_accepted_length: float | None = Field(None, description="1 + accepted_tokens / drafts: tokens per "
                                                                 "target step, bonus token included")
    per_position: list[float] = Field(default_factory=list, description="Acceptance per draft position: "
                                                                        "accepted at position k / drafts")


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
    wall_s: float | None = None
    files: dict[str, str] = Field(default_factory=dict)


# The MCP reply: the result without the per-prompt records (token ids and texts stay in the run folder).
DecodeSummary = create_model("DecodeSummary", __doc__="A decode run without its per-prompt records.",
                             **{n: (f.annotation, f) for n, f in DecodeResult.model_fields.items() if n != "prompts"})


# --------------------------------------------------------------------------------------------------------------
# /metrics


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_spec_counters(text: str) -> dict[str, Any]:
    """The speculative-decoding counters in a Prometheus text page, summed over engines and models:
    {name: value} for the three totals and {"per_pos": {position: value}}."""
    out: dict[str, Any] = {"per_pos": {}}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))
        if name in SPEC_COUNTERS:
            out[name] = out.get(name, 0.0) + value
        elif name == PER_POS and "position" in labels:
            pos = int(labels["position"])
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
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


# --------------------------------------------------------------------------------------------------------------
# Prompts and sampling


def load_prompts(n: int = 20, path: Path = PROMPTS_FILE) -> list[dict[str, str]]:
    items = json.loads(Path(path).read_text())
    return items[:n]


def checkpoint_sampling(path: str | Path) -> dict[str, Any]:
    """temperature, top_k, top_p from a generation_config.json (the fields it has; temperature defaults to 1.0,
    the transformers default)."""
    p = Path(path)
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise BadInput(f"{p}: no generation_config.json for --sampling checkpoint; pass --generation-config "
                          f"PATH or use --sampling greedy", detail={"path": str(p)}) from None
    except ValueError as exc:
        raise BadInput(f"{p}: not JSON ({exc}); fix the file or pass --generation-config PATH",
                          detail={"path": str(p)}) from None
    out: dict[str, Any] = {"temperature": float(cfg.get("temperature", 1.0))}
    if cfg.get("top_k") is not None:
        out["top_k"] = int(cfg["top_k"])
    if cfg.get("top_p") is not None:
        out["top_p"] = float(cfg["top_p"])
    return out


def sampling_params(params: DecodeParams, model_root: str | None) -> dict[str, Any]:
    # Explicit for greedy too: vLLM applies the checkpoint's generation_config as the request default.
    if params.sampling == "greedy":
        return {"temperature": 0.0, "top_p": 1.0, "top_k": -1}
    path = params.generation_config
    if path is None:
        if not model_root or not Path(model_root).is_dir():
            raise BadInput(f"the served model {model_root!r} is not a local folder: pass --generation-config "
                              f"PATH for --sampling checkpoint", detail={"model_root": model_root})
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
            "text": "".join(text), "finish_reason": finish}


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


def speculative_from_argv(argv: list[str] | None) -> dict[str, Any] | None:
    raw = evidence.argv_option(argv, "--speculative-config")
    if not raw:
        return None
    try:
        val = json.loads(raw)
    except ValueError:
        return {"unparsed": raw}
    return val if isinstance(val, dict) else {"value": val}


def run_decode(params: DecodeParams | None = None, *, progress: Progress | None = None, serve_config: Any = None,
               server_argv: list[str] | None = None, extra_provenance: dict[str, Any] | None = None,
               **overrides: Any) -> DecodeResult:
    """Run the decode benchmark against a live server and save its evidence folder.

    serve_config names the server tools/ started (default: tpu.env's): the default base_url and its argv for the
    provenance; server_argv is given by a caller that started the server itself.
    """
    from tools.measure import provenance as prov_mod

    params = DecodeParams(**{**(params or DecodeParams()).model_dump(), **overrides})
    _check_label(params.label)
    from tools.serving.endpoint import resolve_endpoint

    endpoint = resolve_endpoint(params, serve_config)
    base_url = endpoint.base_url
    if endpoint.config is not None:  # the server measured: its start record goes into the provenance
        serve_config = endpoint.config
    try:
        server = prov_mod.server_info(base_url)
    except (httpx.HTTPError, ValueError) as exc:
        raise ToolFailure(f"no vLLM server answers at {base_url} ({type(exc).__name__}); start one with "
                          f"./vllm-t4 start or pass --base-url", detail={"base_url": base_url}) from exc
    model = params.model or server.model_id
    if not model:
        raise ToolFailure(f"the server at {base_url} lists no model in /v1/models; pass --model")
    sampling = sampling_params(params, server.model_root)
    prompts = load_prompts(params.prompts)

    run = evidence.EvidenceRun.create(params.out, evidence.run_id(params.label, "decode"))
    t0 = time.monotonic()
    try:
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

        records: list[PromptRecord] = []
        with httpx.Client() as client:
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
                                   output_tokens=n, finish_reason=r["finish_reason"], token_ids=r["token_ids"],
                                   text=r["text"])
                records.append(rec)
                run.write_raw(f"{i:02d}-{p['id']}", {"prompt": p, "sampling_params": sampling,
                                                     "record": rec.model_dump(mode="json")})
            after = read_spec_counters(client, base_url)
        if progress is not None:
            progress(len(prompts), len(prompts), "done")
        stats, found = spec_delta(before, after)
        res = DecodeResult(run_id=run.name, run_dir=str(run.path), label=params.label, model=model,
                           sampling=params.sampling, sampling_params=sampling, speculative_config=spec,
                           max_tokens=params.max_tokens, prompts=records, **summarize(records),
                           drafts=stats.drafts, draft_tokens=stats.draft_tokens,
                           accepted_tokens=stats.accepted_tokens, acceptance_rate=stats.acceptance_rate,
                           mean_accepted_length=stats.mean_accepted_length,
                           per_position_acceptance=stats.per_position, spec_metrics_found=found,
                           wall_s=time.monotonic() - t0)
        res.files = run.write_summary(res, markdown_run(res))
        res.files["provenance"] = str(run.path / "provenance.json")
        run.finish()
    except BaseException:
        run.abandon()
        raise
    return res


def _check_label(label: str) -> None:
    try:
        evidence.check_name(label, "label")
    except ToolFailure as exc:
        raise BadInput(str(exc), exc.detail) from None


def _fmt(v: float | None, spec: str = ".2f", none: str = "—") -> str:
    return none if v is None else format(v, spec)


def markdown_run(res: DecodeResult) -> str:
    lines = [f"# Decode benchmark {res.run_id}", "",
             f"{res.label}: {len(res.prompts)} prompts, one at a time, max {res.max_tokens} tokens, sampling "
             f"{res.sampling} {json.dumps(res.sampling_params)}; speculative config "
             f"{json.dumps(res.speculative_config) if res.speculative_config else 'none'}", "",
             "| median TTFT ms | median TPOT ms | decode tok/s | mean tokens | acceptance | mean accepted length |",
             "|---:|---:|---:|---:|---:|---:|",
             f"| {_fmt(res.median_ttft_ms, '.1f')} | {_fmt(res.median_tpot_ms)} | {_fmt(res.decode_tok_s, '.1f')} "
             f"| {_fmt(res.mean_output_tokens, '.1f')} | {_pct(res.acceptance_rate)} "
             f"| {_fmt(res.mean_accepted_length)} |", ""]
    if res.per_position_acceptance:
        lines += ["Acceptance per draft position: "
                  + ", ".join(f"{k}: {_pct(v)}" for k, v in enumerate(res.per_position_acceptance)), ""]
    lines += ["| prompt | kind | TTFT ms | TPOT ms | tokens | e2e ms | finish |", "|---|---|---:|---:|---:|---:|---|"]
    for p in res.prompts:
        lines.append(f"| {p.id} | {p.kind} | {p.ttft_ms:.1f} | {_fmt(p.tpot_ms)} | {p.output_tokens} "
                     f"| {p.e2e_ms:.0f} | {p.finish_reason or ''} |")
    return "\n".join(lines) + "\n"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


# --------------------------------------------------------------------------------------------------------------
# Settings side by side: decode-sweep and decode-compare


class DecodeSweepParams(_DecodeRequests):
    """Options of `./vllm-t4 decode-sweep`: one server start per drafter setting, the decode benchmark per
    sampling, the article's table."""

    CLI_BAD_INPUT: ClassVar[type[Exception] | None] = BadInput
    CLI_COMMA: ClassVar[frozenset[str]] = frozenset({"sampling"})
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"env_file", "request_timeout_s"})

    draft_tokens: list[int] = Field(default_factory=lambda: [0, 2, 3, 4, 6],
                                    description="num_speculative_tokens per setting; 0 = no drafter")
    sampling: list[Literal["greedy", "checkpoint"]] = Field(default_factory=lambda: ["greedy"], min_length=1,
                                                            description="Samplings to run at each setting: "
                                                                        "greedy, checkpoint")
    drafter: str | None = Field(None, description="Drafter folder or hub id (default: the model of tpu.env's "
                                                  "SPECULATIVE_CONFIG)")
    method: str | None = Field(None, description="Speculative method instead of a drafter model, e.g. ngram")
    label: str = Field("decode-sweep", description="Name of the sweep folder (no spaces)")
    out: Path = Field(DEFAULT_OUT, description="Folder that receives the sweep folder")
    env_file: str | None = Field(None, description="Configuration file (default: the project's tpu.env)")


class GreedyDiff(BaseModel):
    id: str = Field(description="Prompt id")
    first_divergence: int = Field(description="Index of the first differing output token")
    tokens_reference: int = Field(description="Output tokens without the drafter")
    tokens_candidate: int = Field(description="Output tokens with it")
    reference_ids: list[int] = Field(description="No-drafter token ids from the divergence on (at most 8)")
    candidate_ids: list[int] = Field(description="Drafter token ids from the divergence on (at most 8)")


class DecodeRow(BaseModel):
    run_dir: str
    label: str
    sampling: str
    draft_tokens: int = Field(description="num_speculative_tokens; 0 = no drafter")
    method: str | None = None
    median_tpot_ms: float | None = None
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    speedup: float | None = Field(None, description="No-drafter median TPOT / this one, same sampling")
    greedy_checked: bool = Field(False, description="Greedy token ids compared with the no-drafter run")
    greedy_diffs: list[GreedyDiff] = Field(default_factory=list)


class DecodeComparison(BaseModel):
    rows: list[DecodeRow]
    markdown: str
    files: dict[str, str] = Field(default_factory=dict)


def _draft_tokens(res: DecodeResult) -> tuple[int, str | None]:
    spec = res.speculative_config or {}
    k = spec.get("num_speculative_tokens")
    return (int(k) if k else 0), spec.get("method") or ("mtp" if spec.get("model") else None)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def load_decode_run(path: str | Path) -> DecodeResult:
    p = Path(path)
    f = p / "summary.json" if p.is_dir() else p
    try:
        res = DecodeResult.model_validate_json(f.read_text())
    except FileNotFoundError:
        raise ToolFailure(f"{p}: no summary.json: not a decode run folder (./vllm-t4 decode writes one)",
                          detail={"path": str(p)}) from None
    except ValueError as exc:
        raise ToolFailure(f"{f}: not a decode summary ({str(exc).splitlines()[0]})", detail={"path": str(f)}) from None
    res.run_dir = str(p)
    return res


def compare_decode_runs(runs: list[str | Path] | list[DecodeResult]) -> DecodeComparison:
    """The article's table from decode runs: per setting time per token, drafts accepted, speedup against the
    no-drafter run of the same sampling, and greedy answers that differ from the no-drafter ones."""
    results = [r if isinstance(r, DecodeResult) else load_decode_run(r) for r in runs]
    base: dict[str, DecodeResult] = {}
    for r in results:
        if _draft_tokens(r)[0] == 0:
            base.setdefault(r.sampling, r)
    rows: list[DecodeRow] = []
    for r in results:
        k, method = _draft_tokens(r)
        row = DecodeRow(run_dir=r.run_dir, label=r.label, sampling=r.sampling, draft_tokens=k, method=method,
                        median_tpot_ms=r.median_tpot_ms, acceptance_rate=r.acceptance_rate,
                        mean_accepted_length=r.mean_accepted_length)
        ref = base.get(r.sampling)
        if ref is not None and k and ref.median_tpot_ms and r.median_tpot_ms:
            row.speedup = ref.median_tpot_ms / r.median_tpot_ms
        if ref is not None and k and r.sampling == "greedy":
            ref_ids = {p.id: p.token_ids for p in ref.prompts}
            checked = False
            for p in r.prompts:
                if p.id not in ref_ids or not (p.token_ids or ref_ids[p.id]):
                    continue
                checked = True
                a = ref_ids[p.id]
                i = first_divergence(a, p.token_ids)
                if i is not None:
                    row.greedy_diffs.append(GreedyDiff(id=p.id, first_divergence=i, tokens_reference=len(a),
                                                       tokens_candidate=len(p.token_ids),
                                                       reference_ids=a[i:i + 8], candidate_ids=p.token_ids[i:i + 8]))
            row.greedy_checked = checked
        rows.append(row)
    return DecodeComparison(rows=rows, markdown=markdown_comparison(rows))


def _setting(row: DecodeRow) -> str:
    what = "No drafter" if not row.draft_tokens else f"{row.draft_tokens} draft tokens"
    if row.draft_tokens and row.method and row.method != "mtp":
        what += f" ({row.method})"
    return what + (", greedy" if row.sampling == "greedy" else ", default sampling")


def markdown_comparison(rows: list[DecodeRow]) -> str:
    lines = ["| Setting | Time per token | Drafts accepted | Mean accepted length | Speedup | Greedy answers |",
             "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        if not r.draft_tokens or r.sampling != "greedy":
            greedy = ""
        elif not r.greedy_checked:
            greedy = "not checked (no token ids)"
        elif not r.greedy_diffs:
            greedy = "all identical"
        else:
            greedy = f"{len(r.greedy_diffs)} differ"
        lines.append(f"| {_setting(r)} | {_fmt(r.median_tpot_ms, '.1f', '—')} ms | "
                     f"{_pct(r.acceptance_rate) if r.draft_tokens else ''} | "
                     f"{_fmt(r.mean_accepted_length) if r.draft_tokens else ''} | "
                     f"{(_fmt(r.speedup) + 'x') if r.speedup else ''} | {greedy} |")
    diffs = [(r, d) for r in rows for d in r.greedy_diffs]
    if diffs:
        lines += ["", "Greedy answers that differ from the no-drafter answers:", "",
                  "| Setting | Prompt | First divergence | Tokens (no drafter / drafter) | Ids there (no drafter / "
                  "drafter) |", "|---|---|---:|---|---|"]
        for r, d in diffs:
            lines.append(f"| {_setting(r)} | {d.id} | {d.first_divergence} | {d.tokens_reference} / "
                         f"{d.tokens_candidate} | {d.reference_ids} / {d.candidate_ids} |")
    return "\n".join(lines) + "\n"


def speculative_json(params: DecodeSweepParams, k: int, configured: str | None) -> str:
    """SPECULATIVE_CONFIG for k draft tokens ("" for 0): the drafter path (or method) plus num_speculative_tokens."""
    if k == 0:
        return ""
    if params.method:
        spec: dict[str, Any] = {"method": params.method, "num_speculative_tokens": k}
        if params.method == "ngram":
            spec.update(prompt_lookup_max=4, prompt_lookup_min=1)
        if params.drafter:
            spec["model"] = params.drafter
        return json.dumps(spec)
    drafter = params.drafter
    if drafter is None and configured:
        drafter = parse_speculative_config(configured).get("model")
    if not drafter:
        raise BadInput("decode-sweep needs a drafter for settings above 0: pass --drafter PATH (or --method "
                          "ngram), or set SPECULATIVE_CONFIG's model in tpu.env", detail={"field": "drafter"})
    return json.dumps({"model": drafter, "num_speculative_tokens": k})


class DecodeSweepResult(BaseModel):
    run_dir: str = Field(description="The sweep folder: one decode run per setting under runs/, table.md")
    runs: list[str] = Field(default_factory=list, description="Decode run folders, in the order measured")
    comparison: DecodeComparison
    startup_s: dict[str, float | None] = Field(default_factory=dict, description="Server start time per setting")
    wall_s: float | None = None


def run_decode_sweep(params: DecodeSweepParams, *, progress: Progress | None = None,
                     **config_overrides: Any) -> DecodeSweepResult:
    """Start the server once per drafter setting, run the decode benchmark for each sampling, stop it; write the
    comparison. config_overrides go to load_config (a test's port and state dir). The server is always stopped,
    whatever ends the sweep."""
    from tools.serving.config import load_config
    from tools.serving.vllm_server import start_server, stop_server

    evidence.check_name(params.label, "label")
    if not params.draft_tokens or any(k < 0 for k in params.draft_tokens):
        raise BadInput(f"--draft-tokens must be integers >= 0, got {params.draft_tokens}",
                          detail={"field": "draft_tokens"})
    try:  # the configuration is input too: a SPECULATIVE_CONFIG that is not JSON is refused here
        base_cfg = load_config(params.env_file, **config_overrides)
    except BadInput:
        raise
    except ToolFailure as exc:
        raise BadInput(str(exc), exc.detail) from None
    configured = base_cfg.speculative_config or None
    specs = {k: speculative_json(params, k, configured) for k in params.draft_tokens}  # refuse before any start
    for k, spec in specs.items():
        if spec:
            validate_speculative_config(spec, base_cfg.model)
    run = evidence.EvidenceRun.create(params.out, evidence.run_id(params.label, "decode-sweep"))
    runs_out = run.dir / "runs"
    t0 = time.monotonic()
    results: list[DecodeResult] = []
    startup: dict[str, float | None] = {}
    total = len(specs) * len(params.sampling)
    # A setting that fails stops the sweep; the runs finished so far stay in the .partial folder; one stopped
    # before any run finished (a refused or interrupted first start) leaves none: an empty one per try piles up.
    try:
        for k, spec in specs.items():
            cfg = load_config(params.env_file, **{**config_overrides, "speculative_config": spec})
            if progress is not None:
                progress(len(results), total, f"starting the server with {k} draft tokens")
            start = start_server(cfg)
            startup[f"k{k}"] = start.startup_s
            try:
                for s in params.sampling:
                    if progress is not None:
                        progress(len(results), total, f"{k} draft tokens, {s}")
                    res = run_decode(DecodeParams(base_url=start.base_url, prompts=params.prompts,
                                                  max_tokens=params.max_tokens, sampling=s, label=f"k{k}-{s}",
                                                  out=runs_out, seed=params.seed,
                                                  request_timeout_s=params.request_timeout_s),
                                     serve_config=cfg, server_argv=list(start.argv),
                                     extra_provenance={"server_startup_s": start.startup_s})
                    results.append(res)
            finally:
                stop_server(cfg)
    except BaseException:
        if not results:
            run.abandon()
        raise
    final_runs = run.path / "runs"
    for r in results:  # each run's summary names the paths it will have once the sweep folder is in place
        r.run_dir = str(final_runs / r.run_id)
        r.files = {k: str(final_runs / Path(v).relative_to(runs_out)) if Path(v).is_relative_to(runs_out) else v
                   for k, v in r.files.items()}
        evidence.write_json(runs_out / r.run_id / "summary.json", r)
    cmp = compare_decode_runs(results)
    md = (f"# Decode sweep {run.name}\n\n{len(params.draft_tokens)} settings x {len(params.sampling)} "
          f"samplings, {params.prompts} prompts, max {params.max_tokens} tokens, one request at a time.\n\n"
          + cmp.markdown)
    res = DecodeSweepResult(run_dir=str(run.path), runs=[r.run_dir for r in results], comparison=cmp,
                            startup_s=startup, wall_s=time.monotonic() - t0)
    res.comparison.files = run.write_summary(res, md)
    evidence.write_text(run.dir / "table.md", cmp.markdown)
    res.comparison.files["table_md"] = str(run.path / "table.md")
    evidence.write_json(run.dir / "summary.json", res)
    run.finish()
    return res
