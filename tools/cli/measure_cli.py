"""`./vllm-t4 sweep | sweep-compare | capacity | capacity-compare | pareto | compare`: the measurements on the
command line.

`decode | decode-sweep | decode-compare` measure single-stream decode and speculative decoding.
`sweep` prints progress on stderr and the evidence folder as its last line; `sweep-compare` prints the article's
comparison tables; `compare record|check|live` prints per-prompt SAME TOKENS lines and exits 0 whether or not
tokens differ (1 only when the comparison could not be made). `--json` prints one JSON object instead.
"""

from __future__ import annotations

import argparse
import sys

from tools.core.commands import Command, add_commands, emit as _emit
from tools.core.params import cli_value
from tools.core.progress import Progress
from tools.measure.capacity.run import CapacityParams, failure_if_error, run_capacity
from tools.measure.capacity.report import compare_capacity
from tools.measure.tokens.compare import (TokenCompareParams, check_against, compare_live, record_reference,
                                          short_prompt)
from tools.measure.decode.params import DecodeParams
from tools.measure.decode.run import markdown_run, run_decode
from tools.measure.decode.sweep import DecodeSweepParams, compare_decode_runs, run_decode_sweep
from tools.measure.pareto import pareto, write_pareto
from tools.measure.sweep.params import DEFAULT_OUT, DEFAULT_PRICE_PER_HOUR, SweepParams
from tools.measure.sweep.run import run_sweep
from tools.measure.sweep.report import CompareSweepsParams, compare_runs, load_run, plot_runs
from tools.serving.config import load_config
from tools.measure.endpoint import EndpointParams, resolve_endpoint, resolve_name


