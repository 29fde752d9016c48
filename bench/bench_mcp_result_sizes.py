#!/usr/bin/env python3
"""The largest default result of each tool and resource an assistant meets on the walk, as it receives them.

Drives server.py over stdio with the default toolsets, from an empty models root, on vLLM's CPU backend: the
deploy_cpu prompt's calls, then compare_builds' (two vLLM starts), then what the issue's walk added: a token check
with the long (~2k/8k/14k-token) prompts, a capacity search reached through enable_toolset, and every resource.
The figure per tool is the characters of the text content it returns (the summary line and the JSON); per
resource, its text. A step that fails ends the run (nothing is written): its figure would be an error line's. Writes evidence/mcp-result-sizes.md. Runs real vLLM: take the suite's lock,

    flock /tmp/gemma4-vllm.lock .venv/bin/python bench/bench_mcp_result_sizes.py
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastmcp import Client  # noqa: E402
from fastmcp.client.transports import StdioTransport  # noqa: E402
from tools.core import clock  # noqa: E402

from tools.mcp.bounded import RESULT_BUDGET  # noqa: E402
from tools.mcp.resources import PROMPTS, SCHEME, Ref  # noqa: E402

# The tiny build's sizes, as tests/mcp/test_mcp_stdio.py runs the walk; the token check keeps its 160 tokens.
TINY_SWEEP = {"input_lens": [32], "output_len": 8, "concurrencies": [1, 2], "repeats": 2, "warmup": False,
              "min_prompts": 2, "prompts_per_concurrency": 1}
TINY = {"run_sweep": TINY_SWEEP, "query_model": {"max_tokens": 8}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chars(result) -> int:
    return sum(len(getattr(c, "text", "") or "") for c in result.content)


async def walk(models: Path, evidence: Path, state: Path, env: dict[str, str]) -> dict[str, tuple[int, str]]:
    """{tool or resource: (largest characters, the call that gave it)} over the walk."""
    sizes: dict[str, tuple[int, str]] = {}
    results: dict[tuple[str, int], dict] = {}

    def note(key: str, n: int, where: str) -> None:
        if n > sizes.get(key, (-1, ""))[0]:
            sizes[key] = (n, where)

    transport = StdioTransport(command=sys.executable, cwd="/", env=env, keep_alive=False, args=[
        str(ROOT / "server.py"), "--models-root", str(models), "--evidence-root", str(evidence),
        "--state-dir", str(state)])
    cpu = PROMPTS["deploy_cpu"].values()
    values = {"deploy_cpu": {}, "compare_builds": {"build_a": cpu["output"], "build_b": cpu["output_bf16"],
                                                   "source": cpu["source"]}}

    def resolve(name: str, v):
        if isinstance(v, Ref):
            return results[(name, v.step)][v.field]
        return [resolve(name, x) for x in v] if isinstance(v, list) else v

    async with Client(transport, timeout=3600) as c:
        async def call(tool: str, args: dict, where: str, *, refusal: bool = False):
            r = await c.call_tool(tool, args, raise_on_error=False)
            if r.is_error and not refusal:  # a failed step measures nothing of the walk: stop, saying why
                raise SystemExit(f"{where}: {tool} failed: {r.content[0].text}")
            note(tool, _chars(r), where + (" (its refusal)" if refusal else ""))
            print(f"{where}: {tool} {_chars(r):,} characters", flush=True)
            return r

        try:
            for name in ("deploy_cpu", "compare_builds"):
                for i, step in enumerate(PROMPTS[name].bind(values[name]), 1):
                    if step.condition == "source_missing" and (models / step.args["out"]).exists():
                        continue
                    if step.condition == "build_b_missing" and (models / step.args["output"]).exists():
                        continue
                    if step.condition == "a_not_served":
                        st = (await c.call_tool("server_status", {})).structured_content
                        if st["alive"] and st["model"] == str(models / values[name]["build_a"]):
                            continue
                    if step.tool == "stop_vllm_server":  # after the long prompts and the capacity search
                        continue
                    tiny = {} if step.args.get("mode") == "check" else TINY.get(step.tool, {})
                    args = {k: resolve(name, v) for k, v in step.args.items()} | tiny
                    r = await call(step.tool, args, f"{name} step {i}")
                    results[(name, i)] = r.structured_content or {}
            # The long prompts: recorded and checked against the build served now.
            ref = str(evidence / "tokens" / "long.json")
            await call("compare_tokens", {"mode": "record", "reference": ref, "long": True}, "long record")
            await call("compare_tokens", {"mode": "check", "reference": ref}, "long check")
            await call("find_capacity", {}, "capacity before enable_toolset", refusal=True)
            await call("enable_toolset", {"toolset": "capacity"}, "enable capacity")
            await call("find_capacity", {"slo": "ttft_p99_ms=2000", "input_len": 32, "output_len": 8,
                                         "max_load": 8, "repeats": 2, "label": "tiny"}, "capacity search")
            for tool in ("server_status", "vram_status", "preflight"):
                await call(tool, {}, "after the walk")
            for uri in (f"{SCHEME}://config", f"{SCHEME}://evidence/runs", f"{SCHEME}://server/log"):
                text = (await c.read_resource(uri))[0].text
                note(uri, len(text), "after the walk")
            await call("stop_vllm_server", {"grace_s": 10}, "compare_builds' last step")
        finally:
            await c.call_tool("stop_vllm_server", {"grace_s": 10}, raise_on_error=False)
    return sizes


def main() -> int:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mcp-sizes-") as tmp:
        models, evidence, state = (Path(tmp) / n for n in ("models", "evidence", "run"))
        models.mkdir()
        evidence.mkdir()
        env = dict(os.environ, PORT=str(_free_port()), MAX_MODEL_LEN="16384", MAX_NUM_SEQS="4",
                   CPU_KVCACHE_SPACE_GIB="1", SPECULATIVE_CONFIG="", EXTRA_ARGS="", START_TIMEOUT_S="900")
        env.pop("GEMMA4_T4_TOOLSETS", None)
        sizes = asyncio.run(walk(models, evidence, state, env))
    over = [k for k, (n, _) in sizes.items() if n > RESULT_BUDGET]
    lines = ["# Largest default MCP result per tool and resource", "",
             f"Measured {clock.minute()} with `bench/bench_mcp_result_sizes.py` "
             f"({time.monotonic() - t0:.0f} s): server.py over stdio, default toolsets, vLLM CPU on the tiny "
             "build; the deploy_cpu and compare_builds walk, a token record and check with the long prompts, a "
             "capacity search reached through enable_toolset, and the resources. Characters of the text a client "
             f"receives (a tool's summary line and JSON; a resource's text). Budget {RESULT_BUDGET:,}: "
             + ("every result within it." if not over else f"OVER for {', '.join(over)}."), "",
             "| Tool or resource | Largest result (characters) | Where |", "|---|---|---|"]
    lines += [f"| `{k}` | {n:,} | {w} |" for k, (n, w) in sorted(sizes.items(), key=lambda kv: -kv[1][0])]
    lines += ["", "Before the budget (issue 37, the same walk by an assistant): compare_tokens check 29,845 and "
                  "record 25,849, the server log 28,282, evidence/runs 7,049, repack_checkpoint about 6,000, "
                  "compare_sweeps 5,699."]
    out = ROOT / "evidence" / "mcp-result-sizes.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
