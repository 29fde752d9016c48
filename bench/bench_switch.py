"""A switch of the build behind the front door under live traffic, on vLLM's CPU backend with the tiny
int4-embedding build, in tpu.env as shipped (FRONT_DOOR=1): the client-side figures (requests, failed, longest
wait) and the switch's wall time, for a switch beside the running build, two that fail (a build vLLM refuses to
load, one at max_model_len=16, below what its chat template renders for one word, refused by the start checks,
and one at 19, which loads and refuses what clients send) and one where the machine holds only one (hold).

    python bench/bench_switch.py [--clients 2] [--layout default|in-process]

Builds the tiny model (from the tiny-model cache when it is there) and its int4-embedding build in a temporary
folder; starts it as `./vllm-t4 start` does (tools.serving.frontdoor.service: the build on instance blue, half the cores,
vllm-router on the port clients use); then, with `--clients` closed-loop chat completions running through that
port the whole time, switches as `./vllm-t4 start --replace` does: (1) to the same build named `second`
(instance green, beside), (2) to a copy with an unknown quantization method, (3) to the build at
max_model_len=16 and (3b) at 19, each beside green (all fail: the switch's wall time is how long the front door
took to give up, with the reason), (4) to a build asking for two cores, which a 2-core machine cannot give beside
green (hold: green stops, the router holds requests while it loads). `--layout default` is vLLM's own process
layout (API server and engine core), what a user's start runs; `in-process` runs the engine in the API server's
process (VLLM_ENABLE_V1_MULTIPROCESSING=0, what the suite's shared servers use). Writes evidence/switch-<UTC
time>.json and .md. Run it under the shared lock on a shared machine (flock /tmp/gemma4-vllm.lock ...) and report
the load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.core import clock  # noqa: E402


class Clients:
    """Closed-loop chat completions through `url` from `n` threads: (status, served name, seconds) each."""

    def __init__(self, url: str, n: int):
        self.url, self.results, self.stop = url, [], threading.Event()
        self.threads = [threading.Thread(target=self.run, daemon=True) for _ in range(n)]

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=600.0) as c:
            while not self.stop.is_set():
                t = time.monotonic()
                try:
                    r = c.post(f"{self.url}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0})
                    got = (r.status_code, r.json().get("model") if r.status_code == 200 else r.text[:200])
                except Exception as exc:  # a failed request is a figure here, whatever failed
                    got = (0, repr(exc)[:200])
                self.results.append((*got, round(time.monotonic() - t, 3)))

    def __enter__(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=700)

    def figures(self) -> dict:
        failed = [r for r in self.results if r[0] != 200]
        return {"requests": len(self.results), "failed": len(failed), "failures": failed[:5],
                "longest_wait_s": max((r[2] for r in self.results), default=None),
                "served": sorted({r[1] for r in self.results if r[0] == 200})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--layout", choices=("default", "in-process"), default="default")
    args = ap.parse_args()

    from repack.build.build import BuildOptions, build_checkpoint
    from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint
    from tools.core.errors import ToolFailure
    from tools.core.process import free_port
    from tools.serving import service, stop_server
    from tools.serving.config import load_config

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.layout == "in-process" else "1"
    os.environ.pop("FRONT_DOOR", None)  # tpu.env's own value
    stamp = clock.stamp()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        src = cached_tiny_qat_checkpoint(tmpd / "gemma-4-tiny-qat").path
        emb4 = tmpd / "gemma-4-tiny-text-emb4"
        build_checkpoint(src, emb4, BuildOptions(text_only=True, embed_int4=True, embed_tokens=True))

        bad = tmpd / "gemma-4-tiny-unknown-quant"
        shutil.copytree(emb4, bad)
        config = json.loads((bad / "config.json").read_text())
        config["quantization_config"]["quant_method"] = "no-such-method"
        (bad / "config.json").write_text(json.dumps(config))

        port = free_port()

        def cfg(name: str, cpus: int | None = None, model: Path = emb4, max_model_len: int = 512):
            return load_config(ROOT / "tpu.env", model=str(model), served_name=name, host="127.0.0.1", port=port,
                               state_dir=tmpd / "run", cpus=cpus, max_model_len=max_model_len, max_num_seqs=8,
                               cpu_kvcache_space_gib=1, speculative_config="", extra_args="", start_timeout_s=900.0)

        base = cfg("first")
        assert base.front_door, "tpu.env as shipped serves through the front door"
        try:
            t0 = time.monotonic()
            first = service.start(base)
            first_s = round(time.monotonic() - t0, 1)
            url = first.base_url
            for label, b in [("beside", cfg("second")),
                             ("refused load", cfg("unknown-quant", model=bad)),
                             ("below its chat template", cfg("short", max_model_len=16)),
                             ("refuses clients", cfg("short", max_model_len=19)),
                             ("hold", cfg("third", cpus=2))]:
                with Clients(url, args.clients) as clients:
                    time.sleep(2.0)
                    t0 = time.monotonic()
                    try:
                        res = service.start(b, replace_running=True)
                        row = {"mode": res.mode, "outcome": res.outcome, "announced": res.announced,
                               "router": dataclasses.asdict(res.figures), "reason": None}
                    except ToolFailure as exc:
                        d = exc.detail or {}
                        row = {"mode": "beside", "outcome": d.get("outcome"), "announced": d.get("announced"),
                               "router": d.get("figures") or {}, "reason": str(exc)[:300],
                               "parameter": d.get("parameter")}
                    wall = time.monotonic() - t0
                    time.sleep(2.0)
                rows.append({"switch": label, "switch_wall_s": round(wall, 1), **row, "clients": clients.figures()})
                print(json.dumps(rows[-1]), flush=True)
        finally:
            service.stop(base, grace_s=10)
            for name in service.SLOTS:
                stop_server(dataclasses.replace(base, instance=name), grace_s=10)
    out = {"stamp": stamp, "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
           "clients": args.clients, "layout": args.layout, "first_start_s": first_s, "switches": rows}
    ev = ROOT / "evidence"
    (ev / f"switch-{stamp}.json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [f"# A switch behind the front door under live traffic, vLLM CPU, tiny int4-embedding build ({stamp})",
             "", f"tpu.env as shipped (FRONT_DOOR=1), `start` then `start --replace` (tools.serving.frontdoor.service); vLLM's "
             f"{'own process layout (API server, engine core)' if args.layout == 'default' else 'in-process engine'}"
             f"; {args.clients} closed-loop chat clients through the port clients use; {os.cpu_count()} CPU cores, "
             f"load average {load_before[0]:.1f} before, {out['loadavg_after'][0]:.1f} after; the first start (build "
             f"and front door) {first_s} s.", "",
             "| switch | mode | wall s | requests | failed | longest wait s | router: requests, failed, retried, no "
             "build s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        c, f = r["clients"], r["router"]
        lines.append(f"| {r['switch']} ({r['outcome']}) | {r['mode']} | {r['switch_wall_s']} | {c['requests']} | "
                     f"{c['failed']} | {c['longest_wait_s']} | {f.get('requests')}, {f.get('failed')}, "
                     f"{f.get('retried')}, {f.get('longest_wait_s')} |")
    lines += ["", "What each switch announced before anything stopped:", ""]
    lines += [f"- {r['switch']}: {r['announced']}" for r in rows]
    lines += ["", "Why the failing switches ended (the first 300 characters of the one-line failure):", ""]
    lines += [f"- {r['switch']} ({r['switch_wall_s']} s, parameter {r.get('parameter')}): {r['reason']}"
              for r in rows if r["reason"]]
    (ev / f"switch-{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote evidence/switch-{stamp}.md")
    return 0 if all(r["clients"]["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