def _cost_cell(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not INPUT_LEN:CONCURRENCY (e.g. 512:8)") from None


def _progress(args: argparse.Namespace) -> Progress:
    def show(done: int, total: int, msg: str) -> None:
        print(f"[{done}/{total}] {msg}", file=sys.stderr, flush=True)
    return show


def _serve_config(args: argparse.Namespace):
    """The configured server (tpu.env or --env-file), for the default URL and its start record."""
    if getattr(args, "base_url", None) and not args.env_file:
        return None

    return load_config(args.env_file)


def cmd_sweep(params: SweepParams, args: argparse.Namespace) -> int:
    res = run_sweep(params, progress=_progress(args), serve_config=_serve_config(args))
    counts = res.counts
    text = _read_text(res.files.get("table_md"))
    text += (f"\n{counts['ok']} ok, {counts['failed']} failed, {counts['infeasible']} infeasible cells "
             f"in {res.wall_s:.0f} s\n{res.run_dir}")
    _emit(args, res, text)
    return 0


def _read_text(path: str | None) -> str:
    from pathlib import Path

    return Path(path).read_text() if path and Path(path).is_file() else ""


def cmd_sweep_compare(_: None, args: argparse.Namespace) -> int:
    # its flags are its own; their values are checked by the operation's model (what MCP's compare_sweeps takes)
    CompareSweepsParams.from_cli_values({"run_dirs": args.runs, "price_per_hour": args.price_per_hour,
                                         **({"output": args.plot} if args.plot is not None else {})},
                                        {"run_dirs": "runs", "output": "--plot"})
    cmp = compare_runs(args.runs, price_per_hour=args.price_per_hour, cost_cell=args.cost_at)
    if args.plot:
        plot_runs([load_run(r) for r in args.runs], args.plot)
    _emit(args, cmp, cmp.markdown + (f"\nplot: {args.plot}" if args.plot else ""))
    return 0


def cmd_compare(_: None, args: argparse.Namespace) -> int:
    reference = {"record": getattr(args, "out", None), "check": getattr(args, "reference", None)}.get(args.action)
    given = {"base_url": getattr(args, "base_url", None), "prompts_file": getattr(args, "prompts", None),
             "max_tokens": getattr(args, "max_tokens", 160), "top_logprobs": args.top_logprobs,
             "long": getattr(args, "long", False), "force": getattr(args, "force", False),
             "instance": getattr(args, "instance", None), "router": getattr(args, "router", False),
             "reference": reference}
    params = TokenCompareParams.from_cli_values({k: v for k, v in given.items() if v is not None},
                                           {"prompts_file": "--prompts",
                                            "reference": "--out" if args.action == "record" else "reference"})
    for name, flag in (("url_a", "A"), ("url_b", "B")):
        if hasattr(args, name):
            TokenCompareParams.from_cli_values({"other_url": getattr(args, name)}, {"other_url": flag})
    if args.action != "live":  # one endpoint: --base-url, --instance or --router, else the started server
        params = params.model_copy(update={"base_url": resolve_endpoint(params, _serve_config(args)).base_url,
                                           "instance": None, "router": False})
    prog = _progress(args)
    if args.action == "record":
        rec = record_reference(args.out, params, progress=prog)

        lines = [f"PROMPT: {short_prompt(g.prompt, g.prompt_tokens)}\n  {len(g.token_ids)} tokens, finish {g.finish_reason}" for g in rec.generations]
        _emit(args, rec, "\n".join(lines + [f"{rec.summary()}", f"{args.out}"]))
    elif args.action == "check":
        res = check_against(args.reference, params, progress=prog)
        _emit(args, res, res.text())
    else:
        # each a URL or the name of a running instance
        res = compare_live(resolve_name(args.url_a).base_url, resolve_name(args.url_b).base_url, params,
                           progress=prog)
        _emit(args, res, res.text())
    return 0


def cmd_decode(params: DecodeParams, args: argparse.Namespace) -> int:
    res = run_decode(params, progress=_progress(args), serve_config=_serve_config(args))
    _emit(args, res.model_dump(mode="json", exclude={"prompts"}), markdown_run(res) + res.run_dir)
    return 0


def cmd_decode_sweep(params: DecodeSweepParams, args: argparse.Namespace) -> int:
    res = run_decode_sweep(params, progress=_progress(args))
    _emit(args, res.model_dump(mode="json"), res.comparison.markdown + res.run_dir)
    return 0


def cmd_decode_compare(_: None, args: argparse.Namespace) -> int:
    cmp = compare_decode_runs(args.runs)
    _emit(args, cmp.model_dump(mode="json"), cmp.markdown)
    return 0


def cmd_capacity(params: CapacityParams, args: argparse.Namespace) -> int:
    res = run_capacity(params, progress=_progress(args), serve_config=_serve_config(args))
    failure_if_error(res)
    _emit(args, res, _read_text(res.files.get("capacity_md")) + res.run_dir)
    return 0


def cmd_capacity_compare(_: None, args: argparse.Namespace) -> int:
    cmp = compare_capacity(args.runs)
    _emit(args, cmp, cmp.markdown)
    return 0


def cmd_pareto(_: None, args: argparse.Namespace) -> int:
    cli_value("--out", args.out)
    for run in args.runs:
        cli_value("runs", run)
    res = write_pareto(pareto(args.runs), args.out)
    _emit(args, res, res.markdown + f"\n{res.run_dir}")
    return 0


def _capacity_runs_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="capacity run folders, reference builds first, the candidate last")


def _pareto_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="sweep or capacity run folders, one curve per build")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder that receives pareto-<time>/ (default "
                                                           "evidence/)")


def _sweep_compare_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run folders, reference builds first, the candidate last")
    p.add_argument("--price-per-hour", type=float, default=DEFAULT_PRICE_PER_HOUR)
    p.add_argument("--cost-at", type=_cost_cell, default=None,
                   help="INPUT_LEN:CONCURRENCY of the cost table (default: where the last run peaks)")
    p.add_argument("--plot", default=None, help="also write a PNG of all runs to this path")


def _record_flags(p: argparse.ArgumentParser) -> None:
    EndpointParams.add_cli_args(p)  # --base-url | --instance | --router, from the one endpoint model
    p.add_argument("--out", required=True, help="reference file to write (JSON)")
    p.add_argument("--prompts", default=None, help="prompts file: JSON list or one per line (default: eight built in)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--top-logprobs", type=int, default=5, help="alternatives kept per position (default 5)")
    p.add_argument("--long", action="store_true", help="add needle-in-a-haystack prompts of ~2k, 8k and 14k tokens "
                                                       "(those within the server's max_model_len)")
    p.add_argument("--force", action="store_true", help="replace an existing reference file")


