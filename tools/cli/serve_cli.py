"""`./vllm-t4 start | stop | status | query | log | router | swap`: the serving tools on the command line.

Every subcommand exits 0 on success and prints `vllm-t4 <command>: <reason>` (one line) and exits non-zero
otherwise: 2 for input to change (an option, an instance name, a port another instance holds), 1 for a failure;
`status` and `router status` exit 3 unless what they report is serving. `--env-file` picks another tpu.env;
`--json` prints the result as one JSON object.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Any

from tools.core.commands import CLI, Command, add_commands, emit as _emit
from tools.core.errors import BadInput, param, render, render_all
from tools.core.process import free_port
from tools.core.progress import Progress
from tools.serving import (StartResult, SwitchResult, ensure_swap, fleet_status, query, read_log, replace_file,
                           replace_target as target, router, server_status, service, stop_all, swap_report,
                           switch_process)
from tools.serving.config import ServeConfig, load_config
from tools.serving import Unrecorded
from tools.serving.ops import (LogParams, QueryParams, RouterStartParams, RouterStopParams, RouterSwitchParams,
                               StartParams, StatusParams, StopParams)
from tools.core.jsonout import dumps


def emit(args: argparse.Namespace, obj: Any, text: str) -> None:
    """commands.emit with the marked remedies in results (a replace's note) spelled as command lines."""
    _emit(args, render_all(obj.to_dict(), CLI) if getattr(args, "json", False) else obj, render(text, CLI))


def _start_progress(args: argparse.Namespace) -> Progress:
    """A start's or a switch's progress on stderr as a percentage (reported only with news: a phase, or a line not
    seen before); nothing under --json."""
    def show(done: float, total: float | None, msg: str) -> None:
        if not args.json:
            print(f"[{int(done / (total or 1.0) * 100):3d}%] {msg}", file=sys.stderr, flush=True)
    return show


def _after_line(line: str, progress: Progress) -> Progress:
    """`progress`, with `line` on stderr before its first report."""
    said = []

    def show(done: float, total: float | None, msg: str) -> None:
        if not said:
            said.append(True)
            print(line, file=sys.stderr, flush=True)
        progress(done, total, msg)
    return show


def _config(args: argparse.Namespace, **overrides: Any) -> ServeConfig:
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


def cmd_start(p: StartParams, args: argparse.Namespace) -> int:
    cfg = _config(args, **p.overrides())

    progress = _start_progress(args)
    rt = None if cfg.instance else service.door(cfg)  # read once: the start goes on with what was said here
    if service.behind_door(cfg, rt):
        where = f"behind the front door at {rt.base_url if rt else cfg.base_url}"
    else:
        where = f"at {(target(cfg) if p.replace else cfg).base_url}"  # a replace serves on the replaced one's port
    # said at the start's first news, after its checks: a start they refuse prints its one-line refusal alone
    progress = _after_line(f"starting {cfg.served_name} {where} (logs: {cfg.state_dir})", progress)
    # Owned until ready (service.start): a SIGKILL of this command while vLLM starts ends that server too; once
    # it serves it is handed over (it outlives the command, recorded in its state file).
    r = service.start(cfg, replace_running=p.replace, new_key=bool(p.new_key), progress=progress, rt=rt)
    lines = [service.describe(r)]
    if isinstance(r, StartResult):
        if r.note:
            lines.append("  " + r.note)
        if r.max_model_len_note:
            lines.append("  " + r.max_model_len_note)
        lines += ["  " + ln for ln in _fmt_fields(r.start_fields)]
    emit(args, r, "\n".join(lines + _warning_lines(r)))
    return 0


def cmd_stop(p: StopParams, args: argparse.Namespace) -> int:
    if p.all:
        if p.instance is not None:
            raise BadInput(f"{param('all')} and {param('instance')} exclude each other: pass one", {})
        results = stop_all(_config(args), grace_s=p.grace_s)
        if args.json:
            print(dumps({"stopped": [r.to_dict() for r in results]}))
        else:
            print("\n".join(r.message for r in results))
        return 0
    results = service.stop(_config(args, instance=p.instance), grace_s=p.grace_s)
    if len(results) == 1:
        emit(args, results[0], results[0].message)
    elif args.json:
        print(dumps({"stopped": [r.to_dict() for r in results]}))
    else:
        print("\n".join(r.message for r in results))
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
        if st.memory is not None:
            lines.append(f"  {st.memory['line']}")
        lines += ["  " + ln for ln in _fmt_fields(st.start_fields)]
    return lines


def cmd_status(p: StatusParams, args: argparse.Namespace) -> int:
    cfg = _config(args, instance=p.instance)
    if p.instance is not None:  # one instance
        st = server_status(cfg)
        emit(args, st, "\n".join(_status_lines(st)))
        return 0 if (st.alive and st.healthy) or args.any else 3
    default_cfg = replace(cfg, instance="")
    had_default = default_cfg.state_file.is_file() or replace_file(default_cfg).is_file()
    st = fleet_status(cfg)
    # The default instance alone reads as before instances; several are each labelled with their name.
    shown = ([st] if had_default else []) + st.instances
    named = bool(st.instances)
    lines = [ln for i in shown for ln in _status_lines(i, named)]
    if not lines or (service.behind_door(cfg) and not had_default and st.router is not None):
        lines.insert(0, st.message)  # the front door, then the builds behind it
    if st.router is not None:
        lines.append(f"[router] {st.router['message']}")
    if st.unrecorded and st.message not in lines:  # a server a damaged or forged record hides: shown, not only counted
        lines += [f"[unrecorded] {Unrecorded(**u).line()}" for u in st.unrecorded]
    emit(args, st, "\n".join(lines))
    # Scripts can tell a healthy fleet from anything else by the exit code alone.
    return 0 if st.all_healthy or args.any else 3


def cmd_query(p: QueryParams, args: argparse.Namespace) -> int:
    r = query(_config(args, instance=p.instance), p.prompt, max_tokens=p.max_tokens)
    emit(args, r, r.text + "\n" + dumps(r.usage))
    return 0


def cmd_log(p: LogParams, args: argparse.Namespace) -> int:
    print(read_log(_config(args, instance=p.instance), p.lines))
    return 0


def cmd_router_start(p: RouterStartParams, args: argparse.Namespace) -> int:
    r = router.start_router(_config(args), p.instances, policy=p.policy, port=p.port, hold_s=p.hold_s)
    emit(args, r, f"routing at {r.base_url} ({r.policy}, pid {r.pid}) over "
                  + ", ".join(f"{b.instance} {b.base_url}" for b in r.backends))
    return 0


def cmd_router_switch(p: RouterSwitchParams, args: argparse.Namespace) -> int:
    progress = _start_progress(args)
    # In a process of its own: a command killed here (SIGKILL, a closed terminal) leaves the switch to end alone
    r = switch_process.switch(_config(args), _switch_config(args, p), from_instance=p.from_instance,
                              progress=progress)
    emit(args, r, "\n".join([service.describe(r), *_warning_lines(r)]))
    return 0


def _warning_lines(r: StartResult | SwitchResult) -> list[str]:
    """The start's checks that warn, a line each as preflight says it."""
    return [f"  warning: {w}" for w in r.warnings]


def _switch_config(args: argparse.Namespace, p: RouterSwitchParams) -> ServeConfig:
    """The new build's instance config: an internal port of its own unless one is given."""
    cfg = _config(args, **p.overrides())
    return cfg if p.port is not None else replace(cfg, port=free_port(cfg.host))


def cmd_router_status(_: None, args: argparse.Namespace) -> int:
    st = router.router_status(_config(args))
    lines = [st.message] + [f"  {n}: {'healthy' if ok else 'not answering'}" for n, ok in st.backends_healthy.items()]
    emit(args, st, "\n".join(lines))
    return 0 if st.alive and st.healthy else 3


def cmd_router_stop(p: RouterStopParams, args: argparse.Namespace) -> int:
    r = router.stop_router(_config(args), grace_s=p.grace_s)
    emit(args, r, r.message)
    return 0


def cmd_swap(_: None, args: argparse.Namespace) -> int:
    cfg = _config(args)
    r = swap_report(cfg) if args.report else ensure_swap(cfg)
    emit(args, r, r.message + ("" if r.action == "none" else f" ({r.action} {cfg.swapfile})"))
    return 0


def _any_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--any", action="store_true", help="exit 0 even when no healthy server runs")


def _report_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--report", action="store_true", help="only report what swap is on")


COMMANDS: list[Command] = [
    Command("start", "start vLLM detached with the flags in tpu.env and wait until it answers", cmd_start,
            StartParams, env_file=True),
    Command("stop", "stop the server: SIGTERM to its process group, SIGKILL after a grace period", cmd_stop,
            StopParams, env_file=True),
    Command("status", "every instance (or --instance NAME): alive, healthy, what its start reported (exit 3 unless "
                      "each reported is serving)", cmd_status, StatusParams, env_file=True, extra=_any_flag),
    Command("query", "one chat completion at temperature 0: prints the text and the usage", cmd_query, QueryParams,
            env_file=True),
    Command("log", "print the last lines of the server log", cmd_log, LogParams, json=False, env_file=True),
    Command("router", "vllm-router in front of running instances: start, status, stop",
            description="vLLM's router (round_robin, cache_aware, power_of_two, ...) over named instances, tracked "
                        "like a server (state and log in STATE_DIR).",
            children=[
                Command("start", "start the router over --instances a,b", cmd_router_start, RouterStartParams,
                        env_file=True),
                Command("switch", "serve another build behind the router (--instance NEW --model DIR) in place of "
                                  "the one it routes to, with no failed request", cmd_router_switch,
                        RouterSwitchParams, env_file=True),
                Command("status", "is the router up, and its backends (exit 3 if not)", cmd_router_status,
                        env_file=True),
                Command("stop", "stop the router: SIGTERM, SIGKILL after --grace", cmd_router_stop,
                        RouterStopParams, env_file=True),
            ]),
    Command("swap", "create and enable the swapfile from tpu.env when it is not on (root), and report", cmd_swap,
            env_file=True, extra=_report_flag),
]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    add_commands(sub, COMMANDS)
