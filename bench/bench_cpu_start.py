"""Start time of vLLM's CPU backend on the tiny int4-embedding build: eager (the CPU default) against compiled
(CPU_COMPILE=1), with the greedy tokens of both compared.

    python bench/bench_cpu_start.py [--rounds 1] [--sweep-overhead]

Builds the tiny model (from the tiny-model cache when it is there) and its int4-embedding build in a temporary
folder, starts it `--rounds` times each way (eager first, then compiled, alternating), answers the same prompts
at temperature 0 each time, and writes evidence/cpu-start-<UTC time>.json and .md. With --sweep-overhead it
leaves one more eager server up for `bench/bench_sweep_overhead.py --parts 1,3` and stops it after.
Run it under the shared lock on a shared machine (flock /tmp/gemma4-vllm.lock ...) and report the load.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.core import clock  # noqa: E402

PROMPTS = ["abcdefgh", "The quick brown fox", "0123456789", "Gemma on a T4"]


def _tokens(base_url: str, served: str) -> list[list[int]]:
    import httpx

    out = []
    for p in PROMPTS:
        r = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
            "model": served, "prompt": p, "max_tokens": 16, "temperature": 0, "return_token_ids": True})
        r.raise_for_status()
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--sweep-overhead", action="store_true",
                    help="then run bench/bench_sweep_overhead.py --parts 1,3 against an eager server")
    ap.add_argument("--out", default=str(ROOT / "evidence"))
    args = ap.parse_args()

    from repack.build.build import BuildOptions, build_checkpoint
    from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint
    from tools.serving.config import load_config
    from tools.serving import start_server, stop_server
    from tools.measure.provenance import collect

    rows: list[dict] = []
    sweep_md = ""
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        t = time.monotonic()
        src = cached_tiny_qat_checkpoint(tmpd / "gemma-4-tiny-qat").path
        emb4 = tmpd / "gemma-4-tiny-text-emb4"
        build_checkpoint(src, emb4, BuildOptions(text_only=True, embed_int4=True, embed_tokens=True))
        prep_s = time.monotonic() - t

        def cfg_for(compiled: bool):
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            return load_config(ROOT / "tpu.env", model=str(emb4), served_name="tiny-emb4", host="127.0.0.1",
                               port=port, state_dir=tmpd / f"state-{len(rows)}", max_model_len=1024,
                               max_num_seqs=8, cpu_kvcache_space_gib=1, speculative_config="", extra_args="",
                               cpu_compile=compiled, start_timeout_s=1800.0)

        prov = None
        for _ in range(args.rounds):
            for compiled in (False, True):
                cfg = cfg_for(compiled)
                t = time.monotonic()
                started = start_server(cfg)
                wall = time.monotonic() - t
                try:
                    toks = _tokens(started.base_url, cfg.served_name)
                    prov = prov or collect(started.base_url).to_dict()
                finally:
                    stop_server(cfg)
                rows.append({"mode": "compiled" if compiled else "eager", "startup_s": started.startup_s,
                             "start_call_s": wall, "eager_field": started.start_fields.eager,
                             "cold_start": started.start_fields.cold_start, "dtype": cfg.cpu_dtype,
                             "tokens": toks, "load_average_after": os.getloadavg()})

        if args.sweep_overhead:
            cfg = cfg_for(False)
            started = start_server(cfg)
            try:
                done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_sweep_overhead.py"), "--base-url",
                                       started.base_url, "--parts", "1,3", "--out", args.out],
                                      cwd=ROOT, capture_output=True, text=True)
                sweep_md = done.stdout if done.returncode == 0 else f"failed ({done.returncode}): {done.stderr[-2000:]}"
            finally:
                stop_server(cfg)

    eager = [r for r in rows if r["mode"] == "eager"]
    same = all(r["tokens"] == eager[0]["tokens"] for r in rows)
    stamp = clock.stamp()
    command = " ".join(["python", *sys.argv])
    record = {"date": stamp, "command": command, "prep_s": prep_s, "starts": rows,
              "greedy_tokens_identical_across_starts": same, "provenance": prov}
    lines = [f"# vLLM CPU start of the tiny int4-embedding build: eager vs compiled ({stamp})", "",
             f"Command: `{command}` (under `flock /tmp/gemma4-vllm.lock`). {os.cpu_count()} CPUs, "
             f"vLLM {prov and prov.get('vllm_version_server')}, max_model_len 1024, dtype {rows[0]['dtype']}.", "",
             "| start | mode | vLLM ready after (s) | start call (s) | load average (1/5/15) after |",
             "|---|---|---|---|---|"]
    for i, r in enumerate(rows):
        la = " / ".join(f"{x:.1f}" for x in r["load_average_after"])
        lines.append(f"| {i + 1} | {r['mode']} | {r['startup_s']:.1f} | {r['start_call_s']:.1f} | {la} |")
    lines += ["", f"Greedy tokens (4 prompts x 16 tokens) identical across every start: **{same}**.", ""]
    if sweep_md:
        lines += ["## Sweep harness overhead on an eager server of the same build", "", sweep_md, ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"cpu-start-{stamp}.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / f"cpu-start-{stamp}.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
