"""Fetch a checkpoint from the Hugging Face hub into the models root: only what a build needs, resumable,
published atomically, with sizes and sha256 hashes recorded.

    ./vllm-t4 fetch REPO_ID [--revision R] [--out DIR]

Downloads go through `huggingface_hub` into its own cache (HF_HUB_CACHE / HF_HOME): a dropped connection is
resumed inside the fetch (huggingface_hub retries with a ranged GET from the bytes it has), and a fetch run again
after a failure takes every file it completed from the cache; huggingface_hub 2.4 discards a file it could not
finish, so that one starts over. No partial folder ever sits in the models root. Once every file is in the cache,
the output is assembled in a hidden temporary folder beside it (hard links to the cache's blobs, copies across
filesystems), `fetch-manifest.json` is written, and the folder is renamed into place. With HF_HUB_OFFLINE=1 the
revision is resolved from the cache alone. HF_ENDPOINT, HF_HUB_CACHE and HF_HOME are read at each call.

Exit status: 0 fetched (or already there), 1 the fetch failed (network, gated, disk: the line says what to do),
2 bad input (a repo id with path tricks, a revision that is not a branch, tag or commit, an output outside the roots
or already holding something else).
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, ClassVar

from pydantic import BaseModel, Field

from tools.core.atomic import atomic_directory
from tools.core.atomic_files import refusal
from tools.core.atomic_leftovers import sweep_stale_partials
from tools.core.errors import BadInput, ToolFailure, param
from tools.core.output_check import check_output_folder
from tools.core.params import OpParams
from tools.core.paths import PathNotAllowed, Roots, inside
from tools.core.root import PROJECT_ROOT
from tools.core.progress import Progress
from tools.core import clock
from repack.source import checks as repack_checks
from repack.family.members import MEMBERS, by_name
from tools.serving.hub.access import hf_token, hub_env, hub_failure

MANIFEST = "fetch-manifest.json"
# What a build reads: weights, their index, the model and generation configs, the tokenizer and chat template.
BUILD_FILES = ("*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json",
               "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
               "chat_template.jinja", "chat_template.json", "processor_config.json", "preprocessor_config.json")
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_-])?"
REPO_ID = re.compile(rf"^{_NAME}/{_NAME}$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# A git branch or tag name as the hub accepts it (refs/pr/N included): no '..', no '//', no control characters.
REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,254}$")
DISK_MARGIN_BYTES = 512 << 20


class FetchParams(OpParams):
    repo_id: str = Field(description="Hugging Face model id, owner/name (e.g. "
                                     "google/gemma-4-E2B-it-qat-q4_0-unquantized), or a Gemma 4 member "
                                     "(E2B, E4B, 12B, 26B-A4B, 31B: Google's QAT checkpoint of it)")
    revision: str = Field("main", description="Branch, tag or 40-hex commit to fetch")
    out: str | None = Field(None, description="Output folder (default: <models root>/<repo name>); must not exist "
                                              "unless it holds this same fetch")
    roots: list[str] | None = Field(None, description="Allowed models roots: the output must resolve inside one "
                                                      "(relative outputs resolve against the first)")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("repo_id",)
    CLI_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"roots"})  # the MCP server passes its models roots
    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"roots"})


class FetchedFile(BaseModel):
    path: str = Field(description="File name inside the output folder")
    size: int = Field(description="Size in bytes")
    sha256: str = Field(description="sha256 of the published file (checked against the hub's LFS hash when it has one)")


class FetchResult(BaseModel):
    repo_id: str = Field(description="The repo fetched")
    revision: str = Field(description="The revision asked for")
    commit: str = Field(description="The commit it resolved to")
    out: str = Field(description="The published folder")
    files: list[FetchedFile] = Field(description="Every published file, with size and sha256")
    total_bytes: int = Field(description="Bytes published")
    offline: bool = Field(description="True when resolved from the huggingface_hub cache alone (HF_HUB_OFFLINE=1)")
    already_present: bool = Field(False, description="True when the output already held this commit: nothing done")
    cache_dir: str = Field(description="The huggingface_hub cache that holds (and resumes) the downloads")
    manifest: str = Field(description="Path of fetch-manifest.json in the output")
    wall_s: float = Field(description="Seconds the fetch took")


# ----------------------------------------------------------------------------------------------------------------
# Input

def check_repo_id(repo_id: str) -> str:
    """owner/name as given, or a Gemma 4 member's name (E2B, E4B, 12B, 26B-A4B, 31B) as Google's QAT checkpoint
    of it."""
    text = repo_id.strip()
    if "/" not in text and text.lower() in {m.lower() for m in MEMBERS}:
        return by_name(text).source_repo
    if text.startswith("/") or ".." in text or text.count("/") != 1 or not REPO_ID.match(text):
        raise BadInput(f"repo id {repo_id!r} is not owner/name (letters, digits, '.', '_', '-'; no '..', no leading "
                       f"'/', one '/'): pass it as on https://huggingface.co/OWNER/NAME, or a member: "
                       f"{', '.join(MEMBERS)}")
    return text


def check_revision(revision: str) -> str:
    text = revision.strip()
    if COMMIT.match(text):
        return text
    if (not REF.match(text) or ".." in text or "//" in text or text.endswith(("/", ".", ".lock"))
            or "@{" in text):
        raise BadInput(f"revision {revision!r} is not a branch, tag or 40-hex commit: pass e.g. main, v1.0 or the "
                       "full commit hash")
    return text


def resolve_out(params: FetchParams, repo_id: str) -> Path:
    name = repo_id.split("/")[1]
    if params.roots:
        roots = Roots(models=tuple(Path(os.path.realpath(Path(r).expanduser())) for r in params.roots))
        try:
            return roots.confine(params.out or name, "models", what="output")
        except PathNotAllowed as exc:
            raise BadInput(str(exc)) from None
    out = Path(params.out).expanduser() if params.out else PROJECT_ROOT / "models" / name
    return Path(os.path.realpath(out))


def _protected(params: FetchParams) -> list[Path]:
    """Folders a fetch never replaces: the models roots (the caller's, else the environment's), home, cwd."""
    roots = [Path(r).expanduser() for r in params.roots] if params.roots else list(Roots.from_env().models)
    return [Path(os.path.realpath(p)) for p in (*roots, Path.home(), Path.cwd())]


def wanted(name: str) -> bool:
    """A top-level file a build reads."""
    return "/" not in name and any(fnmatch.fnmatch(name, p) for p in BUILD_FILES)


# ----------------------------------------------------------------------------------------------------------------
# Progress in bytes: huggingface_hub drives a tqdm-like object per file

def _progress_class(progress: Progress | None, total: int) -> type:
    """A tqdm stand-in for snapshot_download. It builds several bars from the class (files fetched, network
    bytes, bytes written): only the bytes-written one ("Reconstructing ...") counts, and it includes what a
    resumed file already had in the cache."""
    done = [0]

    class _Bytes:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.desc = str(kwargs.get("desc") or "")
            self.total = kwargs.get("total")
            self.n = 0
            self.format_dict: dict[str, Any] = {"rate": None}
            self._counts = self.desc.startswith("Reconstructing")
            if kwargs.get("initial"):
                self.update(kwargs["initial"])

        def update(self, n: int | float | None = 1) -> None:
            inc = int(n or 0)
            self.n += inc
            if self._counts and inc:
                done[0] += inc
                if progress is not None:
                    progress(done[0], total, "downloading")

        def __enter__(self) -> "_Bytes":
            return self

        def __exit__(self, *exc: Any) -> None:
            pass

        def __getattr__(self, name: str) -> Callable[..., None]:  # close, refresh, set_description, set_postfix_str...
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None

    return _Bytes


# ----------------------------------------------------------------------------------------------------------------
# Publication

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _link_or_copy(src: Path, dst: Path) -> None:
    real = Path(os.path.realpath(src))  # the cache's snapshot entries are symlinks to blobs
    try:
        os.link(real, dst)
    except OSError:  # another filesystem, or links not allowed: a copy costs the space once more
        shutil.copy2(real, dst)


def _existing(out: Path, repo_id: str, commit: str) -> dict[str, Any] | None:
    """The manifest of an output that already holds this fetch, every file of the right size; else None."""
    try:
        m = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if m.get("repo_id") != repo_id or m.get("commit") != commit:
        return None
    for f in m.get("files", []):
        p = out / f["path"]
        if not p.is_file() or p.stat().st_size != f["size"]:
            return None
    return m


def _assemble(tmp: Path, snapshot: Path, names: list[str], manifest: dict[str, Any],
              expected_sha: dict[str, str], progress: Progress | None) -> list[FetchedFile]:
    files: list[FetchedFile] = []
    total = sum((snapshot / n).stat().st_size for n in names)
    done = 0
    for name in sorted(names):
        src = snapshot / name
        _link_or_copy(src, tmp / name)
        digest = _sha256(tmp / name)
        want = expected_sha.get(name)
        if want and digest != want:
            raise ToolFailure(f"{name} of {manifest['repo_id']} in the cache does not match the hub's sha256 "
                              f"({digest[:12]} vs {want[:12]}): delete {os.path.realpath(src)} and fetch again",
                              detail={"file": name, "sha256": digest, "expected": want})
        size = (tmp / name).stat().st_size
        files.append(FetchedFile(path=name, size=size, sha256=digest))
        done += size
        if progress is not None:
            progress(done, total, f"hashed {name}")
    manifest = dict(manifest, files=[f.model_dump() for f in files], total_bytes=sum(f.size for f in files))
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return files


def _publish(snapshot: Path, names: list[str], out: Path, manifest: dict[str, Any],
             expected_sha: dict[str, str], progress: Progress | None) -> list[FetchedFile]:
    """The output assembled in a temporary folder beside it and swapped in (tools.core.atomic: the umask's mode,
    an empty folder the only thing replaced, a dead fetch's leftovers swept); a full disk, a read-only place or a
    mount point is one line and leaves nothing."""
    if out.parent.is_dir():
        sweep_stale_partials(out.parent)
    try:
        # an empty folder only: a build that appears there meanwhile is kept, not taken for a fetch to replace
        with atomic_directory(out, force=True, only_empty=True) as tmp:
            return _assemble(Path(tmp), snapshot, names, manifest, expected_sha, progress)
    except OSError as exc:
        raise refusal(out, exc) from None


def check_out_before_network(out: Path, repo_id: str, protected: list[Path]) -> None:
    """Refuses, before the hub is asked, an output no fetch could publish: a file, a mount point, under a file,
    on a read-only file system, a root (or a folder above one) itself, or a folder holding something else."""
    if os.path.lexists(out) and not out.is_dir():
        raise BadInput(f"output {out} exists and is not a folder: pass another {param('out')}", field="out")
    if os.path.ismount(out):
        raise BadInput(f"output {out} is a mount point: a fetch publishes by renaming a folder onto it; pass a "
                       f"new folder inside it as {param('out')}", field="out")
    for root in protected:
        if inside(root, out):
            raise BadInput(f"output {out} is {'the' if out == root else 'above the'} models root {root} itself: "
                           f"pass a new folder inside it as {param('out')}", field="out")
    check_output_folder(out)  # under a file, read-only, a full disk
    if out.is_dir() and any(out.iterdir()):
        m = _existing_repo(out)
        if m != repo_id:
            raise BadInput(f"output {out} already exists and does not hold {repo_id}: pass another "
                           f"{param('out')} or remove it", field="out")


def _existing_repo(out: Path) -> str | None:
    try:
        m = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m.get("repo_id") if isinstance(m, dict) else None


# ----------------------------------------------------------------------------------------------------------------
# The operation

def _listing(repo_id: str, revision: str, endpoint: str | None,
             token: str | None) -> tuple[str, dict[str, int], dict[str, str]]:
    """(commit, size of each build file, sha256 of each LFS file) of the repo at `revision`, from the hub."""
    from huggingface_hub import HfApi

    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as exc:
        raise hub_failure(exc, repo_id, revision, endpoint, bool(token)) from None
    sizes: dict[str, int] = {}
    expected_sha: dict[str, str] = {}
    for s in info.siblings or []:
        if wanted(s.rfilename):
            sizes[s.rfilename] = int(s.lfs.size if s.lfs else (s.size or 0))
            if s.lfs and s.lfs.sha256:
                expected_sha[s.rfilename] = s.lfs.sha256
    if not any(n.endswith(".safetensors") for n in sizes):
        raise ToolFailure(f"{repo_id}@{revision} has no top-level .safetensors files: not a checkpoint this "
                          f"project builds from (see https://huggingface.co/{repo_id}/tree/{revision})",
                          detail={"repo_id": repo_id, "files": sorted(sizes)})
    return info.sha or "", sizes, expected_sha


def _earlier_fetch(out: Path, repo_id: str, commit: str) -> dict[str, Any] | None:
    """The manifest of an earlier fetch of this commit at `out`; None for an empty or missing output; BadInput
    for an output that holds something else."""
    if not (out.is_dir() and any(out.iterdir())):
        return None
    done = _existing(out, repo_id, commit)
    if done is None:
        raise BadInput(f"output {out} already exists and does not hold {repo_id}@{commit}: pass another "
                       f"{param('out')} or remove it", field="out")
    return done


def _check_disk(repo_id: str, out: Path, cache_dir: str, commit: str, sizes: dict[str, int]) -> int:
    """Refuses a fetch the disk cannot hold: what the cache lacks, plus the output when it cannot hard-link.
    Returns the bytes already cached."""
    total = sum(sizes.values())
    cached = _cached_bytes(cache_dir, repo_id, commit, sizes)
    need = total - cached + DISK_MARGIN_BYTES
    at, free = repack_checks.free_bytes(Path(cache_dir))
    out_at, out_free = repack_checks.free_bytes(out.parent)
    if not _same_fs(at, out_at):
        need_out = total + DISK_MARGIN_BYTES
        if out_free < need_out:
            raise ToolFailure(f"not enough disk for {repo_id} at {out_at}: {out_free / 2**30:.2f} GiB free, "
                              f"{need_out / 2**30:.2f} GiB needed; free space there or pass another --out",
                              detail={"free_bytes": out_free, "needed_bytes": need_out, "path": str(out_at)})
    if free < need:
        raise ToolFailure(f"not enough disk for {repo_id}: {free / 2**30:.2f} GiB free at {at} (the "
                          f"huggingface_hub cache), {need / 2**30:.2f} GiB needed ({total / 2**30:.2f} GiB of "
                          f"files, {cached / 2**30:.2f} GiB already cached); free space or set HF_HUB_CACHE",
                          detail={"free_bytes": free, "needed_bytes": need, "path": str(at),
                                  "repo_bytes": total, "cached_bytes": cached})
    return cached


def _download(repo_id: str, revision: str, commit: str, sizes: dict[str, int], cache_dir: str,
              endpoint: str | None, token: str | None, progress: Progress | None, cached: int) -> Path:
    """The snapshot of `commit` in the cache, downloaded where it lacks files."""
    from huggingface_hub import snapshot_download

    total = sum(sizes.values())
    if progress is not None:
        progress(cached, total, f"{len(sizes)} files, {total / 2**30:.2f} GiB")
    try:
        snapshot = Path(snapshot_download(
            repo_id, revision=revision, allow_patterns=sorted(sizes), cache_dir=cache_dir, endpoint=endpoint,
            token=token, tqdm_class=_progress_class(progress, total), max_workers=4))
    except Exception as exc:
        raise hub_failure(exc, repo_id, revision, endpoint, bool(token)) from None
    if snapshot.name != commit:
        raise ToolFailure(f"{repo_id}@{revision} moved to {snapshot.name} during the fetch (was {commit}): run "
                          "the fetch again", detail={"before": commit, "after": snapshot.name})
    return snapshot


def _cached_snapshot(repo_id: str, revision: str, cache_dir: str, endpoint: str | None,
                     token: str | None) -> tuple[Path, list[str]]:
    """Offline: the cached snapshot of `revision` and its build files."""
    from huggingface_hub import snapshot_download

    try:
        # The patterns keep files a build does not read (README, other formats) out of the completeness
        # check huggingface_hub makes against the listing it cached when the files were fetched.
        snapshot = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                          local_files_only=True, allow_patterns=list(BUILD_FILES)))
    except Exception as exc:
        raise hub_failure(exc, repo_id, revision, endpoint, bool(token)) from None
    names = sorted(p.name for p in snapshot.iterdir() if wanted(p.name) and p.exists())
    if not any(n.endswith(".safetensors") for n in names):
        raise ToolFailure(f"the cached {repo_id}@{revision} holds no .safetensors: connect and unset "
                          "HF_HUB_OFFLINE, then fetch again", detail={"snapshot": str(snapshot)})
    return snapshot, names


def fetch_checkpoint(params: FetchParams, progress: Progress | None = None) -> FetchResult:
    """Downloads the build files of `params.repo_id` at `params.revision` and publishes them at the output.

    Raises BadInput for input to change, ToolFailure (one line, the fix, `detail`) for a fetch that cannot
    proceed; nothing is written to the output in either case.
    """
    t0 = time.monotonic()
    repo_id = check_repo_id(params.repo_id)
    revision = check_revision(params.revision)
    out = resolve_out(params, repo_id)
    check_out_before_network(out, repo_id, _protected(params))
    endpoint, cache_dir, offline = hub_env()
    token, _ = hf_token()
    expected_sha: dict[str, str] = {}
    if not offline:
        commit, sizes, expected_sha = _listing(repo_id, revision, endpoint, token)
        done = _earlier_fetch(out, repo_id, commit)
        if done is not None:
            return _result(repo_id, revision, commit, out, done, offline, cache_dir, t0, present=True)
        cached = _check_disk(repo_id, out, cache_dir, commit, sizes)  # before anything is downloaded
        snapshot = _download(repo_id, revision, commit, sizes, cache_dir, endpoint, token, progress, cached)
        names = sorted(sizes)
    else:
        snapshot, names = _cached_snapshot(repo_id, revision, cache_dir, endpoint, token)
        commit = snapshot.name
        done = _earlier_fetch(out, repo_id, commit)
        if done is not None:
            return _result(repo_id, revision, commit, out, done, offline, cache_dir, t0, present=True)
    manifest = {"repo_id": repo_id, "revision": revision, "commit": commit, "endpoint": endpoint or
                "https://huggingface.co", "fetched_at": clock.iso(),
                "offline": offline}
    _publish(snapshot, names, out, manifest, expected_sha, progress)
    return _result(repo_id, revision, commit, out, json.loads((out / MANIFEST).read_text()), offline,
                   cache_dir, t0, present=False)


def _result(repo_id: str, revision: str, commit: str, out: Path, manifest: dict[str, Any], offline: bool,
            cache_dir: str, t0: float, *, present: bool) -> FetchResult:
    files = [FetchedFile(**f) for f in manifest["files"]]
    return FetchResult(repo_id=repo_id, revision=revision, commit=commit, out=str(out), files=files,
                       total_bytes=sum(f.size for f in files), offline=offline, already_present=present,
                       cache_dir=cache_dir, manifest=str(out / MANIFEST), wall_s=round(time.monotonic() - t0, 2))


def _cached_bytes(cache_dir: str, repo_id: str, commit: str, sizes: dict[str, int]) -> int:
    """Bytes of these files the cache already holds, complete, for this commit."""
    from huggingface_hub.file_download import repo_folder_name

    folder = Path(cache_dir) / repo_folder_name(repo_id=repo_id, repo_type="model")
    have = 0
    for name in sizes:
        p = folder / "snapshots" / commit / name
        if p.exists():
            have += sizes[name]
    return min(have, sum(sizes.values()))


def _same_fs(a: Path, b: Path) -> bool:
    try:
        return a.stat().st_dev == b.stat().st_dev
    except OSError:
        return False
