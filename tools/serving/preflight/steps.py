"""Preflight: every check a deployment needs, each `ok|warn|fail|n/a` with the measured value and one line on how
to fix it.

    ./vllm-t4 doctor [--json] [--step all|start|repack|fetch]

Exit status: 0 when no check fails (warnings allowed), 1 when a check fails, 2 for bad input (an --env-file that
does not exist, an unknown --step). `checks_for(step, ...)` gives the checks one step needs; `ensure(step, ...)`
raises the first failing check's line as a ToolFailure, which `start_server` and the repack call before acting.

The checks themselves are tools.serving.preflight.checks. On a machine without an NVIDIA driver the GPU checks
are `n/a` and the CPU path (vLLM's CPU build) is what is checked.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from tools.core.errors import BadInput, ToolFailure, param
from tools.core.params import OpParams
from tools.serving.config import check_instance_name, load_config
from tools.serving.preflight.hardware import Hardware
from repack.source.checks import SOURCE_REPO
from tools.serving.hub.access import hf_token
from tools.serving.records import placement
from tools.serving.preflight.build_checks import check_checkpoints, check_max_model_len, check_runtime_dtype
from tools.serving.preflight.checks import (Check, Context, check_api_key, check_compute_capability, check_disk,
                                            check_drafter, check_gpu_memory, check_hf_token, check_host_memory,
                                            check_hub, check_nvidia_driver, check_port, check_source,
                                            check_turing_clamp, check_versions, check_vllm_build)

Step = Literal["all", "start", "repack", "fetch"]


class PreflightParams(OpParams):
    step: Step = Field("all", description="Which checks: all, or those before a start, a repack or a fetch")
    env_file: str | None = Field(None, description="Serving configuration to check (default: the project's tpu.env)")
    source: str | None = Field(None, description="repack: the source (default SOURCE_CHECKPOINT)")
    out: str | None = Field(None, description="repack: the output folder (default MODEL_NAME)")
    model: str | None = Field(None, description="start: the build about to be served (default MODEL_NAME)")
    port: int | None = Field(None, ge=1, le=65535, description="start: its port (default PORT)")
    instance: str | None = Field(None, description="start: its instance")
    repo_id: str | None = Field(None, description="fetch: the repo (default: the QAT source)")

    # The MCP server checks its own config; the fetch its hub toolset offers is of the QAT source by default.
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"env_file", "repo_id"})


class PreflightReport(BaseModel):
    ready: bool = Field(description="True when no check fails (warnings allowed)")
    platform: Literal["cuda", "cpu"] = Field(description="cuda: an NVIDIA GPU answers NVML; cpu: vLLM's CPU path")
    step: Step = Field(description="Which checks ran")
    checks: list[Check] = Field(description="Every check, in the order a deployment meets them")
    failed: list[str] = Field(default_factory=list, description="Names of the failing checks")
    warnings: list[str] = Field(default_factory=list, description="Names of the checks that warn")
    summary: str = Field(description="One line: ready or not, on which path, and the first thing to fix")

    def text(self) -> str:
        width = max(len(c.name) for c in self.checks)
        rows = [f"{c.status:<4}  {c.name:<{width}}  {c.value}" + (f"\n      {'':<{width}}  -> {c.fix}" if c.fix else "")
                for c in self.checks]
        return "\n".join(rows + ["", self.summary])


# ----------------------------------------------------------------------------------------------------------------
# Steps

def _load(cfg: Any, env_file: str | Path | None, **overrides: Any) -> tuple[Any, str | None]:
    """The serving config checked, with the start's own port and instance (None: the config's)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if "instance" in overrides:  # a bad name is bad input (exit 2), not a failing check
        overrides["instance"] = check_instance_name(overrides["instance"])
    if cfg is not None:
        if not overrides:
            return cfg, None
        try:
            return replace(cfg, **overrides, sources={**cfg.sources, **dict.fromkeys(overrides, "override")}), None
        except (TypeError, ValueError) as exc:
            return None, str(exc)
    try:
        return load_config(env_file, **overrides), None
    except ToolFailure as exc:
        return None, str(exc)


