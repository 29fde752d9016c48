"""Single-stream decode of a Gemma 4 member's builds at the real model's shapes on vLLM's CPU backend: the
article's decode claim (all-4-bit 1.34x the bf16-embedding build on the T4) tested on the hardware we have, and
each build's size against the fit planner's (python -m repack plan --member M).

    flock /tmp/gemma4-vllm.lock .venv/bin/python bench/bench_real_shapes.py [--member e2b] [--rounds 2]
        [--prompts 3] [--max-tokens 24] [--builds bf16-emb,all-4bit] [--workdir /tmp/real-shapes-e2b]
        [--int4-paths kernel,dequantize] [--tag TAG] [--out evidence]

Writes a full-size synthetic source of the member (repack.stand_ins.synthetic.write_member_checkpoint, fill "tiled": the
real shapes of repack/family/members.py and the grid, values repeated per tensor, since decode speed does not depend on
them; the tiny model's tokenizer, widened to the full vocabulary), repacks it in one pass per build (bf16
embeddings: linears int4; all-4-bit: linears, both embedding tables and the untied output layer int4), deletes
the source, then serves the builds one at a time, alternating A B A B so the machine's load falls on both, and
per start: the host memory of the engine's processes after load (tools.gpu.vram.host_memory), the KV cache
tokens vLLM reported, the decode benchmark (tools.measure.decode.run) on the first `--prompts` shipped prompts,
greedy, with its roofline figure (the CPU's measured copy bandwidth). Each build's bytes per table (read from
its headers by the build's own table names, repack.build.plan) stand beside the planner's prediction and their ratio.
On a CPU whose vLLM library has no cpu_gemm_wna16 (AVX2), `--int4-paths kernel,dequantize` serves each build
once per path of the plugin's int4 layers (gemma4_t4_vllm/int4_matmul.py; "dequantize" sets its PATH_ENV, the
dequantize-and-matmul reference), alternating, and the table says whether their greedy answers are identical.
Writes evidence/real-shapes.json and -table.md for E2B, evidence/real-shapes-<member>.json and -table.md for
another member (with `--tag`, real-shapes[-<member>]-<tag>.*), to fold into real-shapes.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gemma4_t4_vllm.int4_matmul import PATH_ENV  # noqa: E402
from repack.build.build import BuildOptions, build_checkpoint  # noqa: E402
from repack.source.checkpoint import open_checkpoint  # noqa: E402
from repack.errors import RepackError  # noqa: E402
from repack.build.fit import plan_member  # noqa: E402
from repack.family.members import MEMBERS, Member, by_name  # noqa: E402
from repack.build.plan import plan  # noqa: E402
from repack.stand_ins.synthetic import copy_tokenizer, member_tensors, write_member_checkpoint  # noqa: E402
from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint  # noqa: E402
from tools.core import clock  # noqa: E402
from tools.core.errors import ToolFailure  # noqa: E402
from tools.gpu.vram import host_memory, server_process_pids  # noqa: E402
from tools.measure.decode.params import DecodeParams  # noqa: E402
from tools.measure.decode.run import run_decode  # noqa: E402
from tools.measure.roofline import cpu_copy_bandwidth, decode_step_bytes  # noqa: E402
from tools.serving.config import load_config  # noqa: E402
from tools.serving import start_server, stop_server  # noqa: E402

GIB = 2**30
BUILDS = {"bf16-emb": BuildOptions(text_only=True, embed_int4=False, embed_tokens=False),
          "all-4bit": BuildOptions(text_only=True, embed_int4=True, embed_tokens=True)}
PLANNED = {"bf16-emb": "repack-bf16-emb", "all-4bit": "all-4-bit"}  # the fit planner's name of each build
ROOM_BYTES = 2 * 10**9  # beside the source and the builds


def need_bytes(m: Member, builds: list[str]) -> int:
    """Disk the run needs at once: the source (bf16, towers included), the builds as the planner sizes them,
    and some room."""
    src = sum(2 * math.prod(s) for _, s, _ in member_tensors(m))
    p = plan_member(m)
    return src + sum(int(p.build(PLANNED[b]).size_gib * GIB) for b in builds) + ROOM_BYTES


def built_tables(build: Path) -> dict[str, int]:
    """The bytes per table a build holds, named as the build and the planner name them (its norms and shape
    records: "other")."""
    items, _ = plan(open_checkpoint(build), BuildOptions())
    out: dict[str, int] = {}
    for it in items:
        name = "other" if it.table == "rest" else it.table
        out[name] = out.get(name, 0) + it.src.nbytes
    return out


def against_planner(m: Member, build: str, tables: dict[str, int]) -> dict:
    """The build's tables beside the planner's prediction for the same build (GiB), and built / planned."""
    planned = plan_member(m).build(PLANNED[build])
    rows = {}
    for t in sorted(set(planned.tables_gib) | set(tables)):
        got, want = tables.get(t, 0) / GIB, planned.tables_gib.get(t, 0.0)
        rows[t] = {"built_gib": round(got, 4), "planned_gib": want, "ratio": round(got / want, 4) if want else None}
    total = sum(tables.values()) / GIB
    return {"planner_build": planned.build, "tables": rows, "built_gib": round(total, 4),
            "planned_gib": planned.size_gib, "ratio": round(total / planned.size_gib, 4)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(m: Member, names: list[str], work: Path) -> dict[str, dict]:
    """The member's builds at real shapes (reused when a previous run left them), with their sizes per table
    against the planner's and the seconds each step took (none when reused)."""
    free = shutil.disk_usage(work).free
    builds = {name: work / name for name in names}
    timings: dict[str, float | None] = {"source_s": None, **{f"{n}_build_s": None for n in names}}
    if not all((b / "config.json").is_file() for b in builds.values()):
        need = need_bytes(m, names)
        if free < need:
            raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, the run needs {need / 1e9:.0f} GB")
        src = work / f"{m.name.lower()}-synthetic-tiled"
        t = time.monotonic()
        write_member_checkpoint(m, src, 1.0, fill="tiled")
        tiny = cached_tiny_qat_checkpoint(work / "tiny").path
        copy_tokenizer(tiny, src, m.vocab_size)
        timings["source_s"] = round(time.monotonic() - t, 1)
        print(f"source written in {timings['source_s']:.0f} s", flush=True)
        for name in names:
            t = time.monotonic()
            build_checkpoint(src, builds[name], BUILDS[name])
            timings[f"{name}_build_s"] = round(time.monotonic() - t, 1)
            print(f"{name} built in {timings[f'{name}_build_s']:.0f} s", flush=True)
        shutil.rmtree(src)
        shutil.rmtree(work / "tiny", ignore_errors=True)
    out = {}
    for name, b in builds.items():
        size = sum(f.stat().st_size for f in b.glob("*.safetensors"))
        out[name] = {"path": str(b), "safetensors_gib": size / GIB, "build_s": timings[f"{name}_build_s"],
                     "planner": against_planner(m, name, built_tables(b)),
                     "step": decode_step_bytes(b, 0).model_dump()}
    out["_timings"] = timings
    return out


