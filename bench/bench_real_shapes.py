"""Single-stream decode of the two E2B builds at the real model's shapes on vLLM's CPU backend: the article's
decode claim (all-4-bit 1.34x the bf16-embedding build on the T4) tested on the hardware we have.

    flock /tmp/gemma4-vllm.lock .venv/bin/python bench/bench_real_shapes.py [--rounds 2] [--prompts 3]
        [--max-tokens 24] [--workdir /tmp/real-shapes] [--out evidence]

Writes a full-size synthetic source (repack.synthetic.write_e2b_checkpoint, fill "tiled": the real shapes and
the grid, values repeated per tensor, since decode speed does not depend on them; the tiny model's tokenizer,
widened to the full vocabulary), repacks it in one pass twice (bf16 embeddings: linears int4; all-4-bit:
linears, both embedding tables and the untied output layer int4), deletes the source, then serves the builds
one at a time, alternating A B A B so the machine's load falls on both, and per start: the host memory of the
engine's processes after load (tools.gpu.vram.host_memory), the decode benchmark (tools.measure.decode.run) on the
first `--prompts` shipped prompts, greedy, with its roofline figure (the CPU's measured copy bandwidth).
Writes evidence/real-shapes.json and a table (evidence/real-shapes-table.md) to fold into real-shapes.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from repack.build import BuildOptions, build_checkpoint  # noqa: E402
from repack.synthetic import copy_tokenizer, write_e2b_checkpoint  # noqa: E402
from repack.tiny_model import cached_tiny_qat_checkpoint  # noqa: E402
from tools.gpu.vram import host_memory, server_process_pids  # noqa: E402
from tools.measure.decode.params import DecodeParams  # noqa: E402
from tools.measure.decode.run import run_decode  # noqa: E402
from tools.measure.roofline import cpu_copy_bandwidth, decode_step_bytes  # noqa: E402
from tools.serving.config import load_config  # noqa: E402
from tools.serving.launch import start_server  # noqa: E402
from tools.serving.vllm_server import stop_server  # noqa: E402

GIB = 2**30
BUILDS = {"bf16-emb": BuildOptions(text_only=True, embed_int4=False, embed_tokens=False),
          "all-4bit": BuildOptions(text_only=True, embed_int4=True, embed_tokens=True)}
NEED_BYTES = 22 * 10**9  # source 10.3 GB + builds 6.6 + 2.8 GB, with room


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(work: Path) -> dict[str, dict]:
    """The two builds at real shapes (reused when a previous run left them), with their sizes."""
    free = shutil.disk_usage(work.parent if not work.exists() else work).free
    builds = {name: work / name for name in BUILDS}
    if not all((b / "config.json").is_file() for b in builds.values()):
        if free < NEED_BYTES:
            raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, the run needs {NEED_BYTES / 1e9:.0f} GB")
        src = work / "e2b-synthetic-tiled"
        t = time.monotonic()
        write_e2b_checkpoint(src, 1.0, fill="tiled")
        tiny = cached_tiny_qat_checkpoint(work / "tiny").path
        copy_tokenizer(tiny, src, 262144)
        print(f"source written in {time.monotonic() - t:.0f} s", flush=True)
        for name, opt in BUILDS.items():
            t = time.monotonic()
            build_checkpoint(src, builds[name], opt)
            print(f"{name} built in {time.monotonic() - t:.0f} s", flush=True)
        shutil.rmtree(src)
        shutil.rmtree(work / "tiny", ignore_errors=True)
    out = {}
    for name, b in builds.items():
        size = sum(f.stat().st_size for f in b.glob("*.safetensors"))
        out[name] = {"path": str(b), "safetensors_gib": size / GIB,
                     "step": decode_step_bytes(b, 0).model_dump()}
    return out


def serve_and_measure(name: str, model: Path, work: Path, args: argparse.Namespace, k: int) -> dict:
    cfg = load_config(ROOT / "tpu.env", model=str(model), served_name=name, host="127.0.0.1", port=_port(),
                      state_dir=work / f"state-{k}", max_model_len=2048, max_num_seqs=1, cpu_kvcache_space_gib=1,
                      speculative_config="", extra_args="", start_timeout_s=1800.0)
    load_before = os.getloadavg()
    started = start_server(cfg)
    try:
        mem = host_memory(name, server_process_pids(started.pid), str(model))
        res = run_decode(DecodeParams(base_url=started.base_url, prompts=args.prompts, max_tokens=args.max_tokens,
                                      label=f"{name}-{k}", out=work / "runs"))
    finally:
        stop_server(cfg)
    return {"build": name, "start": k, "startup_s": started.startup_s, "dtype": cfg.cpu_dtype,
            "linear_kernel": started.start_fields.linear_kernel,
            "embedding_method": started.start_fields.embedding_method,
            "host_memory": mem.model_dump(), "decode_tok_s": res.decode_tok_s, "median_tpot_ms": res.median_tpot_ms,
            "median_ttft_ms": res.median_ttft_ms, "output_tokens": [p.output_tokens for p in res.prompts],
            "roofline": res.roofline.model_dump() if res.roofline else None, "run_dir": res.run_dir,
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def table(record: dict) -> str:
    rows = record["runs"]
    lines = ["| start | build | vLLM ready (s) | RSS after load (MiB) | PSS (MiB) | decode tok/s | median TPOT ms "
             "| GiB per step | share of roofline | load avg before / after |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        rf = r["roofline"] or {}
        hm = r["host_memory"]
        lines.append(f"| {r['start']} | {r['build']} | {r['startup_s']:.0f} | {hm['rss_mib']:.0f} "
                     f"| {hm['pss_mib'] or 0:.0f} | {r['decode_tok_s'] or 0:.2f} | {r['median_tpot_ms'] or 0:.0f} "
                     f"| {rf.get('step_bytes', 0) / GIB:.3f} | {100 * rf.get('fraction', 0):.1f}% "
                     f"| {r['load_average_before'][0]:.1f} / {r['load_average_after'][0]:.1f} |")
    med = {b: statistics.median(r["decode_tok_s"] for r in rows if r["build"] == b) for b in BUILDS}
    lines += ["", f"Median decode tok/s: bf16-emb {med['bf16-emb']:.2f}, all-4bit {med['all-4bit']:.2f}: "
                  f"all-4bit / bf16-emb = **{med['all-4bit'] / med['bf16-emb']:.2f}x** (the article on the T4: "
                  "109.7 / 81.6 = 1.34x).", "",
              f"CPU bandwidth: {record['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s ({record['bandwidth']['method']})."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="A B alternations (default 2: A B A B)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/real-shapes"))
    ap.add_argument("--out", type=Path, default=ROOT / "evidence")
    ap.add_argument("--keep", action="store_true", help="keep the builds for the next run")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    builds = prepare(args.workdir)
    bw = cpu_copy_bandwidth()
    runs = []
    for k in range(args.rounds):
        for name in BUILDS:
            runs.append(serve_and_measure(name, Path(builds[name]["path"]), args.workdir, args, len(runs) + 1))
            print(json.dumps({x: runs[-1][x] for x in ("build", "startup_s", "decode_tok_s")}), flush=True)
    record = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": " ".join(["python", *sys.argv]), "cpus": os.cpu_count(), "builds": builds,
              "bandwidth": bw.model_dump(), "runs": runs, "wall_s": time.monotonic() - t0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "real-shapes.json").write_text(json.dumps(record, indent=2) + "\n")
    (args.out / "real-shapes-table.md").write_text(table(record))
    print(table(record))
    if not args.keep:
        shutil.rmtree(args.workdir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
