"""Drafter settings side by side: `decode-sweep` restarts the server once per drafter setting (0 = no drafter)
and sampling and runs the decode benchmark; `decode-compare` builds the article's table from decode runs: time
per token, drafts accepted, speedup against no drafter, and which greedy answers differ from the no-drafter
answers (speculative decoding must not change greedy output).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from tools.core.errors import BadInput, ToolFailure, op, param
from tools.measure import evidence
from tools.measure.decode.params import DecodeParams, DecodeRequests
from tools.measure.decode.run import DecodeResult, fmt, pct, run_decode
from tools.core.names import check_name
from tools.core.progress import Progress
from tools.measure.sweep.params import DEFAULT_OUT
from tools.measure.uncertainty import Ratio, paired_ratio
from tools.serving.config import load_config
from tools.core.output_check import check_output_folder
from tools.serving import Server, parse_speculative_config, validate_speculative_config


class DecodeSweepParams(DecodeRequests):
    """Options of `./vllm-t4 decode-sweep`: one server start per drafter setting, the decode benchmark per
    sampling, the article's table."""

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
    speedup: float | None = Field(None, description="No-drafter TPOT / this one, same sampling: the geometric "
                                                    "mean over prompts paired by id (the ratio of the median "
                                                    "TPOTs for runs without per-prompt records)")
    speedup_interval: Ratio | None = Field(None, description="The speedup's 95% interval and verdict (faster, "
                                                             "slower, within noise, no repeats)")
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
    if not f.is_file():
        raise BadInput(f"{p}: no summary.json: not a decode run folder ({op('decode')} writes one)",
                       detail={"path": str(p)})
    try:
        res = DecodeResult.model_validate_json(f.read_bytes())
    except ValueError as exc:
        raise BadInput(f"{f}: not a decode summary ({str(exc).splitlines()[0]})", detail={"path": str(f)}) from None
    except OSError as exc:
        raise BadInput(f"{f}: cannot be read ({exc.strerror or exc})", detail={"path": str(f)}) from None
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
        if ref is not None and k:
            row.speedup_interval = _speedup(ref, r)
            row.speedup = row.speedup_interval.value
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


def _speedup(ref: DecodeResult, run: DecodeResult) -> Ratio:
    """No-drafter TPOT / this TPOT by tools/measure/uncertainty.py's paired method over the prompts both ran;
    the ratio of the medians, without an interval, where fewer than two prompts pair up (published figures)."""
    tpot = {p.id: p.tpot_ms for p in ref.prompts}
    recorded = (ref.median_tpot_ms / run.median_tpot_ms if ref.median_tpot_ms and run.median_tpot_ms else None)
    return paired_ratio([(tpot.get(p.id), p.tpot_ms) for p in run.prompts], recorded)


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
        lines.append(f"| {_setting(r)} | {fmt(r.median_tpot_ms, '.1f', '—')} ms | "
                     f"{pct(r.acceptance_rate) if r.draft_tokens else ''} | "
                     f"{fmt(r.mean_accepted_length) if r.draft_tokens else ''} | "
                     f"{r.speedup_interval.cell() if r.speedup_interval and r.speedup else ''} | {greedy} |")
    lines += ["", "Time per token: median over prompts. Speedup: no-drafter time per token / this one, the "
              "geometric mean over the prompts both runs sent, with its 95% interval (Student t on the log "
              "per-prompt ratios); faster / slower only where the interval excludes 1.00x, else within noise; no "
              "repeats where the runs kept no per-prompt times (the ratio of the medians)."]
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
        raise BadInput(f"decode-sweep needs a drafter for settings above 0: pass {param('drafter')} PATH (or "
                       f"{param('method', 'ngram')}), or set SPECULATIVE_CONFIG's model in tpu.env", field="drafter")
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
    whatever ends the sweep: a SIGKILL of this process too (tools.serving.server.server.Server)."""
    check_name(params.label)
    check_output_folder(params.out)  # before any server starts
    if not params.draft_tokens or any(k < 0 for k in params.draft_tokens):
        raise BadInput(f"{param('draft_tokens')} must be integers >= 0, got {params.draft_tokens}",
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
    run = evidence.EvidenceRun.create(params.out, evidence.run_id("decode-sweep", params.label))
    runs_out = run.dir / "runs"
    t0 = time.monotonic()
    results: list[DecodeResult] = []
    startup: dict[str, float | None] = {}
    total = len(specs) * len(params.sampling)
    # A setting that fails stops the sweep; the runs finished so far stay in the .partial folder (until the next
    # run in --out removes it); one stopped before any run finished (a refused or interrupted first start) leaves
    # none.
    try:
        for k, spec in specs.items():
            cfg = load_config(params.env_file, **{**config_overrides, "speculative_config": spec})
            if progress is not None:
                progress(len(results), total, f"starting the server with {k} draft tokens")
            with Server(cfg) as server:  # stopped when the setting ends, however the sweep ends
                start = server.start()
                startup[f"k{k}"] = start.startup_s
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