def checks_for(step: Step, *, cfg: Any = None, env_file: str | Path | None = None, source: str | Path | None = None,
               out: str | Path | None = None, repo_id: str | None = None, need_bytes: int | None = None,
               hardware: Any = None, nvml: Any = None, turing_target: Path | None = None,
               force: bool = False, protected_roots: list[Path] | None = None,
               model: str | None = None, port: int | None = None, instance: str | None = None,
               placed: bool = False, models_roots: list[Path] | None = None) -> list[Check]:
    """The checks `step` needs, in the order their failures should be reported.

    start: the configured model (cfg or env_file) on this machine; repack: `source` into `out`; fetch: `repo_id`
    (`need_bytes`: its size, when known) into `out`; all: everything a deployment meets. `force`: the repack
    may replace `out` (an empty folder or a build it wrote); `protected_roots`: folders it may never replace or
    wrap (default: the working and home folders, as for a build from a shell). `model`: the build a start is about
    to serve, instead of the config's MODEL_NAME (as a start given a model serves it); `port` and `instance`: the
    start's own, instead of the config's PORT and the default instance. `placed`: the start planned its place
    already, under the placement lock it launches under (not planned again here). `models_roots`: the folders whose
    builds the checkpoints check lists (default: the project's models/).
    """
    if step not in ("all", "start", "repack", "fetch"):
        raise BadInput(f"step {step!r} is not one of all, start, repack, fetch")
    cfg, cfg_error = _load(cfg, env_file, port=port, instance=instance)
    if model is not None and cfg is not None:
        cfg = replace(cfg, model=model, sources={**cfg.sources, "model": "override"})
    ctx = Context(cfg, cfg_error, hardware, nvml, turing_target, models_roots)
    checks: list[Check] = []
    # A repack given its source and output reads nothing from the serving config: a broken tpu.env is not its
    # failure.
    if cfg_error and not (step == "repack" and source and out):
        checks.append(Check(name="config", status="fail", value=cfg_error, fix="fix the file or the environment"))
    elif step == "all":
        checks.append(Check(name="config", status="ok", value=f"{cfg.env_file}: serving {cfg.model} at {cfg.base_url}"))
    src = Path(source).expanduser() if source else (
        Path(cfg.source_checkpoint).expanduser() if cfg is not None and cfg.source_checkpoint else None)
    dst = Path(out).expanduser() if out else None
    if step == "start":
        checks += [check_api_key(ctx), *([] if placed else [check_placement(ctx)]), check_port(ctx),
                   check_checkpoints(ctx, step=step), check_max_model_len(ctx), check_runtime_dtype(ctx),
                   check_drafter(ctx), check_turing_clamp(ctx), check_host_memory(ctx), check_vllm_build(ctx),
                   check_nvidia_driver(ctx), check_gpu_memory(ctx), check_versions(ctx)]
    elif step == "repack":
        checks += [check_source(src, dst, force=force, protected_roots=protected_roots), check_disk(ctx, step=step, source=src, out=dst)]
    elif step == "fetch":
        checks += [check_hub(ctx, repo_id=repo_id), check_hf_token(ctx, step=step, repo_id=repo_id),
                   check_disk(ctx, step=step, out=dst, need_bytes=need_bytes)]
    else:
        checks += [check_nvidia_driver(ctx), check_gpu_memory(ctx), check_compute_capability(ctx),
                   check_vllm_build(ctx), check_versions(ctx), check_turing_clamp(ctx), check_host_memory(ctx),
                   check_disk(ctx, step=step, source=src, out=dst), check_api_key(ctx), check_port(ctx),
                   check_max_model_len(ctx), check_hf_token(ctx, step=step), check_checkpoints(ctx, step=step),
                   check_runtime_dtype(ctx), check_drafter(ctx)]
    return checks


