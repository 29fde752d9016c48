"""A source checkpoint folder: config, shards (single file or indexed), tensor table, side files.

Every file is opened through the same checks: a link must not lead outside the checkpoint folder (or, when
roots are given, outside them), a symlink loop is named as one, and each shard header is checked as the
safetensors format defines it (safetensors_io.read_header) before any tensor byte is read.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from tools.core import paths
from tools.core.paths import confinement

from ..errors import RepackError, clip, core_refusals
from ..family import config as cfgmod
from ..family.drafter import is_drafter
from .safetensors_io import (SafetensorsHeader, TensorInfo, Within, loads_json, open_confined, open_error,
                             read_header)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MM_PREFIX = "model.language_model."
MAX_JSON_FILE = 64 << 20  # a config or an index is kilobytes; anything this big is not one


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    shards: list[SafetensorsHeader]  # in file-name order
    tensors: dict[str, TensorInfo]
    within: Within = ()  # where the files read may lie (the folder, and the roots if given)

    @property
    def drafter(self) -> bool:
        """A gemma4_assistant drafter: a text_config, but its own layout (repack.family.drafter)."""
        return is_drafter(self.config)

    @property
    def multimodal(self) -> bool:
        return isinstance(self.config.get("text_config"), dict) and not self.drafter

    def side_files(self) -> list[Path]:
        """Files carried along unchanged: tokenizer, chat template, generation config and the like.

        A link among them is followed only inside the folder (and the roots): its content is copied into the
        output, where it could be read back."""
        skip = {INDEX, SINGLE, "config.json", "repack-report.json"}
        shard_names = {s.path.name for s in self.shards}
        return _folder_files(self.path, self.within, lambda name: not (
            name in skip or name in shard_names or name.endswith(".safetensors")))


def _folder_files(folder: Path, within: Within, wanted: Callable[[str], bool] = lambda name: True) -> list[Path]:
    """The files directly in `folder` whose names are `wanted` (hidden ones and folders aside), each opened through
    open_confined: a symlink loop, a broken link or a link outside `within` is refused."""
    with core_refusals():
        return paths.folder_files(folder, within, wanted)


def check_files(src: str | Path, roots: Sequence[str | Path] | None = None) -> None:
    """Every file a server would load from the checkpoint folder `src` (config, weights, tokenizer, templates)
    passes the checks open_checkpoint and the build apply, each weight file's safetensors header and size included
    (a file cut short by a stopped download); raises RepackError naming the first that does not.

    For callers that hand the folder to another reader (vLLM): it follows links wherever they lead."""
    within = confinement(src, roots)
    for f in _folder_files(Path(src), within):
        if f.name.endswith(".safetensors"):
            read_header(f, within)  # the header only: seconds for any checkpoint


def _read_json(path: Path, within: Within, what: str) -> Any:
    fd = open_confined(path, within)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_JSON_FILE:
            raise RepackError(f"{clip(path)}: {size:,} bytes, too large to be {what}; re-download it",
                              {"file": clip(path), "problem": "too-large"})
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read()
    except OSError as e:
        raise open_error(path, e) from None
    finally:
        os.close(fd)
    return loads_json(raw, clip(path))


def check_source_folder(src: Path) -> None:
    """Raises RepackError unless `src` is an existing folder (the first check of open_checkpoint)."""
    try:
        st = os.stat(src)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RepackError(f"{clip(src)}: a symlink loop, not a folder; pass the folder of a downloaded "
                              f"checkpoint", {"file": clip(src), "problem": "symlink-loop"}) from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise RepackError(f"{clip(src)}: no such folder; pass the folder of a downloaded checkpoint",
                              {"file": clip(src), "problem": "missing"}) from None
        raise RepackError(f"{clip(src)}: cannot be read ({e.strerror or e}); pass the folder of a downloaded "
                          f"checkpoint", {"file": clip(src), "problem": "unreadable"}) from None
    except ValueError:  # an embedded NUL
        raise RepackError(f"{clip(src)}: not a valid path; pass the folder of a downloaded checkpoint") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RepackError(f"{clip(src)}: not a folder; pass the checkpoint folder that holds config.json",
                          {"file": clip(src), "problem": "not-a-folder"})


def read_config(src: Path, within: Within = ()) -> dict[str, Any]:
    """The checkpoint folder's config.json, read confined to `within`: a JSON object of a Gemma 4 config (the
    first thing open_checkpoint reads); raises RepackError."""
    cfg_path = src / "config.json"
    try:
        os.lstat(cfg_path)
    except OSError as e:
        if e.errno != errno.ENOENT:  # a folder that cannot be searched does not lack config.json: say why
            raise open_error(cfg_path, e) from None
        raise RepackError(f"{clip(src)}: no config.json; pass the folder of a Hugging Face checkpoint",
                          {"file": clip(cfg_path), "problem": "missing"}) from None
    config = _read_json(cfg_path, within, "a config.json")
    if not isinstance(config, dict):
        raise RepackError(f"{clip(cfg_path)}: not valid JSON (not an object); re-download it",
                          {"file": clip(cfg_path), "problem": "bad-json"})
    cfgmod.validate(config, clip(cfg_path))
    return config


def open_checkpoint(src: str | Path, roots: Sequence[str | Path] | None = None) -> Checkpoint:
    """Reads a checkpoint's config and every shard header; raises RepackError on anything unusable.

    roots: when given (the MCP server's models roots), every file read must resolve inside one of them too."""
    src = Path(src)
    check_source_folder(src)
    within = confinement(src, roots)

    config = read_config(src, within)
    cfg_path = src / "config.json"

    index_path = src / INDEX
    if os.path.lexists(index_path):
        index = _read_json(index_path, within, "a safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not (isinstance(weight_map, dict) and all(isinstance(v, str) and v and "\0" not in v
                                                      for v in weight_map.values())):
            raise RepackError(f"{clip(index_path)}: not a valid safetensors index (weight_map must map tensor "
                              f"names to shard file names); re-download it",
                              {"file": clip(index_path), "problem": "bad-index"})
        # one file may be spelled two ways (./model.safetensors, model.safetensors): read it once
        weight_map = {name: os.path.normpath(f) for name, f in weight_map.items()}
        files = sorted(set(weight_map.values()))
        for f in files:
            if not os.path.lexists(src / f):
                raise RepackError(f"{clip(index_path)}: names shard {clip(f)}, which is missing; re-download the "
                                  f"checkpoint", {"file": clip(index_path), "problem": "missing-shard"})
    elif os.path.lexists(src / SINGLE):
        weight_map, files = None, [SINGLE]
    else:
        raise RepackError(f"{clip(src)}: no {SINGLE} and no {INDEX}; pass a folder with safetensors weights",
                          {"file": clip(src), "problem": "no-weights"})

    shards = [read_header(src / f, within) for f in files]
    tensors: dict[str, TensorInfo] = {}
    for sh in shards:
        for name, info in sh.tensors.items():
            if name in tensors:
                raise RepackError(f"{clip(sh.path)}: tensor {clip(name)} also appears in "
                                  f"{clip(tensors[name].file.name)}; re-download the checkpoint",
                                  {"file": clip(sh.path), "tensor": clip(name), "problem": "duplicate"})
            tensors[name] = info
    if not tensors:  # else the build writes an empty checkpoint and reports success
        where, verb = (index_path, "lists") if weight_map is not None else (src / SINGLE, "holds")
        raise RepackError(f"{clip(where)}: {verb} no tensors; pass a checkpoint with weights, or re-download it",
                          {"file": clip(where), "problem": "no-tensors"})
    if weight_map is not None:
        for name, f in weight_map.items():
            if name not in tensors or tensors[name].file.name != Path(f).name:
                raise RepackError(f"{clip(index_path)}: lists {clip(name)} in {clip(f)}, but that shard does not "
                                  f"hold it; re-download the checkpoint",
                                  {"file": clip(index_path), "tensor": clip(name), "problem": "index-mismatch"})
    ck = Checkpoint(src, config, shards, tensors, within)
    _check_layout(ck, cfg_path)
    return ck