def serve_and_measure(name: str, model: Path, work: Path, args: argparse.Namespace, k: int,
                      int4_path: str = "kernel") -> dict:
    if int4_path == "dequantize":  # the server inherits this process's environment
        os.environ[PATH_ENV] = "dequantize"
    else:
        os.environ.pop(PATH_ENV, None)
    cfg = load_config(ROOT / "tpu.env", model=str(model), served_name=name, host="127.0.0.1", port=_port(),
                      state_dir=work / f"state-{k}", max_model_len=2048, max_num_seqs=1, cpu_kvcache_space_gib=1,
                      speculative_config="", extra_args="", start_timeout_s=1800.0)
    load_before = os.getloadavg()
    started = start_server(cfg)
    failure = None
    try:
        mem = host_memory(name, server_process_pids(started.pid), str(model))
        try:
            res = run_decode(DecodeParams(base_url=started.base_url, prompts=args.prompts,
                                          max_tokens=args.max_tokens, label=f"{name}-{k}", out=work / "runs",
                                          request_timeout_s=args.request_timeout_s))
        except ToolFailure as e:  # a build that loads but does not answer still gets its row
            res, failure = None, e.message
    finally:
        stop_server(cfg)
    out = {"build": name, "int4_path": int4_path, "start": k, "startup_s": started.startup_s,
           "dtype": cfg.cpu_dtype,
           "kv_cache_tokens": started.start_fields.kv_cache_tokens,
           "kv_cache_space_gib": cfg.cpu_kvcache_space_gib, "answered": res is not None, "failure": failure,
           "linear_kernel": started.start_fields.linear_kernel,
           "embedding_method": started.start_fields.embedding_method, "host_memory": mem.model_dump(),
           "load_average_before": load_before, "load_average_after": os.getloadavg()}
    if res is None:
        return {**out, "answers": [], "decode_tok_s": None, "median_tpot_ms": None, "median_ttft_ms": None,
                "output_tokens": [], "roofline": None, "run_dir": None}
    return {**out,
            "answers": [{"id": p.id, "text": p.text, "finish_reason": p.finish_reason} for p in res.prompts],
            "decode_tok_s": res.decode_tok_s, "median_tpot_ms": res.median_tpot_ms,
            "median_ttft_ms": res.median_ttft_ms, "output_tokens": [p.output_tokens for p in res.prompts],
            "roofline": res.roofline.model_dump() if res.roofline else None, "run_dir": res.run_dir}


