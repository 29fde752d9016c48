"""Deployment tools: check this machine before a step, fetch a checkpoint from the hub (tools/serving does the
work)."""

from __future__ import annotations

from tools.core.errors import ToolFailure
from tools.core.paths import PathNotAllowed
from tools.mcp.registry import Reply, tool
from tools.serving import (FetchParams, FetchResult, PreflightParams, PreflightReport, fetch_checkpoint as fetch,
                           run_preflight)


@tool(toolset="deploy", title="Preflight checks", params=PreflightParams, result=PreflightReport, read_only=True,
      idempotent=True, open_world=True, ops="doctor")  # step fetch asks the hub
def preflight(app, p: PreflightParams) -> Reply:
    """Check this machine and the serving config before a step: each check ok, warn, fail or n/a, with its fix.
    Writes nothing."""
    update = {"env_file": str(app.settings.env_file) if app.settings.env_file else None}
    if p.source:
        update["source"] = str(app.roots.confine(p.source, "models", what="source"))
    if p.out:
        update["out"] = str(app.roots.confine(p.out, "models", what="out"))
    try:
        cfg = app.config()
    except ToolFailure:  # reported as the failing `config` check
        cfg = None
    if p.model is not None:
        update["model"] = _model(app, p.model, cfg)
    report = run_preflight(p.model_copy(update=update), cfg=cfg,
                           protected_roots=[*app.roots.models, *app.roots.evidence],
                           models_roots=list(app.roots.models))
    return Reply(report, report.summary)


def _model(app, model: str, cfg) -> str:
    """The model as start_vllm_server resolves it (a folder under a models root, or a hub id); a missing folder is
    passed on for the checkpoints check to name it and how to make it."""
    also = (cfg.state_dir, cfg.instance_dir) if cfg is not None else ()
    try:
        return app.roots.confine_model(model, what="model", also_relative_to=also)
    except PathNotAllowed as exc:
        if exc.detail["problem"] != "missing":
            raise
        return str(app.roots.confine(model, "models", what="model"))


def _fetch_inputs(app, p: FetchParams) -> FetchParams:
    """The fetch confined to the models roots (none configured would mean an unconfined output)."""
    if not app.roots.models:
        raise ToolFailure("no models root is configured; start the server with --models-root DIR")
    return p.model_copy(update={"roots": [str(r) for r in app.roots.models]})


@tool(toolset="hub", title="Fetch a checkpoint from the hub", params=FetchParams, result=FetchResult, long=True,
      idempotent=True, open_world=True, check=_fetch_inputs, ops="fetch")
def fetch_checkpoint(app, p: FetchParams, progress, checked: FetchParams) -> Reply:
    """Download a Hugging Face model's build files at a revision into a models root (`out`, default: the repo's
    name), with a sha256 manifest; resumes from the hub cache. Long: progress in bytes."""
    res = fetch(checked, progress=progress)
    state = "already there" if res.already_present else ("from the cache" if res.offline else "fetched")
    return Reply(res, f"{res.repo_id}@{res.commit[:12]} {state}: {res.out} ({len(res.files)} files, "
                      f"{res.total_bytes / 2**30:.2f} GiB)")
