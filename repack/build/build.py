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
and `python3 -m repack build` does all of it in one read of the source. What happens to each tensor is planned
in repack.build.plan; the options are repack.params.BuildOptions.
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
from typing import Callable, Iterable

from tools.core.atomic import (REPORT, atomic_directory, check_destination, check_stopped, existing_ancestor,
                               resolve_output)
from tools.core.atomic_leftovers import sweep_stale_partials
from tools.core.paths import check_no_symlink_loop, confinement
from tools.core.progress import Progress

from .. import schemes
from ..errors import RepackError, core_refusals
from ..family import drafter
from ..grid import grid
from ..params import BuildOptions
from ..schemes.report import TABLES, RepackReport, TableReport
from ..source.checkpoint import INDEX, Checkpoint, check_source_folder, check_unique_outputs, open_checkpoint
from ..source.safetensors_io import MappedFile, OutShard, ShardWriter, WriteError
from .plan import Item, output_config, plan
from .probe import probe_checkpoint

BLOCK_BYTES = 4 << 20      # source bytes per work item: big enough to amortise, small enough to bound memory
TEXT_ONLY_SKIP_FILES = {"preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json"}


def _reset_peak_rss() -> None:
    """Starts this process's peak resident memory afresh (Linux: 5 to /proc/self/clear_refs), so that the report's
    peak is the build's, not that of what the process did before (an MCP server's earlier builds and serving)."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:  # not Linux, or not allowed: the peak is the process's since it started
        pass


def _peak_rss() -> int:
    """The peak resident memory since _reset_peak_rss (VmHWM), else since the process started (ru_maxrss)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
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
    _reset_peak_rss()
    src, out = Path(src), Path(out)
    with core_refusals():
        ck, removed = _open_source(src, out, opt, list(protected_roots), notice, roots)
        items, shards = plan(ck, opt)
        check_unique_outputs(((it.src.name, t.name) for it in items for t in it.outs.values()), ck.path)
        target = resolve_output(out)  # what the kernel makes of OUT: where the build goes, what the report names
        report = _new_report(ck, src, target, opt, items, shards)
        report.removed_partials = removed
        metadata = {"format": "pt"}
        for sh in shards:
            sh.layout(metadata)  # fixes sizes for the space check
        texts = _texts(output_config(ck, opt, items), shards)
        sides = [f for f in ck.side_files() if not (opt.text_only and f.name in TEXT_ONLY_SKIP_FILES)]
        room = _check_room(shards, texts, sides, target)
        with atomic_directory(out, opt.force) as tmp:
            try:
                report.bytes_read = _write_shards(_Run(ck, items, shards, tmp, opt, report, progress, metadata))
                _write_rest(tmp, texts, sides, report, shards, t0)
            except WriteError as e:  # named as the user knows it, not by the temporary folder
                raise _write_failure(e, tmp, target, room) from None
    return report


def _open_source(src: Path, out: Path, opt: BuildOptions, protected_roots: list[str | Path],
                 notice: Callable[[str], None] | None, roots: list[Path] | None) -> tuple[Checkpoint, list[str]]:
    """The source checked and opened, dead builds' leftovers beside OUT removed, OUT judged; returns the
    checkpoint and one line per leftover removed."""
    target = resolve_output(out)
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
    if ck.drafter:  # a damaged drafter builds and serves, drafting nothing: refused before OUT is touched
        drafter.check_layout(ck.path, ck.config, {n: t.shape for n, t in ck.tensors.items()},
                             {n: t.file for n, t in ck.tensors.items()})
        drafter.member(ck.path, ck.config)  # a layout that claims the family but is no member's is refused
    if ck.drafter and opt.quantize_linears:  # refused before OUT is touched if it would be quantized, not packed
        drafter.check_buildable(ck.path, drafter.grid_verdict(probe_checkpoint(ck.path, roots=roots).tensors),
                                opt.scheme)
    check_destination(out, opt.force, src, protected_roots,
                      [ck.path / "config.json", *(sh.path for sh in ck.shards), *ck.side_files()])
    return ck, removed


