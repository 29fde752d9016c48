"""The checks of the build a start serves: its folder (there, a checkpoint, one vLLM can inspect here), its length
limit against MAX_MODEL_LEN, and the dtype its repack chose its scales for against the dtype it will be served at.
Each is a preflight check (tools.serving.preflight.checks' Check, over its Context)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from repack.errors import RepackError
from repack.source.checkpoint import check_files
from tools.core.errors import op, param
from tools.core.paths import inside_any
from tools.serving.preflight.checks import Check, Context
from tools.serving.preflight.model_files import (chat_prompt_tokens, is_built, is_local, missing_model_fix,
                                                 model_position_limit, repack_target)

# A chat template renders tens of tokens for one short message: only a max_model_len this small is worth loading
# the tokenizer for (a second for Gemma's 262k vocabulary).
CHAT_CHECK_BELOW = 4096


def check_max_model_len(ctx: Context) -> Check:
    if ctx.cfg is None:
        return Check(name="max_model_len", status="n/a", value="no configuration")
    cfg = ctx.cfg
    limit = model_position_limit(cfg.model)
    detail = {"max_model_len": cfg.max_model_len, "model_limit": limit, "source": cfg.sources.get("max_model_len")}
    if limit is None:
        return Check(name="max_model_len", status="n/a", detail=detail,
                     value=f"MAX_MODEL_LEN {cfg.max_model_len}; {cfg.model} has no local config.json to compare")
    if cfg.max_model_len <= limit:
        chat = chat_prompt_tokens(cfg.model) if cfg.max_model_len <= CHAT_CHECK_BELOW else None
        if chat is not None and chat + 1 > cfg.max_model_len:
            at = param("max_model_len", cfg.max_model_len)
            return Check(name="max_model_len", status="fail", detail={**detail, "chat_tokens": chat,
                                                                       "parameter": "max_model_len"},
                         value=f"{at} cannot hold a chat request: the build's chat template renders {chat} tokens "
                               "for a one-word message, before any reply",
                         fix=f"pass a larger {param('max_model_len')} than {chat}")
        return Check(name="max_model_len", status="ok", detail=detail,
                     value=f"MAX_MODEL_LEN {cfg.max_model_len} within the model's limit {limit}")
    if cfg.given_for_this_start("max_model_len"):
        return Check(name="max_model_len", status="fail", detail=detail,
                     value=f"max_model_len {cfg.max_model_len} is above the model's own limit "
                           f"(max_position_embeddings={limit} in {cfg.model}/config.json)",
                     fix=f"pass at most {limit}")
    return Check(name="max_model_len", status="warn", detail=detail,
                 value=f"MAX_MODEL_LEN {cfg.max_model_len} from {cfg.env_file} is above the model's limit {limit}: "
                       f"start serves at {limit}",
                 fix=f"set MAX_MODEL_LEN={limit} in tpu.env to serve what you configure")


_DTYPE_NAMES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float": "float32",
                "float32": "float32"}


def check_runtime_dtype(ctx: Context) -> Check:
    """A build's scales reproduce its source's values as the runtime dtype its repack targeted computes them
    (repack-report.json's target_dtype): served at another dtype, its values are not the ones the repack checked."""
    if ctx.cfg is None:
        return Check(name="runtime_dtype", status="n/a", value="no configuration")
    cfg = ctx.cfg
    cuda = ctx.platform == "cuda"
    key, given = ("DTYPE", cfg.dtype) if cuda else ("CPU_DTYPE", cfg.cpu_dtype)
    runs = _DTYPE_NAMES.get(given)
    target = repack_target(cfg.model)
    detail = {"target_dtype": target, "serves_as": given, "setting": key}
    if target is None:
        return Check(name="runtime_dtype", status="n/a", detail=detail,
                     value=f"{cfg.model} has no repack report naming the dtype its scales were chosen for")
    if runs is None:  # auto: vLLM picks from the config, whatever the repack targeted
        return Check(name="runtime_dtype", status="n/a", detail=detail,
                     value=f"{key}={given}: vLLM picks the dtype; {cfg.model}'s scales were chosen for {target}")
    if runs == target:
        return Check(name="runtime_dtype", status="ok", detail=detail,
                     value=f"served as {runs} ({key}), the dtype {cfg.model}'s scales were chosen for")
    fix = (f"rebuild it with target_dtype {runs} (repack_checkpoint / `python3 -m repack build --target-dtype "
           f"{runs}`)" + ("" if cuda and target == "bfloat16" else f", or serve it with {key}={target}"))
    if cuda and target == "bfloat16":
        fix += ": a T4 computes in float16"
    return Check(name="runtime_dtype", status="warn", detail=detail, fix=fix,
                 value=f"{cfg.model} was repacked for {target} and this start serves it as {runs} ({key}={given}): "
                       f"its runtime values are not the ones the repack checked")




def _inside_roots(model: Path, roots: list[Path]) -> Path:
    """Where to build `model`: its own folder when under a models root, else the first root's folder of its name."""
    if not roots or inside_any(model.resolve(), [r.resolve() for r in roots]):
        return model
    return roots[0] / model.name


def check_checkpoints(ctx: Context, *, step: str) -> Check:
    """Which of source / builds exist. Serving a missing local build fails `start`; elsewhere it is what comes."""
    cfg = ctx.cfg
    if cfg is None:
        return Check(name="checkpoints", status="n/a", value="no configuration")
    source = cfg.source_checkpoint
    builds = sorted(str(p) for root in ctx.models_roots if root.is_dir() for p in root.iterdir() if is_built(p))
    src_state = ("not set" if not source else f"{source} ({'present' if is_built(source) else 'missing'})")
    detail = {"source": source or None, "source_present": bool(source) and is_built(source), "builds": builds,
              "model": cfg.model, "model_present": is_built(cfg.model)}
    value = (f"source {src_state}; builds in {', '.join(map(str, ctx.models_roots))}: "
             f"{', '.join(Path(b).name for b in builds) or 'none'}")
    if not is_local(cfg.model):
        return Check(name="checkpoints", status="ok", detail=detail,
                     value=value + f"; MODEL_NAME {cfg.model} is a hub id vLLM fetches")
    if is_built(cfg.model):
        try:  # vLLM follows a link wherever it leads: the folder's files pass the checks probe and repack make
            check_files(cfg.model)
        except RepackError as exc:
            return Check(name="checkpoints", status="fail" if step == "start" else "warn",
                         detail={**detail, **(exc.detail or {})}, value=f"model {cfg.model}: {exc}",
                         fix="or point MODEL_NAME at another build")
        towers = _needs_torchvision(cfg.model)
        if towers is not None:  # vLLM inspects such a model with torchvision, --language-model-only or not
            text = str(Path(cfg.model).parent / f"{Path(cfg.model).name}-text")
            return Check(name="checkpoints", status="fail" if step == "start" else "warn",
                         detail={**detail, "architecture": towers},
                         value=f"model {cfg.model} is {towers} (vision and audio towers), which vLLM inspects with "
                               "torchvision, not installed here",
                         fix="serve a text-only build of it: "
                             + op("repack", source=cfg.model, output=text, text_only=True))
        return Check(name="checkpoints", status="ok", detail=detail, value=value + f"; serving {cfg.model}")
    where = "MODEL_NAME in " + str(cfg.env_file) if cfg.sources.get("model") == "file" else param("model")
    into = _inside_roots(Path(cfg.model), ctx.models_roots)
    fix = missing_model_fix(str(into), ctx.platform)
    if into != Path(cfg.model):  # a repack into the configured folder would be refused: the roots hold the builds
        fix += f"; {cfg.model} is outside the models roots: serve the build with {op('start', model=str(into))}"
    model = Path(cfg.model)
    if model.exists() and not model.is_dir():  # a file or a device: nothing to build into either
        return Check(name="checkpoints", status="fail" if step == "start" else "warn", detail=detail,
                     value=f"model {cfg.model} is not a folder ({where})",
                     fix="point MODEL_NAME (or --model) at a build's folder or a Hugging Face id")
    if not model.is_dir():
        return Check(name="checkpoints", status="fail" if step == "start" else "warn", detail=detail,
                     value=f"model folder {cfg.model} does not exist ({where})", fix=fix)
    if any(model.iterdir()):  # a folder with files of its own is no place to build into
        fix = "point MODEL_NAME (or --model) at a build's folder (one with config.json) or a Hugging Face id"
    # A folder without config.json is no checkpoint vLLM loads (it would fail tens of seconds in): refused at once
    # by a start, what comes for the other steps.
    if step == "start":
        return Check(name="checkpoints", status="fail", detail=detail, fix=fix,
                     value=f"model folder {cfg.model} has no config.json, so it is not a checkpoint ({where})")
    return Check(name="checkpoints", status="warn", detail=detail, value=value + f"; {cfg.model} has no config.json",
                 fix=fix)


def _needs_torchvision(model: str) -> str | None:
    """The multimodal architecture a local checkpoint's config names (…ForConditionalGeneration) when torchvision,
    which vLLM's model inspection of it imports, is not installed; else None."""
    try:
        archs = json.loads((Path(model) / "config.json").read_text()).get("architectures")
    except (ValueError, RecursionError, OSError, AttributeError):
        return None
    multimodal = [a for a in archs if isinstance(a, str) and a.endswith("ForConditionalGeneration")] \
        if isinstance(archs, list) else []
    if not multimodal or importlib.util.find_spec("torchvision") is not None:
        return None
    return multimodal[0]


__all__ = ["CHAT_CHECK_BELOW", "check_checkpoints", "check_max_model_len", "check_runtime_dtype"]