def size_table(record: dict) -> list[str]:
    lines = ["| build | table | built GiB | planner GiB | built / planner |", "|---|---|---:|---:|---:|"]
    for name, b in record["builds"].items():
        pl = b["planner"]
        for t, r in pl["tables"].items():
            ratio = f"{r['ratio']:.4f}" if r["ratio"] is not None else "-"
            lines.append(f"| {name} | {t} | {r['built_gib']:.4f} | {r['planned_gib']:.3f} | {ratio} |")
        lines.append(f"| {name} | **total** | **{pl['built_gib']:.4f}** | **{pl['planned_gib']:.3f}** "
                     f"| **{pl['ratio']:.4f}** |")
    return lines


def table(record: dict) -> str:
    rows = record["runs"]
    names = list(record["builds"])
    lines = [f"{record['member']} at real shapes; source written in "
             f"{record['timings']['source_s'] or 0:.0f} s; "
             + ", ".join(f"{n} built in {record['builds'][n]['build_s'] or 0:.0f} s" for n in names) + ".", ""]
    lines += size_table(record) + [""]
    lines += ["| start | build | int4 path | vLLM ready (s) | KV tokens | RSS after load (MiB) | PSS (MiB) "
              "| decode tok/s | median TPOT ms | GiB per step | share of roofline | load avg before / after |",
              "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        rf = r["roofline"] or {}
        hm = r["host_memory"]
        lines.append(f"| {r['start']} | {r['build']} | {r.get('int4_path', 'kernel')} | {r['startup_s']:.0f} "
                     f"| {r['kv_cache_tokens'] or 0:,} "
                     f"| {hm['rss_mib']:.0f} "
                     f"| {hm['pss_mib'] or 0:.0f} | {r['decode_tok_s'] or 0:.2f} | {r['median_tpot_ms'] or 0:.0f} "
                     f"| {rf.get('step_bytes', 0) / GIB:.3f} | {100 * rf.get('fraction', 0):.1f}% "
                     f"| {r['load_average_before'][0]:.1f} / {r['load_average_after'][0]:.1f} |")
    kernel_rows = [r for r in rows if r.get("int4_path", "kernel") == "kernel"]
    med = {b: statistics.median([r["decode_tok_s"] or 0 for r in kernel_rows if r["build"] == b] or [0])
           for b in names}
    lines.append("")
    for b in names:
        for path in dict.fromkeys(r.get("int4_path", "kernel") for r in rows):
            rates = [r["decode_tok_s"] or 0 for r in rows if r["build"] == b and r.get("int4_path", "kernel") == path]
            if rates:
                lines.append(f"- {b}, int4 path {path}: median decode {statistics.median(rates):.2f} tok/s over "
                             f"{len(rates)} start(s), range {min(rates):.2f}-{max(rates):.2f}.")
    lines += same_answers(rows)
    if set(names) == set(BUILDS) and med["bf16-emb"]:
        lines += ["", f"all-4bit / bf16-emb = **{med['all-4bit'] / med['bf16-emb']:.2f}x** (the article on the "
                      "T4: 109.7 / 81.6 = 1.34x)."]
    lines.append("")
    for r in rows:
        if not r.get("answered", True):
            lines.append(f"- start {r['start']} ({r['build']}) did not answer: {r['failure']}")
        for a in r["answers"]:
            lines.append(f"- start {r['start']} ({r['build']}), prompt {a['id']} answered "
                         f"({a['finish_reason']}): {json.dumps(a['text'][:160])}")
    lines += ["", f"CPU bandwidth: {record['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s "
                  f"({record['bandwidth']['method']})."]
    return "\n".join(lines) + "\n"


def same_answers(rows: list[dict]) -> list[str]:
    """Per build and prompt: whether every int4 path's starts gave the same greedy answer."""
    texts: dict[tuple[str, str], set[str]] = {}
    paths = {r.get("int4_path", "kernel") for r in rows}
    if len(paths) < 2:
        return []
    for r in rows:
        for a in r["answers"]:
            texts.setdefault((r["build"], a["id"]), set()).add(a["text"])
    same = sum(len(v) == 1 for v in texts.values())
    return [f"- greedy answers identical across int4 paths ({', '.join(sorted(paths))}): {same} of {len(texts)} "
            "build x prompt pairs."]


def member_arg(value: str) -> Member:
    try:
        m = by_name(value)
    except RepackError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a Gemma 4 member: choose one of "
                                         f"{', '.join(MEMBERS)}") from None
    if m.moe:
        raise argparse.ArgumentTypeError(f"{m.name} is a mixture of experts; the synthetic source lays out dense "
                                         "members only")
    return m