def _new_report(ck: Checkpoint, src: Path, target: Path, opt: BuildOptions, items: list[Item],
                shards: list[OutShard]) -> schemes.SchemeReport:
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
    return schemes.SchemeReport(source=str(src), output=str(target), options=opt.report_dict(),
                                scale_dtype=opt.scale_dtype,  # type: ignore[arg-type]
                                other_dtype=grid.other_target(opt.target_dtype),  # type: ignore[arg-type]
                                target_dtype=opt.target_dtype,  # type: ignore[arg-type]
                                objective=opt.objective, implementation=grid.implementation(), tables=tables,
                                output_shards=len(shards),
                                hardlinked_shards=sum(1 for s in shards if s.hardlink_from),
                                source_bytes=sum(i.nbytes for i in ck.tensors.values()), scheme=opt.scheme)


def _texts(config: dict, shards: list[OutShard]) -> dict[str, str]:
    """The index and the config, as written."""
    weight_map = {t.name: sh.filename for sh in shards for t in sh.tensors}
    index = {"metadata": {"total_size": sum(sh.data_bytes for sh in shards)},
             "weight_map": dict(sorted(weight_map.items()))}
    return {INDEX: json.dumps(index, indent=2) + "\n",
            "config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"}


@dataclass(frozen=True)
class _Room:
    need: int          # bytes the build writes, in whole blocks
    free: int | None   # free where it goes when it started (None: cannot be told)


def _check_room(shards: list[OutShard], texts: dict[str, str], sides: list[Path], target: Path) -> _Room:
    """Refuses a build the file system has no room for, before anything is written."""
    # everything the build writes: a shard reused by a hard link costs nothing only where the link will work
    copied = [sh.size for sh in shards if sh.hardlink_from is None or not _can_link(sh.hardlink_from, target)]
    need = sum(_blocks(n) for n in [*copied, *(len(t.encode()) for t in texts.values()),
                                    *(os.stat(f).st_size for f in sides)]) + _REPORT_ROOM
    free = _free_bytes(target)
    if free is not None and need > free:
        raise RepackError(f"{target.parent}: the build needs {need / 1e9:.2f} GB and only {free / 1e9:.2f} GB is "
                          f"free; free some space or choose another output folder")
    return _Room(need, free)


def _write_rest(tmp: Path, texts: dict[str, str], sides: list[Path], report: schemes.SchemeReport,
                shards: list[OutShard], t0: float) -> None:
    """The texts, the side files and, last, the report (listing every file, which is what force may replace)."""
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
    report.files = sorted([*os.listdir(tmp), REPORT])
    _write_text(tmp / REPORT, json.dumps(report.to_dict(), indent=2) + "\n")


def _write_failure(e: WriteError, tmp: Path, target: Path, room: _Room) -> RepackError:
    where = target / e.path.relative_to(tmp) if e.path.is_relative_to(tmp) else e.path
    if e.no_space:
        was = f"{room.free / 1e9:.2f} GB" if room.free is not None else "an unknown amount"
        return RepackError(f"{target}: no space left on the device while writing {where.name}; the build "
                           f"needs {room.need / 1e9:.2f} GB ({was} was free when it started); free some space or "
                           f"choose another output folder")
    return RepackError(str(e).replace(str(e.path), str(where), 1))


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


@dataclass
class _Run:
    """One build's writing: what is read, what is written where, and what it reports."""

    ck: Checkpoint
    items: list[Item]
    shards: list[OutShard]
    tmp: Path
    opt: BuildOptions
    report: schemes.SchemeReport
    progress: Progress | None
    metadata: dict[str, str]
    total: int = 0
    done: int = 0
    writers: dict[int, ShardWriter] = field(default_factory=dict)
    maps: dict[Path, MappedFile] = field(default_factory=dict)

    def advance(self, n: int, message: str) -> None:
        self.done += n
        if self.progress:
            self.progress(self.done, self.total, message)


class _Pool:
    """Worker threads whose finished blocks arrive on a queue: waiting on the set of pending futures instead
    installs a waiter on each of them at every completion, quadratic in the block count (about a CPU second taken
    from the workers at E2B's full size, ~2,300 blocks)."""

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="repack")
        self.futures: dict[Future, tuple[Item, int, int]] = {}
        self.finished: queue.SimpleQueue[Future] = queue.SimpleQueue()

    def submit(self, fn: Callable, args: tuple, what: tuple[Item, int, int]) -> None:
        fut = self.pool.submit(fn, *args)
        self.futures[fut] = what
        fut.add_done_callback(self.finished.put)