def check_placement(ctx: Context) -> Check:
    """What other instances of STATE_DIR hold (their ports, CPU cores, GPU shares) against this start, and vLLM
    parallelism against the machine: start's own placement (records.placement.plan), so doctor says what start
    refuses."""
    cfg = ctx.cfg
    if cfg is None:
        return Check(name="placement", status="n/a", value="no configuration")
    try:
        planned = placement.plan(cfg, ctx.hw)
    except ToolFailure as exc:
        return Check(name="placement", status="fail", value=str(exc), detail=exc.detail)
    where = (f"GPUs {','.join(map(str, planned.gpus))}" if planned.gpus is not None else
             f"CPU cores {' | '.join(','.join(map(str, c)) for c in planned.cpu_cores)}" if planned.cpu_cores
             else "vLLM's own placement")
    return Check(name="placement", status="ok", detail={"instance": cfg.instance_name},
                 value=f"instance {cfg.instance_name} fits beside the running ones ({where})")


# Checks whose failure is the caller's input to change (a model folder that does not exist, a context length
# above the model's own): refused as bad input (exit 2), the others as failures.
INPUT_CHECKS = frozenset({"api_key", "checkpoints", "max_model_len"})


def refusal(c: Check, detail: dict[str, Any]) -> ToolFailure:
    """A failing check as the failure a start raises: BadInput for INPUT_CHECKS."""
    return (BadInput if c.name in INPUT_CHECKS else ToolFailure)(c.line(), detail=detail)


def ensure(step: Step, **kwargs: Any) -> list[Check]:
    """Runs `checks_for(step, ...)`; raises the first failing check's line (ToolFailure) so nothing starts."""
    checks = checks_for(step, **kwargs)
    for c in checks:
        if c.status == "fail":
            raise refusal(c, {**(c.detail or {}), "check": c.name, "checks": [x.model_dump() for x in checks]})
    return checks


def run_preflight(params: PreflightParams, *, cfg: Any = None, hardware: Any = None, nvml: Any = None,
                  turing_target: Path | None = None, protected_roots: list[Path] | None = None,
                  models_roots: list[Path] | None = None) -> PreflightReport:
    """Every check of `params.step`; never raises for what it finds (a failing check is a result), only for bad
    input (BadInput: an env_file that does not exist). `cfg`: a loaded serving config, instead of env_file."""
    if params.env_file is not None and not Path(params.env_file).expanduser().is_file():
        what = "is not a file" if Path(params.env_file).expanduser().exists() else "does not exist"
        raise BadInput(f"{param('env_file')} {params.env_file} {what}; pass an existing tpu.env", field="env_file")
    hw = hardware or Hardware()
    checks = checks_for(params.step, cfg=cfg, env_file=params.env_file, source=params.source, out=params.out,
                        hardware=hw, nvml=nvml, turing_target=turing_target, protected_roots=protected_roots,
                        model=params.model, port=params.port, instance=params.instance, repo_id=params.repo_id,
                        models_roots=models_roots)
    platform = hw.platform()
    failed = [c.name for c in checks if c.status == "fail"]
    warnings = [c.name for c in checks if c.status == "warn"]
    path = "GPU (CUDA)" if platform == "cuda" else "CPU (vLLM's CPU build)"
    if failed:
        first = next(c for c in checks if c.status == "fail")
        summary = f"not ready on the {path} path: {len(failed)} check(s) fail; first: {first.line()}"
    else:
        summary = (f"ready on the {path} path" + (f" with {len(warnings)} warning(s) ({', '.join(warnings)})"
                                                   if warnings else "")
                   + ("; GPU checks not applicable" if platform == "cpu" else ""))
    return PreflightReport(ready=not failed, platform=platform, step=params.step, checks=checks, failed=failed,
                           warnings=warnings, summary=summary)


__all__ = ["INPUT_CHECKS", "SOURCE_REPO", "Check", "PreflightParams", "PreflightReport", "Step", "checks_for", "ensure",
           "hf_token", "refusal", "run_preflight"]
