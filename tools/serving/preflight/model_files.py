"""What a local checkpoint folder says about serving it: its context limit, its embedding method, its size."""

from __future__ import annotations

import json
from pathlib import Path

from repack.source.checks import SOURCE_REPO
from repack.family.config import text_of
from repack.family.members import MEMBERS
from tools.core.errors import op
from tools.serving.config import looks_like_path

TINY_SOURCE = "tiny-gemma4-qat"  # the stand-in source's folder name the remedies suggest


def model_position_limit(model: str) -> int | None:
    """The longest context a local checkpoint's config allows (max_position_embeddings, top level or in
    text_config); None for a hub id or a config that does not say."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, RecursionError, OSError):
        return None
    if not isinstance(cfg, dict):
        return None
    for source in (text_of(cfg, whole=False), cfg):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def is_built(model: str | Path) -> bool:
    """A folder with a config.json: a checkpoint vLLM loads (or one being made)."""
    return (Path(model) / "config.json").is_file()


def is_local(model: str) -> bool:
    """MODEL_NAME names a folder here (a path, or what exists), not a hub id."""
    return looks_like_path(model) or Path(model).exists()


def repack_target(model: str) -> str | None:
    """The runtime dtype a local build's scales were chosen for (repack-report.json's target_dtype: float16 or
    bfloat16); None for a hub id, a folder without the report or a report that does not say."""
    try:
        report = json.loads((Path(model) / "repack-report.json").read_text())
    except (ValueError, RecursionError, OSError):
        return None
    target = report.get("target_dtype") if isinstance(report, dict) else None
    return target if target in ("float16", "bfloat16") else None


def _tokenizer_config(folder: Path) -> dict:
    try:
        tc = json.loads((folder / "tokenizer_config.json").read_text())
    except (ValueError, RecursionError, OSError):
        return {}
    return tc if isinstance(tc, dict) else {}


def chat_template(folder: Path, tc: dict | None = None) -> str | None:
    """The build's chat template as vLLM reads it: chat_template.jinja, else chat_template.json's (the processor's
    file), else tokenizer_config.json's (`tc`, read when not given: a string, or the one named "default" of a
    list). None when the build ships none."""
    f = folder / "chat_template.jinja"
    if f.is_file():
        try:
            return f.read_text()
        except (OSError, UnicodeDecodeError):
            return None
    try:
        t = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    except (ValueError, RecursionError, OSError, AttributeError):
        t = None
    if not isinstance(t, str):
        t = (_tokenizer_config(folder) if tc is None else tc).get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) and t else None


def chat_prompt_tokens(model: str) -> int | None:
    """How many tokens the build's own chat template renders for a one-word user message with the generation
    prompt: the least any chat request to it takes. None when the folder has no tokenizer.json or template, or the
    template does not render here (vLLM then judges). Rendered as transformers renders it (a sandboxed jinja2,
    trim_blocks and lstrip_blocks), tokenized with `tokenizers` alone: well under a second, where importing
    transformers takes 5-15 s."""
    folder = Path(model)
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        tc = _tokenizer_config(folder)
        template = chat_template(folder, tc)
        if template is None:
            return None
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        from tokenizers import Tokenizer

        special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in tc.items()
                   if k in ("bos_token", "eos_token") and isinstance(v, (str, dict))}

        def raise_exception(message):
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "")
        text = env.from_string(template).render(messages=[{"role": "user", "content": "hi"}],
                                                add_generation_prompt=True, **special)
        return len(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text, add_special_tokens=False).ids)
    except Exception:  # a template or tokenizer this cannot read: not a reason to refuse a start
        return None


def embedding_method(model: str) -> str | None:
    """On CUDA vLLM does not log the embedding method: read it from a local checkpoint's quantization config."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    try:
        qc = json.loads(path.read_text()).get("quantization_config") or {}
    except ValueError:
        return None
    for group in (qc.get("config_groups") or {}).values():
        if any(t == "Embedding" or "embed" in str(t).lower() for t in group.get("targets", [])):
            return "CompressedTensorsEmbeddingWNA16Int"
    return "VocabParallelEmbedding (unquantized)"


def checkpoint_bytes(model: str) -> int | None:
    """Size of a local checkpoint's weight files; None for a hub id (not downloaded here)."""
    path = Path(model)
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) or None


def make_source(source: str, platform: str) -> str:
    """The operation (op() marks) that makes a missing source folder: a folder named as a member's published QAT
    checkpoint is fetched from that repository on any machine (a stand-in under a real checkpoint's name would be
    taken for it); otherwise on CPU the tiny stand-in, on a GPU the fetched E2B checkpoint."""
    name = Path(source).name.lower()
    for m in MEMBERS.values():
        if name == m.source_repo.split("/")[-1].lower():
            return op("fetch", repo_id=m.source_repo, out=source)
    return op("tiny_model", out=source) if platform == "cpu" else op("fetch", repo_id=SOURCE_REPO, out=source)


def missing_model_fix(model: str, platform: str) -> str:
    """How to make a missing model folder, with op() marks: a source, then the repack into it (or the demo, which
    does both for both builds)."""
    source = TINY_SOURCE if platform == "cpu" else "SOURCE"
    return (f"make a source with {make_source(source, platform)}, build it with "
            f"{op('repack', source=source, output=model)} (or run {op('demo')}), or point MODEL_NAME at a build "
            "or a Hugging Face id")


__all__ = ["TINY_SOURCE", "chat_prompt_tokens", "chat_template", "checkpoint_bytes", "embedding_method", "is_built",
           "is_local", "make_source", "missing_model_fix", "model_position_limit", "repack_target"]