def _threads(opt: BuildOptions) -> int:
    return opt.threads or max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                              else (os.cpu_count() or 1))


def _write_shards(run: _Run) -> int:
    """Writes every shard (linking those kept whole); returns the source bytes read."""
    run.total = sum(it.src.nbytes for it in run.items if it.action != "drop")
    if run.progress:
        run.progress(0, run.total, "starting")
    pool = _Pool(_threads(run.opt))
    try:
        _open_shards(run)
        for it in run.items:
            _submit_item(run, pool, it)
        _collect(run, pool)
    except BaseException:
        for f in pool.futures:
            f.cancel()
        raise
    finally:
        pool.pool.shutdown(wait=True, cancel_futures=True)
        for w in run.writers.values():
            w.close()
        for m in run.maps.values():
            m.close()
    return run.total


def _open_shards(run: _Run) -> None:
    for i, sh in enumerate(run.shards):
        if sh.hardlink_from is not None:
            _link_or_copy(sh.hardlink_from, run.tmp / sh.filename)
            run.advance(sum(t.nbytes for t in sh.tensors), f"linked {sh.filename}")
        else:
            run.writers[i] = ShardWriter(run.tmp / sh.filename, sh, run.metadata)


def _submit_item(run: _Run, pool: _Pool, it: Item) -> None:
    """Queues one source tensor's blocks (none for a dropped tensor or one in a linked shard)."""
    if it.action == "drop" or (it.writers and run.shards[next(iter(it.writers.values()))].hardlink_from is not None):
        return
    mf = run.maps.get(it.src.file)
    if mf is None:
        mf = run.maps[it.src.file] = MappedFile(it.src.file, it.src.ident)
    if it.action == "copy":
        for start in range(0, max(it.src.nbytes, 1), BLOCK_BYTES):
            length = min(BLOCK_BYTES, it.src.nbytes - start)
            pool.submit(_copy_block, (mf, it, run.writers, start, length), (it, start, length))
        return
    rows, cols = it.src.shape
    for key, arr in it.scheme.constants(rows, cols).items():  # type: ignore[union-attr]
        for pre in ("", "head_") if it.head else ("",):
            run.writers[it.writers[pre + key]].pwrite(arr, it.outs[pre + key].offset)
    per = max(1, BLOCK_BYTES // (cols * 2))
    for r0 in range(0, rows, per):
        n = min(per, rows - r0)
        pool.submit(_quant_block, (mf, it, run.writers, r0, n, run.opt), (it, r0, n))


def _collect(run: _Run, pool: _Pool) -> None:
    """Takes the finished blocks as they come: records their statistics, stops at the first a scheme refuses."""
    while pool.futures:
        check_stopped()
        try:
            fut = pool.finished.get(timeout=0.5)
        except queue.Empty:
            continue
        it, a, n = pool.futures.pop(fut)
        stats = fut.result()  # re-raises a worker's error
        if stats is not None:
            it.scheme.record(run.report, it.table, stats)  # type: ignore[union-attr]
            if it.head:
                it.scheme.record(run.report, "lm_head", stats)  # type: ignore[union-attr]
            it.scheme.check_block(stats, it.src.name, run.opt)  # type: ignore[union-attr]
            run.advance(n * it.src.shape[1] * 2, it.src.name)
        else:
            run.advance(n, it.src.name)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        try:
            shutil.copyfile(src, dst)
        except OSError as e:
            raise WriteError(dst, e) from None


def _copy_block(mf: MappedFile, it: Item, writers: dict[int, ShardWriter], start: int, length: int) -> None:
    if length > 0:
        writers[it.writers["data"]].pwrite(mf.view(it.src, start, length), it.outs["data"].offset + start)
        mf.release(it.src, start, length)


_tls = threading.local()


def _quant_block(mf: MappedFile, it: Item, writers: dict[int, ShardWriter], r0: int, n: int,
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


__all__ = ["BLOCK_BYTES", "BuildOptions", "Progress", "build_checkpoint"]
