"""lm-eval tasks before lm-eval runs: task names and offline datasets checked in about a second (lm-eval itself
indexes ~15,000 task YAMLs first), and the project's own tiny_pattern tasks, built from the tiny test model's
pattern (`python -m tools.measure.evals.tasks --write-tiny-tasks` rewrites their data files)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

from repack.stand_ins.tiny_model import FIRST_BYTE_ID, pattern_permutation
from tools.core.errors import BadInput, ToolFailure
from tools.measure.evals.results import TASKS_DIR, EvalParams


def unknown_tasks_message(names: str, params: EvalParams) -> str:
    where = params.include_path or str(TASKS_DIR)
    return (f"unknown lm-eval task(s): {names}; see `python -m lm_eval ls tasks` or put a task YAML in the include "
            f"folder ({where})")


def offline_hint() -> tuple[bool, str]:
    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
    return offline, ("run once online so the datasets cache holds it, or unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE"
                     if offline else "check the task's dataset_path/data_files and the network")


def _yaml_load(data: bytes) -> Any:
    """lm-eval task YAML without running it: `!function` and other tags load as None."""
    import yaml  # PyYAML comes with lm-eval

    class TagsIgnored(yaml.SafeLoader):
        pass

    TagsIgnored.add_multi_constructor("", lambda loader, suffix, node: None)
    return yaml.load(data, Loader=TagsIgnored)  # noqa: S506 (a SafeLoader)


def _task_yamls(root: Path) -> list[Path]:
    # The files lm-eval indexes: every *.yaml under the folder.
    return sorted(p for p in root.glob("**/*.yaml") if not ({"__pycache__", ".ipynb_checkpoints"} & set(p.parts)))


def _read_task_yaml(path: Path, seen: frozenset[Path] = frozenset()) -> dict[str, Any] | None:
    """A task YAML with its `include:` files merged as lm-eval merges them; None when it cannot be read."""
    path = path.resolve()
    if path in seen:
        return None
    try:
        cfg = _yaml_load(path.read_bytes())
    except Exception:  # unreadable or not YAML: lm-eval will say so itself
        return None
    if not isinstance(cfg, dict):
        return None
    if "include" not in cfg:
        return cfg
    includes = cfg.pop("include")
    merged: dict[str, Any] = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        base = _read_task_yaml(path.parent / str(inc), seen | {path})
        if base is None:
            return None
        base.pop("task_list", None)
        merged.update(base)
    merged.update(cfg)
    return merged


def _lm_eval_tasks_dir() -> Path | None:
    spec = importlib.util.find_spec("lm_eval")  # finds the package without importing it (datasets, torch)
    if spec is None or not spec.submodule_search_locations:
        return None
    tasks = Path(list(spec.submodule_search_locations)[0]) / "tasks"
    return tasks if tasks.is_dir() else None


def _hub_dataset_cached(repo_id: str) -> bool:
    """Whether a hub dataset may be in a local cache (the datasets cache, or the hub's) for an offline load.

    Errs towards yes: any cache entry whose name ends with the dataset's name counts."""
    hf_home = Path(os.path.expanduser(os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")))
    caches = [Path(os.path.expanduser(os.environ.get("HF_DATASETS_CACHE") or hf_home / "datasets")),
              Path(os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
                                      or hf_home / "hub"))]
    name = repo_id.rsplit("/", 1)[-1].lower()
    for cache in caches:
        try:
            if any(e.name.lower().endswith(name) for e in cache.iterdir()):
                return True
        except OSError:
            continue
    return False


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name no file can have (too long, NUL): not a file
        return False


def check_tasks_before_running(params: EvalParams, include: Path) -> None:
    """Refuses, from the task YAMLs' text, what lm-eval would refuse only after indexing all of them: task names that occur in no task YAML, and, offline, a task of the include folder whose
    hub dataset is in no local cache. One-sided: anything it cannot rule out is left for lm-eval to judge."""
    texts = {p: p.read_bytes() for p in _task_yamls(include) if p.is_file()}
    unknown = []
    for name in params.tasks:
        # Glob patterns, YAML files and folders are lm-eval's to resolve.
        if any(c in name for c in "*?[") or name.endswith(".yaml") or _exists(include / name):
            continue
        needle = name.encode()
        if any(needle in t for t in texts.values()):
            continue
        builtin = _lm_eval_tasks_dir()
        if builtin is None:
            return
        if not any(needle in p.read_bytes() for p in _task_yamls(builtin) if p.is_file()):
            unknown.append(name)
    if unknown:
        raise BadInput(unknown_tasks_message(", ".join(unknown), params), {"unknown_tasks": unknown})
    offline, hint = offline_hint()
    if not offline:
        return
    for path in texts:
        cfg = _read_task_yaml(path)
        if not cfg or cfg.get("task") not in params.tasks or "class" in cfg or "group" in cfg:
            continue
        ds, kwargs = cfg.get("dataset_path"), cfg.get("dataset_kwargs") or {}
        # Only `namespace/name` hub ids: packaged builders (json, csv...) and legacy names have no '/'.
        if (not isinstance(ds, str) or ds.count("/") != 1 or ds.startswith(("/", ".", "~"))
                or (include / ds).exists() or not isinstance(kwargs, dict) or "cache_dir" in kwargs):
            continue
        if not _hub_dataset_cached(ds):
            raise ToolFailure(f"a task's dataset cannot be loaded offline: task {cfg['task']} reads the hub "
                              f"dataset {ds}, which no local cache holds; {hint}",
                              {"task": cfg["task"], "dataset_path": ds, "yaml": str(path)})


# ----------------------------------------------------------------------------------------------------------
# The project's own tasks: the tiny test model's pattern


def tiny_pattern_docs(seed: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Documents for the tiny model's training pattern (token t is followed by perm[t]).

    Printable ASCII characters c whose successor perm[c] is printable too: a multiple-choice item per c (the
    successor among four characters, chance 1/4) and a generation item per c (the next character, greedy).
    """

    perm = pattern_permutation(seed)
    printable = [chr(b) for b in range(0x21, 0x7F)]
    pairs = [(c, chr(int(perm[FIRST_BYTE_ID + ord(c)]) - FIRST_BYTE_ID)) for c in printable
             if 0x21 <= int(perm[FIRST_BYTE_ID + ord(c)]) - FIRST_BYTE_ID < 0x7F]
    rng = random.Random(seed)
    mc, gen = [], []
    for c, nxt in pairs:
        choices = rng.sample([x for x in printable if x != nxt], 3)
        label = rng.randrange(4)
        choices.insert(label, nxt)
        mc.append({"context": c, "choices": choices, "label": label})
        gen.append({"context": c, "target": nxt})
    return mc, gen


def write_tiny_pattern_tasks(folder: Path = TASKS_DIR / "tiny_pattern", seed: int = 0) -> None:
    """(Re)writes the JSONL files the tiny_pattern task YAMLs read."""
    mc, gen = tiny_pattern_docs(seed)
    for name, docs in (("tiny_pattern_mc.jsonl", mc), ("tiny_pattern_gen.jsonl", gen)):
        (folder / name).write_text("".join(json.dumps(d) + "\n" for d in docs))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m tools.measure.evals.tasks")
    ap.add_argument("--write-tiny-tasks", action="store_true",
                    help="regenerate tools/measure/tasks/tiny_pattern/*.jsonl from the tiny model's pattern")
    if ap.parse_args().write_tiny_tasks:
        write_tiny_pattern_tasks()