def _check_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("reference", help="file written by `compare record`")
    EndpointParams.add_cli_args(p)
    p.add_argument("--top-logprobs", type=int, default=5)


def _live_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("url_a", metavar="A", help="reference: a URL or the name of a running instance")
    p.add_argument("url_b", metavar="B", help="candidate: a URL or the name of a running instance")
    p.add_argument("--prompts", default=None)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--top-logprobs", type=int, default=5)


def _runs_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="decode run folders (or a decode-sweep folder's runs/*)")


COMMANDS = [
    Command("sweep", "serving sweep with vLLM's bench serve; prints the evidence folder last",
            description="Random prompts x concurrency x repeats against a live server, greedy, --ignore-eos; "
                        "writes evidence/<run-id>/ (raw, summary.json/.csv/.md, plot.png, provenance.json).",
            params=SweepParams, env_file=True, run=cmd_sweep),
    Command("sweep-compare", "compare sweep runs in the article's form (last run vs each other)",
            description="Output tok/s per cell for every run, the last run against each earlier one (+%% or x), "
                        "and cost per million output tokens.",
            extra=_sweep_compare_flags, run=cmd_sweep_compare),
    Command("capacity", "the most users (or req/s) served within a latency SLO: bracket, goodput, cost",
            description="Doubles the load until a point fails the SLO, then bisects (vLLM's bench serve per point, "
                        "repeats with 95%% intervals, a noisy point measured again); writes "
                        "evidence/capacity-<time>-<label>-<hash>/ (a sweep folder plus capacity.json/.md).",
            params=CapacityParams, env_file=True, run=cmd_capacity),
    Command("capacity-compare", "capacity runs side by side, a verdict where the brackets do not overlap",
            extra=_capacity_runs_flag, run=cmd_capacity_compare),
    Command("pareto", "tok/s per user against tok/s per GPU, one curve per build (PNG + markdown)",
            description="From sweep or capacity run folders; writes evidence/pareto-<time>/ (pareto.png, "
                        "pareto.md, pareto.json).",
            extra=_pareto_flags, run=cmd_pareto),
    Command("compare", "greedy token identity between builds (record, check, live)",
            description="Exact generated token ids, temperature 0, the server's chat template. Exit 0 whether or "
                        "not tokens differ; 1 when the comparison could not be made.",
            op="compare_tokens", children=[
                Command("record", "record the reference build's tokens to a file", env_file=True,
                        extra=_record_flags, run=cmd_compare),
                Command("check", "compare the serving build with a recorded reference", env_file=True,
                        extra=_check_flags, run=cmd_compare),
                Command("live", "compare two live endpoints (A is the reference)", extra=_live_flags,
                        run=cmd_compare),
            ]),
    Command("decode", "single-stream decode benchmark: TTFT, time per token, drafts accepted",
            description="Twenty shipped chat prompts, one at a time, streamed; per prompt TTFT, TPOT, tokens and "
                        "e2e time, and the speculative-decoding acceptance from /metrics deltas; writes an "
                        "evidence folder (raw/, summary.json/md, provenance.json).",
            params=DecodeParams, env_file=True, run=cmd_decode),
    Command("decode-sweep", "the drafter table: restart the server per draft-token setting",
            description="For each --draft-tokens setting (0 = no drafter) start the server with that "
                        "SPECULATIVE_CONFIG, run the decode benchmark for each --sampling, stop it; writes the "
                        "article's table and the greedy answers that differ.",
            params=DecodeSweepParams, run=cmd_decode_sweep),
    Command("decode-compare", "the drafter table from existing decode runs",
            description="Time per token, drafts accepted, speedup against the no-drafter run of the same "
                        "sampling, greedy answers that differ from the no-drafter ones.",
            extra=_runs_flag, run=cmd_decode_compare),
]


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    add_commands(sub, COMMANDS)