def paths_arg(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names or set(names) - {"kernel", "dequantize"} or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma list of distinct int4 paths from kernel, dequantize")
    return names


def builds_arg(value: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in BUILDS]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{value!r}: a comma list of distinct builds from {', '.join(BUILDS)}")
    return names


def out_stem(m: Member, tag: str | None = None) -> str:
    """E2B keeps the names its evidence has always had; another member's files carry its name; a tag follows."""
    stem = "real-shapes" if m.name == "E2B" else f"real-shapes-{m.name.lower()}"
    return f"{stem}-{tag}" if tag else stem


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--member", type=member_arg, default=member_arg("e2b"),
                    help="the dense Gemma 4 member whose shapes to build: E2B (default), E4B, 12B, 31B")
    ap.add_argument("--builds", type=builds_arg, default=list(BUILDS),
                    help="comma list of the builds to make and serve (default bf16-emb,all-4bit)")
    ap.add_argument("--rounds", type=int, default=2, help="A B alternations (default 2: A B A B)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--request-timeout-s", type=float, default=600.0,
                    help="seconds a request may go without a token before that start is recorded as not answering")
    ap.add_argument("--workdir", type=Path, default=None, help="default /tmp/real-shapes-<member>")
    ap.add_argument("--out", type=Path, default=ROOT / "evidence")
    ap.add_argument("--keep", action="store_true", help="keep the builds for the next run")
    ap.add_argument("--int4-paths", type=paths_arg, default=["kernel"],
                    help="comma list of the plugin's int4 paths to serve each build with: kernel (default), "
                         "dequantize (the reference; only on a CPU without cpu_gemm_wna16)")
    ap.add_argument("--tag", default=None, help="suffix of the record's file names")
    args = ap.parse_args()
    # Interrupted or terminated (a background shell ignores SIGINT), the run still stops the server it started.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    m = args.member
    if args.workdir is None:
        args.workdir = Path(f"/tmp/real-shapes-{m.name.lower()}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    builds = prepare(m, args.builds, args.workdir)
    timings = builds.pop("_timings")
    bw = cpu_copy_bandwidth()
    runs = []
    for k in range(args.rounds):
        for name in args.builds:
            for path in args.int4_paths:
                runs.append(serve_and_measure(name, Path(builds[name]["path"]), args.workdir, args, len(runs) + 1,
                                              path))
                print(json.dumps({x: runs[-1][x] for x in ("build", "int4_path", "startup_s", "decode_tok_s")}),
                      flush=True)
    record = {"date": clock.minute(),
              "command": " ".join(["python", *sys.argv]), "cpus": os.cpu_count(), "member": m.name,
              "member_source": m.source, "timings": timings, "builds": builds,
              "bandwidth": bw.model_dump(), "runs": runs, "wall_s": time.monotonic() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = out_stem(m, args.tag)
    (args.out / f"{stem}.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / f"{stem}-table.md").write_text(table(record))
    print(table(record))
    if not args.keep:
        shutil.rmtree(args.workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
