"""The newcomer's one command: the whole pipeline on whatever machine this is, ending in an evidence report.

    python3 -m tools.demo          (or ./vllm-t4 demo)

Without an NVIDIA GPU it builds the tiny Gemma-4-shaped QAT-like model (repack.stand_ins.tiny_model), so nothing is
downloaded; on a machine where `nvidia-smi -L` answers (the T4 VM) it takes the real QAT checkpoint from
SOURCE_CHECKPOINT in tpu.env (or --source), after the checks of `./vllm-t4 doctor`; with SOURCE_CHECKPOINT
empty and a Hugging Face token set it fetches it first (`./vllm-t4 fetch`). Then, with the same library calls
the MCP tools make:

1. probe the source (is it on the 4-bit grid?);
2. repack it, one pass per build: the bf16-embedding text build and the all-4-bit (int4 embeddings) build;
3. serve the bf16-embedding build, record its greedy tokens, run a short sweep, stop;
4. serve the int4-embedding build, check its tokens against the record, run the same sweep, stop;
5. compare the two sweeps and write everything into one evidence folder (report.md, report.json, the runs).

Servers are always stopped, whatever fails. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field

from repack.build.build import BuildOptions, build_checkpoint
from repack.build.probe import ProbeReport, probe_checkpoint
from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint, default_cache_dir
from tools.core.atomic_files import path_failure
from tools.core.commands import PROG_VARIABLE, exit_status, fail, run_program
from tools.core.errors import BadInput, ToolFailure, param
from tools.core.process import free_port
from tools.core.progress import Progress
from tools.core.root import PROJECT_ROOT
from tools.core import clock
from tools.measure import evidence as evidence_files
from tools.measure.tokens.compare import TokenCompareParams, TokenComparison, check_against, record_reference
from tools.measure.sweep.run import run_sweep
from tools.measure.sweep.report import compare_runs, markdown_run
from tools.serving.config import DEFAULT_ENV_FILE, load_config
from repack.source.checks import SOURCE_REPO
from tools.serving import FetchParams, PreflightParams, Server, fetch_checkpoint, hf_token, run_preflight

SOURCE_KEY = "SOURCE_CHECKPOINT"

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def has_nvidia_gpu() -> bool:
    """The same test setup.sh makes: an NVIDIA driver that answers."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return False
    try:
        return subprocess.run([exe, "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class DemoOptions:
    work: Path = PROJECT_ROOT / "work" / "demo"       # models and server state (git-ignored)
    evidence: Path | None = None                        # default: evidence/demo-<UTC time>
    source: Path | None = None                          # GPU: the QAT checkpoint; default SOURCE_CHECKPOINT
    env_file: Path | None = None                        # default: the project's tpu.env
    gpu: bool | None = None                             # None: detect
    force: bool = False                                 # rebuild existing builds
    # The short sweep and token check; None: the platform's defaults below.
    input_lens: list[int] | None = None
    concurrencies: list[int] | None = None
    output_len: int | None = None
    repeats: int = 1
    max_tokens: int | None = None


@dataclass
class _Plan:
    gpu: bool
    source: Path
    models: Path
    evidence: Path
    serve_overrides: dict[str, Any]
    input_lens: list[int]
    concurrencies: list[int]
    output_len: int
    repeats: int
    max_tokens: int
    builds: list[tuple[str, str, dict[str, Any]]] = field(default_factory=list)  # label, folder, options
    preflight: str = ""                                  # the T4 path's preflight summary


class BuildStep(BaseModel):
    label: str
    path: str
    total_bytes_before: int
    total_bytes_after: int
    wall_s: float
    table: str


class ServeStep(BaseModel):
    label: str
    model: str
    platform: str
    startup_s: float
    kv_cache_tokens: int | None = None
    model_loading_gib: float | None = None
    linear_kernel: str | None = None
    embedding_method: str | None = None
    sweep_dir: str
    sweep_table: str


class DemoReport(BaseModel):
    platform: str = Field(description="cuda (the T4) or cpu (the tiny model)")
    source: str
    evidence_dir: str
    probe_verdict: str
    builds: list[BuildStep]
    served: list[ServeStep]
    tokens_identical: int
    tokens_total: int
    tokens_report: str
    sweep_comparison: str
    wall_s: float
    report_path: str
    # when the report was written (ISO 8601, UTC): gemma4-t4://demo/latest orders reports by it, since a checkout
    # or a copy resets file times
    finished_at: str | None = None


def _plan(opts: DemoOptions, log: Log) -> _Plan:
    gpu = has_nvidia_gpu() if opts.gpu is None else opts.gpu
    work = opts.work.resolve()
    evidence = (opts.evidence or PROJECT_ROOT / "evidence" / evidence_files.run_id("demo")).resolve()
    if gpu:
        env_file = opts.env_file or DEFAULT_ENV_FILE
        checked = _preflight(env_file, source_given=opts.source is not None)
        src = opts.source
        if src is None:
            raw = load_config(env_file).source_checkpoint
            src = Path(raw).expanduser() if raw else _fetch_source(env_file, log)
        if not (src / "config.json").is_file():
            raise BadInput(f"source checkpoint {src} has no config.json; download {SOURCE_REPO} there or fix "
                           f"{param('source')}", field="source")
        models = PROJECT_ROOT / "models"
        plan = _Plan(gpu=True, source=src.resolve(), models=models, evidence=evidence, preflight=checked,
                     serve_overrides={"state_dir": work / "run"},
                     input_lens=opts.input_lens or [512], concurrencies=opts.concurrencies or [1, 8],
                     output_len=opts.output_len or 128, repeats=opts.repeats, max_tokens=opts.max_tokens or 160)
        stem = "gemma-4-E2B-it-qat-q4_0-w4a16-ct"
    else:
        models = work / "models"
        plan = _Plan(gpu=False, source=models / "gemma-4-tiny-qat", models=models, evidence=evidence,
                     serve_overrides={"state_dir": work / "run", "max_model_len": 512, "max_num_seqs": 4,
                                      "cpu_kvcache_space_gib": 1, "speculative_config": "", "extra_args": ""},
                     input_lens=opts.input_lens or [64], concurrencies=opts.concurrencies or [1, 4],
                     output_len=opts.output_len or 16, repeats=opts.repeats, max_tokens=opts.max_tokens or 24)
        stem = "gemma-4-tiny"
    plan.builds = [
        ("bf16-emb", f"{stem}-text", dict(quantize_linears=True, text_only=True, embed_int4=False,
                                          embed_tokens=False)),
        ("int4-emb", f"{stem}-text-emb4", dict(quantize_linears=True, text_only=True, embed_int4=True,
                                               embed_tokens=True)),
    ]
    return plan


def _preflight(env_file: Path, *, source_given: bool = False) -> str:
    """The T4 path starts with the same checks as ./vllm-t4 doctor: refused with the first failing check's line."""
    report = run_preflight(PreflightParams(env_file=str(env_file)))
    # With --source the gated download the token check is about does not happen.
    failed = [c for c in report.checks if c.status == "fail" and not (source_given and c.name == "hf_token")]
    if failed:
        first = failed[0]
        raise BadInput(first.line(), detail={"preflight": report.model_dump()})
    return report.summary


def _fetch_source(env_file: Path, log: Log) -> Path:
    """SOURCE_CHECKPOINT empty: fetch the gated QAT source into models/ (./vllm-t4 fetch), given a token."""
    if hf_token()[0] is None:
        raise BadInput(f"{env_file}: {SOURCE_KEY} is not set and no Hugging Face token is set to fetch it: "
                       f"accept the licence at https://huggingface.co/{SOURCE_REPO} and export "
                       f"HF_TOKEN=<a read token>, or set {SOURCE_KEY} to a downloaded copy (or pass "
                       f"{param('source')})")
    log(f"[0/6] {SOURCE_KEY} is empty: fetching {SOURCE_REPO} into models/")
    show = _progress_printer(log, "fetch, bytes", 10.0)
    result = fetch_checkpoint(FetchParams(repo_id=SOURCE_REPO), progress=show)
    log(f"    {result.out}: {len(result.files)} files, {result.total_bytes / 2**30:.2f} GiB"
        + (" (already there)" if result.already_present else ""))
    return Path(result.out)


def _progress_printer(log: Log, what: str, every_s: float = 5.0) -> Progress:
    last = [0.0]

    def show(done: float, total: float | None = None, message: str = "") -> None:
        now = time.monotonic()
        if now - last[0] < every_s and not (total is not None and done >= total):
            return
        last[0] = now
        frac = f"{done:,.0f}/{total:,.0f}" if total is not None else f"{done:,.0f}"
        log(f"    {what}: {frac} {message[:100]}")

    return show


def run_demo(opts: DemoOptions | None = None, *, log: Log = _stderr) -> DemoReport:
    opts = opts or DemoOptions()
    t0 = time.monotonic()
    plan = _plan(opts, log)
    plan.models.mkdir(parents=True, exist_ok=True)
    plan.evidence.mkdir(parents=True, exist_ok=True)
    log(f"gemma4-t4 demo on {'an NVIDIA GPU' if plan.gpu else 'the CPU (tiny model)'}; evidence in {plan.evidence}")
    if plan.preflight:
        log(f"[0/6] preflight: {plan.preflight}")
    _source(plan, log)
    probe = _probe(plan, log)
    builds, paths = _repack(plan, opts.force, log)
    served, comparison = _serve_builds(plan, opts, paths, log)
    return _report(plan, probe, builds, served, comparison, time.monotonic() - t0, log)


def _source(plan: _Plan, log: Log) -> None:
    """The source: the tiny QAT-like model is built here (or copied from its cache); the real one must exist."""
    if not plan.gpu and not (plan.source / "config.json").is_file():
        log(f"[1/6] building the tiny QAT-like model in {plan.source} (trained once, then copied from the "
            f"cache in {default_cache_dir() or 'nowhere: $GEMMA4_T4_CACHE is empty'})")
        info = cached_tiny_qat_checkpoint(plan.source)
        log(f"    next-token accuracy {info.accuracy:.3f} on its pattern")
    else:
        log(f"[1/6] source checkpoint {plan.source}")


def _probe(plan: _Plan, log: Log) -> ProbeReport:
    probe = probe_checkpoint(plan.source)
    log(f"[2/6] probe: verdict {probe.verdict} ({probe.text_on_grid} text tensors on the grid, "
        f"{probe.text_off_grid} off)")
    if probe.verdict != "qat":
        raise BadInput(f"{plan.source}: probe verdict {probe.verdict!r}, not a QAT q4_0 export; repack would "
                       "abort")
    return probe


def _repack(plan: _Plan, force: bool, log: Log) -> tuple[list[BuildStep], dict[str, Path]]:
    """One repack pass per build (an existing build is reused unless `force`); each build's folder by label."""
    builds: list[BuildStep] = []
    paths: dict[str, Path] = {}
    for label, folder, options in plan.builds:
        out = plan.models / folder
        paths[label] = out
        if (out / "config.json").is_file() and not force:
            log(f"[3/6] {label}: {out} exists, reused (--force rebuilds)")
            size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            builds.append(BuildStep(label=label, path=str(out), total_bytes_before=0, total_bytes_after=size,
                                    wall_s=0.0, table=f"reused the existing build ({size / 2**20:.1f} MiB of "
                                                      "safetensors); run with --force to rebuild"))
            continue
        log(f"[3/6] repacking {label} -> {out}")
        report = build_checkpoint(plan.source, out, BuildOptions(**options, force=force),
                                  progress=_progress_printer(log, "repack, bytes"))
        d = report.to_dict()
        builds.append(BuildStep(label=label, path=str(out), total_bytes_before=d["total_bytes_before"],
                                total_bytes_after=d["total_bytes_after"], wall_s=d["wall_s"],
                                table=report.format_table()))
        evidence_files.write_json(plan.evidence / f"repack-{label}.json", d)
    return builds, paths


def _serve_builds(plan: _Plan, opts: DemoOptions, paths: dict[str, Path],
                  log: Log) -> tuple[list[ServeStep], TokenComparison]:
    """Each build served in turn: the first records its greedy tokens, the others are checked against them;
    a short sweep of each. Every server is stopped, whatever fails."""
    reference = plan.evidence / "tokens-bf16-emb.json"
    served: list[ServeStep] = []
    comparison = None
    for i, (label, _, _) in enumerate(plan.builds):
        overrides = dict(plan.serve_overrides, model=str(paths[label]), served_name=paths[label].name)
        if not plan.gpu:
            overrides["port"] = free_port()
        cfg = load_config(opts.env_file, **overrides)
        log(f"[{4 + i}/6] serving {label} ({cfg.model}) at {cfg.base_url}")
        with Server(cfg) as server:  # stopped when this build is done; a kill of the demo does not leave it serving
            start = server.start(progress=lambda done, total, msg: None)
            try:
                sf = start.start_fields
                log(f"    up after {start.startup_s:.0f} s; KV cache {sf.kv_cache_tokens} tokens, "
                    f"linear kernel {sf.linear_kernel}, embeddings {sf.embedding_method}")
                # the demo's own evidence file, written fresh by every run
                params = TokenCompareParams(base_url=start.base_url, max_tokens=plan.max_tokens, force=True)
                if i == 0:
                    rec = record_reference(reference, params, progress=_progress_printer(log, "prompts"))
                    log(f"    {rec.summary()}")
                else:
                    comparison = check_against(reference, params, progress=_progress_printer(log, "prompts"))
                    log(f"    {comparison.summary}")
                served.append(_sweep(plan, label, cfg, start, log))
            finally:
                server.stop()
                log(f"    stopped {label}")
    assert comparison is not None
    return served, comparison


def _sweep(plan: _Plan, label: str, cfg: Any, start: Any, log: Log) -> ServeStep:
    """The short sweep of one served build, with what its start reported."""
    sweep = run_sweep(progress=_progress_printer(log, "sweep repeats", 0.0), base_url=start.base_url,
                      out=str(plan.evidence / "sweeps"), label=label, input_lens=plan.input_lens,
                      concurrencies=plan.concurrencies, output_len=plan.output_len, repeats=plan.repeats,
                      run_id=f"{label}", serve_config=cfg)  # provenance: this server's argv
    sf = start.start_fields
    return ServeStep(label=label, model=cfg.model, platform=start.platform, startup_s=start.startup_s,
                     kv_cache_tokens=sf.kv_cache_tokens, model_loading_gib=sf.model_loading_gib,
                     linear_kernel=sf.linear_kernel, embedding_method=sf.embedding_method, sweep_dir=sweep.run_dir,
                     sweep_table=markdown_run(sweep))


def _report(plan: _Plan, probe: ProbeReport, builds: list[BuildStep], served: list[ServeStep],
            comparison: TokenComparison, wall_s: float, log: Log) -> DemoReport:
    """The sweeps compared, and report.md and report.json written into the evidence folder."""
    cmp = compare_runs([s.sweep_dir for s in served])
    report_path = plan.evidence / "report.md"
    result = DemoReport(platform="cuda" if plan.gpu else "cpu", source=str(plan.source),
                        evidence_dir=str(plan.evidence), probe_verdict=probe.verdict, builds=builds, served=served,
                        tokens_identical=comparison.identical, tokens_total=comparison.total,
                        tokens_report=comparison.text(), sweep_comparison=cmp.markdown,
                        wall_s=round(wall_s, 1), report_path=str(report_path),
                        finished_at=clock.iso())
    evidence_files.write_text(report_path, render_markdown(result))
    evidence_files.write_json(plan.evidence / "report.json", result)
    log(f"[6/6] {comparison.summary}; report: {report_path}")
    return result


def _finished(r: DemoReport) -> datetime:
    return datetime.fromisoformat(r.finished_at) if r.finished_at else clock.utc_now()


def render_markdown(r: DemoReport) -> str:
    lines = [f"# gemma4-t4 demo: {'Tesla T4' if r.platform == 'cuda' else 'CPU, tiny Gemma-4-shaped model'}", "",
             f"{clock.minute(_finished(r))}, {platform.node()}, "
             f"{r.wall_s:.0f} s end to end. Command: `python3 -m tools.demo`.", "",
             f"Source `{r.source}`: probe verdict **{r.probe_verdict}**.", "", "## Builds (one repack pass each)", ""]
    for b in r.builds:
        lines += [f"### {b.label}: `{b.path}`", "", "```", b.table, "```", ""]
    lines += ["## Served", "", "| Build | Platform | Start s | KV cache tokens | Model loading GiB | Linear kernel | "
              "Embeddings |", "|---|---|---|---|---|---|---|"]
    for s in r.served:
        lines.append(f"| {s.label} | {s.platform} | {s.startup_s:.0f} | {s.kv_cache_tokens or '—'} | "
                     f"{s.model_loading_gib or '—'} | {s.linear_kernel or '—'} | {s.embedding_method or '—'} |")
    lines += ["", f"## Greedy tokens: {r.tokens_identical} of {r.tokens_total} prompts identical", "", "```",
              r.tokens_report, "```", "", "## Sweeps", ""]
    for s in r.served:
        lines += [s.sweep_table.replace("\n# ", "\n### ").replace("## ", "#### "), ""]
    lines += ["## Comparison (last build vs first)", "", r.sweep_comparison, ""]
    if r.platform == "cpu":
        lines += ["CPU figures say the pipeline works end to end; they are not T4 performance.", ""]
    return "\n".join(lines)


def _options(args: argparse.Namespace) -> DemoOptions:
    return DemoOptions(work=args.work, evidence=args.evidence, source=args.source, env_file=args.env_file,
                       gpu={"auto": None, "cpu": False, "gpu": True}[args.platform], force=args.force)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--work", type=Path, default=PROJECT_ROOT / "work" / "demo",
                   help="models and server state of the CPU demo (default work/demo)")
    p.add_argument("--evidence", type=Path, default=None, help="report folder (default evidence/demo-<time>)")
    p.add_argument("--source", type=Path, default=None,
                   help=f"GPU: the QAT checkpoint folder (default {SOURCE_KEY} in tpu.env)")
    p.add_argument("--env-file", type=Path, default=None, help="serving config (default tpu.env)")
    p.add_argument("--platform", choices=["auto", "cpu", "gpu"], default="auto",
                   help="auto: the GPU path when nvidia-smi answers")
    p.add_argument("--force", action="store_true", help="rebuild the builds even if they exist")


def main(argv: list[str] | None = None) -> int:
    """`python3 -m tools.demo`, and `./vllm-t4 demo` run in its place (named so in its lines, PROG_VARIABLE)."""
    prog = os.environ.pop(PROG_VARIABLE, None)  # popped: not the name of the servers and tools the demo starts
    p = argparse.ArgumentParser(prog=prog or "python3 -m tools.demo", description=__doc__.split("\n\n")[0])
    add_arguments(p)

    def run(args: argparse.Namespace) -> int:
        try:
            try:
                run_demo(_options(args))
                return 0
            except OSError as exc:  # on a path no call site foresaw (a name over 255 bytes): one line all the same
                if exc.filename is None:
                    raise
                raise path_failure(exc) from exc
        except ToolFailure as exc:
            fail(prog or "demo", exc, False)
            return exit_status(exc)

    p.set_defaults(func=run)
    return run_program(prog.split()[0] if prog else "demo", lambda: p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
