"""`./vllm-t4 start | stop | status | query | log | swap`: the serving tools on the command line.

Every subcommand exits 0 on success and prints `vllm-t4 <command>: <reason>` (one line) and exits non-zero
otherwise. `--env-file` picks another tpu.env; `--json` prints the result as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from tools.cli.commands import emit as _emit, guard as _guard
from tools.serving.ops import (LogParams, QueryParams, RouterStartParams, RouterStopParams, StartParams,
                               StatusParams, StopParams)
from tools.core.errors import BadInput


def _config(args: argparse.Namespace, **overrides: Any):
    from tools.serving.config import load_config

    return load_config(args.env_file, **overrides)


def _fmt_fields(f) -> list[str]:
    if f is None:
        return []
    out = []
    if f.model_loading_gib is not None:
        out.append(f"Model loading {f.model_loading_gib:g} GiB in {f.model_loading_s:g} s")
    elif f.weights_loading_s is not None:
        out.append(f"Weights loaded in {f.weights_loading_s:g} s")
    if f.kv_cache_tokens is not None:
        kv = f"KV cache {f.kv_cache_tokens:,} tokens"
        if f.max_concurrency is not None:
            kv += f", max concurrency {f.max_concurrency:g}x at {f.max_concurrency_tokens:,} tokens"
        out.append(kv)
    compile_s = f.torch_compile_s if f.torch_compile_s is not None else f.warmup_s
    if f.eager:
        out.append("eager (--enforce-eager: no torch.compile; CPU_COMPILE=1 in tpu.env compiles)")
    else:
        start = {True: "cold start (compiled)", False: "warm start (compile cache)", None: "compile cache: unknown"}
        out.append(start[f.cold_start] + (f", compile {compile_s:g} s" if compile_s is not None else ""))
    if f.compile_cache_note:
        out.append(f.compile_cache_note)
    kernels = [k for k in (f.linear_kernel, f.embedding_method, f.attention_backend) if k]
    if kernels:
        out.append("Kernels: " + ", ".join(kernels))
    return out


def cmd_start(args: argparse.Namespace) -> int:
    from tools.serving.vllm_server import start_server

    cfg = _config(args, **StartParams.from_cli_args(args).overrides())
    last = [-1]

    def progress(frac: float, msg: str) -> None:
        pct = int(frac * 100)
        if not args.json and (pct // 5 != last[0] // 5 or frac >= 1.0):  # a line every 5% of the timeout
            last[0] = pct
            print(f"[{pct:3d}%] {msg}", file=sys.stderr, flush=True)

    print(f"starting {cfg.served_name} at {cfg.base_url} (log: {cfg.log_file})", file=sys.stderr, flush=True)
    r = start_server(cfg, progress=progress)
    lines = [f"Serving at {r.base_url} (pid {r.pid}), model {r.served_name}, ready in {r.startup_s:g} s"]
    if r.max_model_len_note:
        lines.append("  " + r.max_model_len_note)
    lines += ["  " + ln for ln in _fmt_fields(r.start_fields)]
    _emit(args, r, "\n".join(lines))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from tools.serving.vllm_server import stop_server

    p = StopParams.from_cli_args(args)
    if p.all:
        if p.instance is not None:
            raise BadInput("--all and --instance exclude each other: pass one", {})
        from tools.serving.instances import stop_all

        results = stop_all(_config(args), grace_s=p.grace_s)
        if args.json:
            print(json.dumps({"stopped": [r.to_dict() for r in results]}))
        else:
            print("\n".join(r.message for r in results))
        return 0
    r = stop_server(_config(args, instance=p.instance), grace_s=p.grace_s)
    _emit(args, r, r.message)
    return 0


def _status_lines(st, named: bool = True) -> list[str]:
    lines = [f"[{st.instance}] {st.message}" if named else st.message]
    if st.alive:
        lines.append(f"  model {st.model}, up {st.uptime_s:g} s, health {'ok' if st.healthy else 'failing'}")
        if st.gpus is not None or st.cpu_cores is not None:
            lines.append("  " + (f"GPUs {','.join(map(str, st.gpus))}" if st.gpus is not None
                                 else "CPU cores " + " | ".join(",".join(map(str, c)) for c in st.cpu_cores)))
        if st.vram is not None:
            lines.append(f"  VRAM {st.vram.used_mib} MiB / {st.vram.total_mib} MiB"
                         + (f", {st.vram.utilization_pct} %" if st.vram.utilization_pct is not None else ""))
        lines += ["  " + ln for ln in _fmt_fields(st.start_fields)]
    return lines


def cmd_status(args: argparse.Namespace) -> int:
    from tools.serving.vllm_server import server_status

    p = StatusParams.from_cli_args(args)
    cfg = _config(args, instance=p.instance)
    if p.instance is not None:  # one instance
        st = server_status(cfg)
        _emit(args, st, "\n".join(_status_lines(st)))
        return 0 if (st.alive and st.healthy) or args.any else 3
    from tools.serving.instances import fleet_status

    st = fleet_status(cfg)
    # The default instance alone reads as before instances; several are each labelled with their name.
    named = any(i.instance != "default" for i in st.instances)
    lines = [ln for i in st.instances for ln in _status_lines(i, named)] or [st.message]
    if st.router is not None:
        lines.append(f"[router] {st.router['message']}")
    _emit(args, st, "\n".join(lines))
    # Scripts can tell a healthy fleet from anything else by the exit code alone.
    return 0 if st.all_healthy or args.any else 3


def cmd_query(args: argparse.Namespace) -> int:
    from tools.serving.vllm_server import query

    p = QueryParams.from_cli_args(args)
    r = query(_config(args, instance=p.instance), p.prompt, max_tokens=p.max_tokens)
    _emit(args, r, r.text + "\n" + json.dumps(r.usage))
    return 0


def cmd_log(args: argparse.Namespace) -> int:
    from tools.serving.vllm_server import read_log

    p = LogParams.from_cli_args(args)
    print(read_log(_config(args, instance=p.instance), p.lines))
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    from tools.serving import router

    cfg = _config(args)
    if args.action == "start":
        p = RouterStartParams.from_cli_args(args)
        r = router.start_router(cfg, p.instances, policy=p.policy, port=p.port)
        _emit(args, r, f"routing at {r.base_url} ({r.policy}, pid {r.pid}) over "
                       + ", ".join(f"{b.instance} {b.base_url}" for b in r.backends))
        return 0
    if args.action == "stop":
        r = router.stop_router(cfg, grace_s=RouterStopParams.from_cli_args(args).grace_s)
        _emit(args, r, r.message)
        return 0
    st = router.router_status(cfg)
    lines = [st.message] + [f"  {n}: {'healthy' if ok else 'not answering'}" for n, ok in st.backends_healthy.items()]
    _emit(args, st, "\n".join(lines))
    return 0 if st.alive and st.healthy else 3


def cmd_swap(args: argparse.Namespace) -> int:
    from tools.serving.swap import ensure_swap, swap_report

    cfg = _config(args)
    r = swap_report(cfg) if args.report else ensure_swap(cfg)
    _emit(args, r, r.message + ("" if r.action == "none" else f" ({r.action} {cfg.swapfile})"))
    return 0


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    def add(name: str, func: Callable[[argparse.Namespace], int], help_: str, json_opt: bool = True):
        p = sub.add_parser(name, help=help_, description=help_)
        p.add_argument("--env-file", default=None, help="configuration file (default: the project's tpu.env)")
        if json_opt:
            p.add_argument("--json", action="store_true", help="print the result as one JSON object")
        # Bad input (an option, an instance name, a port another instance holds) exits 2, failures 1.
        p.set_defaults(func=_guard(name, func, status=lambda exc: 2 if isinstance(exc, BadInput) else 1))
        return p

    p = add("start", cmd_start, "start vLLM detached with the flags in tpu.env and wait until it answers")
    StartParams.add_cli_args(p)

    p = add("stop", cmd_stop, "stop the server: SIGTERM to its process group, SIGKILL after a grace period")
    StopParams.add_cli_args(p)

    p = add("status", cmd_status, "every instance (or --instance NAME): alive, healthy, what its start reported "
                                  "(exit 3 unless each reported is serving)")
    StatusParams.add_cli_args(p)
    p.add_argument("--any", action="store_true", help="exit 0 even when no healthy server runs")

    p = add("query", cmd_query, "one chat completion at temperature 0: prints the text and the usage")
    QueryParams.add_cli_args(p)

    p = add("log", cmd_log, "print the last lines of the server log", json_opt=False)
    LogParams.add_cli_args(p)

    p = sub.add_parser("router", help="vllm-router in front of running instances: start, status, stop",
                       description="vLLM's router (round_robin, cache_aware, power_of_two, ...) over named "
                                   "instances, tracked like a server (state and log in STATE_DIR).")
    acts = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, help_, params in (("start", "start the router over --instances a,b", RouterStartParams),
                                  ("status", "is the router up, and its backends (exit 3 if not)", None),
                                  ("stop", "stop the router: SIGTERM, SIGKILL after --grace", RouterStopParams)):
        a = acts.add_parser(action, help=help_, description=help_)
        a.add_argument("--env-file", default=None, help="configuration file (default: the project's tpu.env)")
        a.add_argument("--json", action="store_true", help="print the result as one JSON object")
        if params is not None:
            params.add_cli_args(a)
        a.set_defaults(func=_guard(f"router {action}", cmd_router,
                                   status=lambda exc: 2 if isinstance(exc, BadInput) else 1))

    p = add("swap", cmd_swap, "create and enable the swapfile from tpu.env when it is not on (root), and report")
    p.add_argument("--report", action="store_true", help="only report what swap is on")