def _check_layout(ck: Checkpoint, cfg_path: Path) -> None:
    """The config and the tensor names must agree on multimodal vs text-only: the build renames, drops and
    quantizes by those names, and a mismatch would pass the text model through under the wrong ones."""
    mm = next((n for n in ck.tensors if n.startswith(MM_PREFIX)), None)
    if mm is not None and not ck.multimodal:
        raise RepackError(f"{clip(cfg_path)}: has no text_config, but the weights are a multimodal checkpoint's "
                          f"(tensor {clip(mm)}); use the config.json that came with these weights",
                          {"file": clip(cfg_path), "tensor": clip(mm), "problem": "no-text-config"})
    if ck.multimodal and mm is None and any(n.startswith("model.") and not n.startswith(cfgmod.TOWER_PREFIXES)
                                            for n in ck.tensors):
        raise RepackError(f"{clip(cfg_path)}: has a text_config (a multimodal checkpoint), but no tensor is named "
                          f"{MM_PREFIX}*; use the config.json that came with these weights",
                          {"file": clip(cfg_path), "problem": "text-config-without-weights"})


def check_unique_outputs(pairs: Iterable[tuple[str, str]], where: Path) -> None:
    """Refuses a build in which two source tensors would be written under one name: (source name, output name)."""
    seen: dict[str, str] = {}
    for source, out in pairs:
        first = seen.setdefault(out, source)
        if first != source:
            raise RepackError(f"{clip(where)}: tensors {clip(first, 100)} and {clip(source, 100)} would both be "
                              f"written as {clip(out, 100)}; remove the stray one from the checkpoint",
                              {"file": clip(where), "tensor": clip(source), "problem": "duplicate-output"})
