"""One pass from a QAT checkpoint (or an intermediate build) to the requested build.

Each source tensor is read once, through a memory map, in row blocks: quantized targets are encoded by the build
scheme that takes their table (`repack.schemes`: W4A16 grid recovery and packing by default, W8A8 int8 linears
with `scheme="w8a8"`), everything else is copied byte for byte (renamed for text-only builds), towers are dropped
without being read. The output is laid out in full before any data is computed (so every block is written by position,
from several threads, and a full disk shows up at once), and written atomically.

The article's three steps are this function with different options:
  repack_q4_0.py repack  = BuildOptions(quantize_linears=True,  text_only=False, embed_int4=False)
  text_only.py           = BuildOptions(quantize_linears=False, text_only=True,  embed_int4=False)
  embed_int4.py          = BuildOptions(quantize_linears=False, text_only=False, embed_int4=True, embed_tokens=...)
and `python3 -m repack build` does all of it in one read of the source.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Literal

from tools.core.errors import param

from . import config as cfgmod
from . import grid
from . import schemes
from .atomic import (REPORT, atomic_directory, check_destination, check_no_symlink_loop, check_stopped,
                     existing_ancestor, resolve_output, sweep_stale_partials)
from .checkpoint import (INDEX, MM_PREFIX, TOWER_PREFIXES, Checkpoint, check_source_folder, check_unique_outputs,
                         confinement, open_checkpoint)
from .errors import RepackError, clip
from .params import BuildOptions
from .report import TABLES, RepackReport, TableReport
from .safetensors_io import MappedFile, OutShard, OutTensor, ShardWriter, TensorInfo, WriteError

Progress = Callable[[int, int, str], None]
BLOCK_BYTES = 4 << 20      # source bytes per work item: big enough to amortise, small enough to bound memory
PACKED_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point", ".weight_g_idx")
TEXT_ONLY_SKIP_FILES = {"preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"}


@dataclass
class _Item:
    """What happens to one source tensor."""

    src: TensorInfo
    action: Literal["copy", "quant", "drop"]
    table: str
    out_name: str                      # copy: the tensor name; quant: the module prefix (".weight" removed)
    head: bool = False                 # also write the levels and scales as lm_head.*
    outs: dict[str, OutTensor] = field(default_factory=dict)
    writers: dict[str, int] = field(default_factory=dict)  # out key -> output shard index
    scheme: type[schemes.Scheme] | None = None  # quant: the scheme that encodes it


def _classify(name: str, info: TensorInfo, ck: Checkpoint, opt: BuildOptions) -> _Item:
    if name.startswith(TOWER_PREFIXES):
        return _Item(info, "drop" if opt.text_only else "copy", "towers", name)
    out = name
    short = None
    if ck.multimodal and name.startswith(MM_PREFIX):
        short = name[len(MM_PREFIX):]
        if opt.text_only:
            out = "model." + short
    elif not ck.multimodal and name.startswith("model."):
        short = name[len("model."):]
    elif name.startswith("lm_head."):
        short = name
    if short is None:
        return _Item(info, "copy", "rest", out)
    module = short.rsplit(".", 1)[0]
    if short.endswith(PACKED_SUFFIXES):  # already int4 (an intermediate build): carried as is
        table = ("PLE" if module == "embed_tokens_per_layer" else "embed_tokens" if module == "embed_tokens"
                 else "lm_head" if module == "lm_head" else "linears")
        return _Item(info, "copy", table, out)
    if short == "embed_tokens_per_layer.weight":
        return _Item(info, "quant" if opt.embed_int4 else "copy", "PLE", out)
    if short == "embed_tokens.weight":
        q = opt.embed_int4 and opt.embed_tokens
        return _Item(info, "quant" if q else "copy", "embed_tokens", out, head=q and "lm_head.weight" not in ck.tensors)
    if short == "lm_head.weight":
        return _Item(info, "quant" if opt.embed_int4 and opt.embed_tokens else "copy", "lm_head", out)
    # every text weight of two or more dimensions is a linear layer's (norms are 1-D): one the build cannot pack
    # is refused by _check_quantizable, never left bf16 under a config that declares every Linear int4
    if short.endswith(".weight") and len(info.shape) >= 2:
        return _Item(info, "quant" if opt.quantize_linears else "copy", "linears", out)
    return _Item(info, "copy", "rest", out)


def _check_quantizable(it: _Item) -> None:
    s = it.src
    if s.dtype != "BF16":
        raise RepackError(f"{s.file}: tensor {clip(s.name)} is {s.dtype}, but only BF16 tensors can be "
                          f"repacked; use the bf16 QAT export (google/gemma-4-E2B-it-qat-q4_0-unquantized)")
    if len(s.shape) != 2 or s.shape[1] % grid.GROUP or 0 in s.shape:
        raise RepackError(f"{s.file}: tensor {clip(s.name)} has shape {clip(list(s.shape), 80)}; a 4-bit target "
                          f"needs 2 non-empty dimensions with the last a multiple of {grid.GROUP}")


def _check_carried_linears(items: list[_Item], opt: BuildOptions) -> None:
    """Linears an earlier build packed are carried as they are: refused when the scheme asked for would have
    written them otherwise, since the output and its report would claim that scheme."""
    if not opt.quantize_linears:
        return
    scheme = schemes.for_table(opt.scheme, "linears")
    if "weight_packed" in {o.suffix for o in scheme.outputs(grid.GROUP, grid.GROUP, opt)}:  # names, any shape
        return
    for it in items:
        if it.table == "linears" and it.action == "copy" and it.src.name.endswith(".weight_packed"):
            raise RepackError(f"{clip(it.src.file)}: the source's linear layers are already packed as int4 "
                              f"weight_packed (e.g. {clip(it.src.name, 120)}), which {param('scheme')} {opt.scheme} does "
                              f"not write; give the bf16 QAT checkpoint as the source",
                              {"file": clip(it.src.file), "tensor": clip(it.src.name), "option": "--scheme",
                               "problem": "already-packed"}, field="scheme")


def _plan(ck: Checkpoint, opt: BuildOptions) -> tuple[list[_Item], list[OutShard]]:
    items: list[_Item] = []
    shards: list[OutShard] = []
    current: OutShard | None = None

    def add(t: OutTensor, it: _Item, key: str) -> None:
        nonlocal current
        if current is None or (current.tensors and current.data_bytes + t.nbytes > opt.max_shard_bytes):
            current = OutShard("")
            shards.append(current)
        current.add(t)
        it.outs[key] = t
        it.writers[key] = len(shards) - 1

    for sh in ck.shards:
        sh_items = [_classify(n, i, ck, opt) for n, i in sorted(sh.tensors.items(), key=lambda kv: kv[1].offset)]
        for it in sh_items:
            if it.action == "quant":
                it.scheme = schemes.for_table(opt.scheme, it.table)
                _check_quantizable(it)
        _check_carried_linears(sh_items, opt)
        items.extend(sh_items)
        unchanged = sh_items and all(it.action == "copy" and it.out_name == it.src.name for it in sh_items)
        if unchanged:
            # every tensor kept as is: the shard itself is reused (hard link)
            current = None
            linked = OutShard("", hardlink_from=sh.path)
            for it in sh_items:
                t = OutTensor(it.out_name, it.src.dtype, it.src.shape, it.src.nbytes)
                linked.add(t)
                it.outs["data"] = t
                it.writers["data"] = len(shards)
            shards.append(linked)
            current = None
            continue
        for it in sh_items:
            s = it.src
            if it.action == "drop":
                continue
            if it.action == "copy":
                add(OutTensor(it.out_name, s.dtype, s.shape, s.nbytes), it, "data")
                continue
            rows, cols = s.shape
            prefix = it.out_name.removesuffix(".weight")
            names = [("", prefix)] + ([("head_", "lm_head")] if it.head else [])
            for key, mod in names:
                for o in it.scheme.outputs(rows, cols, opt):  # type: ignore[union-attr]
                    add(OutTensor(f"{mod}.{o.suffix}", o.dtype, o.shape, o.nbytes), it, key + o.key)
    n = len(shards)
    for i, sh in enumerate(shards):
        sh.filename = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
    return items, shards


def _output_config(ck: Checkpoint, opt: BuildOptions, items: list[_Item]) -> dict:
    config = cfgmod.text_only(ck.config) if opt.text_only else json.loads(json.dumps(ck.config))
    by_scheme: dict[type[schemes.Scheme], set[str]] = {}  # the tables each scheme quantized in this run
    for it in items:
        if it.action == "quant":
            by_scheme.setdefault(it.scheme, set()).update([it.table] + (["lm_head"] if it.head else []))
    carried = {it.table for it in items if it.action == "copy" and it.src.name.endswith(".weight_packed")}
    carried_bf16 = {it.table for it in items if it.action == "copy" and it.src.dtype == "BF16"
                    and it.src.name.endswith(".weight")}
    head = "lm_head" in carried or any("lm_head" in t for t in by_scheme.values())
    towers = any(it.table == "towers" and it.action != "drop" for it in items)
    qc = cfgmod.quantization_config([s.config_group(sorted(t)) for s, t in by_scheme.items()], previous=ck.config,
                                    carried_packed=carried, carried_bf16=carried_bf16, head=head, towers=towers,
                                    version=_ct_version())
    cfgmod.set_quantization(config, qc)
    if head:
        cfgmod.set_untied(config)
    return config


def _ct_version() -> str:
    return "0.17.0"  # the compressed-tensors format version the config follows (the pinned library)


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_checkpoint(src: str | Path, out: str | Path, options: BuildOptions | None = None,
                     progress: Progress | None = None, *, protected_roots: Iterable[str | Path] = (),
                     notice: Callable[[str], None] | None = None, roots: list[Path] | None = None) -> RepackReport:
    """Builds OUT from SRC as `options` ask, atomically; returns the report (also saved as repack-report.json).

    OUT may never be one of `protected_roots` or a folder above one (nor the file system root, the source, or
    inside or above the source). Leftovers of dead builds beside OUT are removed first; `notice` gets one line
    for each (they are also listed in the report's removed_partials). roots: when given, every source file read
    must resolve inside one of them."""
    opt = options or BuildOptions()
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    target = resolve_output(out)  # what the kernel makes of OUT: where the build goes, what the report names
    protected_roots = list(protected_roots)
    check_no_symlink_loop(src, "source folder")
    check_source_folder(src)
    # then, whatever else fails: dead builds' leftovers go, and a crashed replacement of OUT itself is rolled
    # back, so OUT is judged as it is; never the source, the folders its files may lie in, or a protected one
    keep = [src, *protected_roots, *(d for _, dirs in confinement(src, roots) for d in dirs)]
    removed = sweep_stale_partials(target.parent, keep)
    for line in removed:
        if notice:
            notice(line)
    ck = open_checkpoint(src, roots)
    check_destination(out, opt.force, src, protected_roots,
                      [ck.path / "config.json", *(sh.path for sh in ck.shards), *ck.side_files()])
    items, shards = _plan(ck, opt)
    check_unique_outputs(((it.src.name, t.name) for it in items for t in it.outs.values()), ck.path)
    config = _output_config(ck, opt, items)
    other = grid.other_target(opt.target_dtype)  # type: ignore[arg-type]
    tables = {name: TableReport(name, target_dtype=opt.target_dtype) for name in TABLES}  # type: ignore[arg-type]
    for it in items:
        t = tables[it.table]
        t.tensors += 1
        t.bytes_before += it.src.nbytes
        t.bytes_after += sum(o.nbytes for k, o in it.outs.items() if not k.startswith("head_"))
        if it.head:
            h = tables["lm_head"]
            h.tensors += 1
            h.bytes_after += sum(o.nbytes for k, o in it.outs.items() if k.startswith("head_"))
    report = schemes.SchemeReport(source=str(src), output=str(target), options=opt.report_dict(), scale_dtype=opt.scale_dtype,
                                  other_dtype=other, target_dtype=opt.target_dtype,  # type: ignore[arg-type]
                                  objective=opt.objective, implementation=grid.implementation(), tables=tables,
                                  output_shards=len(shards),
                                  hardlinked_shards=sum(1 for s in shards if s.hardlink_from),
                                  source_bytes=sum(i.nbytes for i in ck.tensors.values()), scheme=opt.scheme)
    report.removed_partials = removed
    metadata = {"format": "pt"}
    for sh in shards:
        sh.layout(metadata)  # fixes sizes for the space check
    weight_map = {t.name: sh.filename for sh in shards for t in sh.tensors}
    index = {"metadata": {"total_size": sum(sh.data_bytes for sh in shards)},
             "weight_map": dict(sorted(weight_map.items()))}
    texts = {INDEX: json.dumps(index, indent=2) + "\n",
             "config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}
    sides = [f for f in ck.side_files() if not (opt.text_only and f.name in TEXT_ONLY_SKIP_FILES)]
    # everything the build writes: a shard reused by a hard link costs nothing only where the link will work
    copied = [sh.size for sh in shards if sh.hardlink_from is None or not _can_link(sh.hardlink_from, target)]
    need = sum(_blocks(n) for n in [*copied, *(len(t.encode()) for t in texts.values()),
                                    *(os.stat(f).st_size for f in sides)]) + _REPORT_ROOM
    free = _free_bytes(target)
    if free is not None and need > free:
        raise RepackError(f"{target.parent}: the build needs {need / 1e9:.2f} GB and only {free / 1e9:.2f} GB is "
                          f"free; free some space or choose another output folder")

    with atomic_directory(out, opt.force) as tmp:
        try:
            report.bytes_read = _write_shards(ck, items, shards, tmp, opt, report, progress, metadata)
            for name, text in texts.items():
                _write_text(tmp / name, text)
            for f in sides:
                try:
                    shutil.copy2(f, tmp / f.name)
                except OSError as e:
                    raise WriteError(tmp / f.name, e) from None
            report.bytes_written = sum(sh.size for sh in shards if sh.hardlink_from is None)
            report.wall_s = time.perf_counter() - t0
            report.peak_rss_bytes = _peak_rss()
            report.files = sorted([*os.listdir(tmp), REPORT])  # what --force may later replace: exactly these
            _write_text(tmp / REPORT, json.dumps(report.to_dict(), indent=2) + "\n")
        except WriteError as e:  # named as the user knows it, not by the temporary folder
            where = target / e.path.relative_to(tmp) if e.path.is_relative_to(tmp) else e.path
            if e.no_space:
                was = f"{free / 1e9:.2f} GB" if free is not None else "an unknown amount"
                raise RepackError(f"{target}: no space left on the device while writing {where.name}; the build "
                                  f"needs {need / 1e9:.2f} GB ({was} was free when it started); free some space or "
                                  f"choose another output folder") from None
            raise RepackError(str(e).replace(str(e.path), str(where), 1)) from None
    return report


_REPORT_ROOM = 64 << 10  # repack-report.json, written last: a few kB


def _blocks(n: int) -> int:
    return -(-n // 4096) * 4096


def _can_link(src: Path, target: Path) -> bool:
    """Whether a hard link of `src` into `target` will work rather than fall back to a copy: the same file
    system, and a file the user owns or may write (fs.protected_hardlinks refuses others' files)."""
    try:
        st = os.stat(src)
        return (st.st_dev == os.stat(existing_ancestor(target)).st_dev
                and (st.st_uid == os.geteuid() or os.access(src, os.R_OK | os.W_OK)))
    except OSError:
        return False


def _write_text(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise WriteError(path, e) from None


def _free_bytes(target: Path) -> int | None:
    try:
        return shutil.disk_usage(existing_ancestor(target)).free
    except OSError:  # a name too long, a folder that cannot be searched: the writer names it
        return None


def _write_shards(ck: Checkpoint, items: list[_Item], shards: list[OutShard], tmp: Path, opt: BuildOptions,
                  report: schemes.SchemeReport, progress: Progress | None, metadata: dict[str, str]) -> int:
    total = sum(it.src.nbytes for it in items if it.action != "drop")
    done = 0
    if progress:
        progress(0, total, "starting")
    writers: dict[int, ShardWriter] = {}
    maps: dict[Path, MappedFile] = {}
    threads = opt.threads or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                 else (os.cpu_count() or 1))
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="repack")
    futures: dict[Future, tuple[_Item, int, int]] = {}
    # finished blocks arrive on a queue: waiting on the set of pending futures instead installs a waiter on each of
    # them at every completion, quadratic in the block count (about a CPU second taken from the workers at E2B's
    # full size, ~2,300 blocks)
    finished: queue.SimpleQueue[Future] = queue.SimpleQueue()

    def submit(fn: Callable, args: tuple, what: tuple[_Item, int, int]) -> None:
        fut = pool.submit(fn, *args)
        futures[fut] = what
        fut.add_done_callback(finished.put)

    try:
        for i, sh in enumerate(shards):
            if sh.hardlink_from is not None:
                _link_or_copy(sh.hardlink_from, tmp / sh.filename)
                n = sum(t.nbytes for t in sh.tensors)
                done += n
                if progress:
                    progress(done, total, f"linked {sh.filename}")
            else:
                writers[i] = ShardWriter(tmp / sh.filename, sh, metadata)
        for it in items:
            if it.action == "drop" or (it.writers and shards[next(iter(it.writers.values()))]
                                       .hardlink_from is not None):
                continue
            mf = maps.get(it.src.file)
            if mf is None:
                mf = maps[it.src.file] = MappedFile(it.src.file, it.src.ident)
            if it.action == "copy":
                for start in range(0, max(it.src.nbytes, 1), BLOCK_BYTES):
                    length = min(BLOCK_BYTES, it.src.nbytes - start)
                    submit(_copy_block, (mf, it, writers, start, length), (it, start, length))
            else:
                rows, cols = it.src.shape
                for key, arr in it.scheme.constants(rows, cols).items():  # type: ignore[union-attr]
                    for pre in ("", "head_") if it.head else ("",):
                        writers[it.writers[pre + key]].pwrite(arr, it.outs[pre + key].offset)
                per = max(1, BLOCK_BYTES // (cols * 2))
                for r0 in range(0, rows, per):
                    n = min(per, rows - r0)
                    submit(_quant_block, (mf, it, writers, r0, n, opt), (it, r0, n))
        while futures:
            check_stopped()
            try:
                fut = finished.get(timeout=0.5)
            except queue.Empty:
                continue
            it, a, n = futures.pop(fut)
            stats = fut.result()  # re-raises a worker's error
            if stats is not None:
                it.scheme.record(report, it.table, stats)  # type: ignore[union-attr]
                if it.head:
                    it.scheme.record(report, "lm_head", stats)  # type: ignore[union-attr]
                it.scheme.check_block(stats, it.src.name, opt)  # type: ignore[union-attr]
                done += n * it.src.shape[1] * 2
            else:
                done += n
            if progress:
                progress(done, total, it.src.name)
    except BaseException:
        for f in futures:
            f.cancel()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        for w in writers.values():
            w.close()
        for m in maps.values():
            m.close()
    return total


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        try:
            shutil.copyfile(src, dst)
        except OSError as e:
            raise WriteError(dst, e) from None


def _copy_block(mf: MappedFile, it: _Item, writers: dict[int, ShardWriter], start: int, length: int) -> None:
    if length > 0:
        writers[it.writers["data"]].pwrite(mf.view(it.src, start, length), it.outs["data"].offset + start)
        mf.release(it.src, start, length)


_tls = threading.local()


def _quant_block(mf: MappedFile, it: _Item, writers: dict[int, ShardWriter], r0: int, n: int,
                 opt: BuildOptions) -> object:
    rows, cols = it.src.shape
    raw = mf.view(it.src, r0 * cols * 2, n * cols * 2).view("<u2").reshape(n, cols)
    arrays, stats = it.scheme.quantize_rows(raw, opt, r0)  # type: ignore[union-attr]
    del raw
    for pre in ("", "head_") if it.head else ("",):
        for key, arr in arrays.items():
            out = it.outs[pre + key]  # rows map to equal slices of every per-row output
            writers[it.writers[pre + key]].pwrite(arr, out.offset + r0 * (out.nbytes // rows))
    mf.release(it.src, r0 * cols * 2, n * cols * 2)
    return stats
