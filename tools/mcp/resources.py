"""MCP resources and prompts, declared once: what a client reads and the workflows it is offered besides tools.

Resources: the serving configuration as read (each value's source marked), the evidence runs (an index, and each
run's summary.md / summary.json through a template confined to the evidence roots), the latest demo report and
the vLLM server's log tail (the index and the log in tools/mcp/index_resources.py, bounded). Prompts: the article's workflows as numbered tool calls with their arguments
(`deploy_t4`, `deploy_cpu`, `compare_builds`), built from `Step` lists that the README's walk-through and the end-to-end test
use too, so the three cannot drift apart. The app (tools/mcp/app.py) registers both; nothing here imports vLLM.
"""

# Longer than the module limit: the resources and the prompts' Step lists are declared side by side, with the one
# renderer the README's walk-through and the end-to-end test read them through.

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import quote
from typing import Annotated, Any

import anyio.to_thread
from fastmcp.exceptions import ResourceError, ValidationError as ArgumentsRefused
from fastmcp.prompts.function_prompt import FunctionPrompt
from pydantic import Field

from repack.errors import RepackError
from repack.family.members import by_name
from tools.core.errors import ToolFailure
from tools.core.paths import PATH_MAX, PathNotAllowed
from tools.core.text import clip
from tools.mcp.bounded import RESULT_BUDGET, fit_text
from tools.mcp.errors import to_tool_error
from tools.mcp.prompt_members import MEMBER_ARG, member_values
from tools.serving.config import ENV_NAMES, parse_env_file

SCHEME = "gemma4-t4"
MAX_RUNS = 500           # evidence runs listed by the index
RUN_DEPTH = 4            # folders below an evidence root searched for runs
SUMMARIES = ("summary.md", "summary.json")
REPORTS = ("capacity.md", "capacity.json")  # a capacity run's own report, beside its cells' summary


class ResourceFailure(ToolFailure):
    """A resource that cannot be read now; the message says why and what to do."""


# ------------------------------------------------------------------------------------------------ resources


@dataclass
class ResourceSpec:
    uri: str                     # a template when it holds {param}
    name: str
    title: str
    description: str
    mime_type: str
    fn: Callable[..., str]       # fn(app, **params) -> text, held to RESULT_BUDGET (the growing ones page)


RESOURCES: dict[str, ResourceSpec] = {}


def resource(uri: str, *, title: str, mime_type: str) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Declare a resource; the function's name is its name, its docstring its description."""

    def register(fn: Callable[..., str]) -> Callable[..., str]:
        RESOURCES[uri] = ResourceSpec(uri=uri, name=fn.__name__, title=title,
                                      description=" ".join((fn.__doc__ or "").split()), mime_type=mime_type, fn=fn)
        return fn

    return register


@resource(f"{SCHEME}://config", title="Serving configuration", mime_type="application/json")
def serving_config(app) -> str:
    """The serving configuration start_vllm_server uses: every tpu.env variable with its value and where it came
    from (file, environment, override, default); `overridden` lists the variables the environment or this MCP
    server changes from the file."""
    cfg = app.config()
    in_file = parse_env_file(cfg.env_file) if cfg.env_file else {}
    rows = []
    for key, name in ENV_NAMES.items():
        value = getattr(cfg, key)
        row: dict[str, Any] = {"name": name, "value": str(value) if isinstance(value, Path) else value,
                               "source": cfg.sources.get(key, "default")}
        if row["source"] != "file" and name in in_file:
            row["file_value"] = in_file[name]  # what tpu.env says, shadowed by the environment or the server
        given = {"file": in_file.get(name), "environment": os.environ.get(name)}.get(row["source"])
        if key == "served_name" and not given and row["source"] != "override":
            # empty: each start serves its model under the model's own folder name (or hub id), not this value
            row.update(value="", default_value=value, default=f"empty: a start serves its model under the model's "
                                                              f"folder name or hub id ({value} for MODEL_NAME)")
        rows.append(row)
    overridden = [r["name"] for r in rows if r["source"] in ("environment", "override")]
    return json.dumps({"env_file": str(cfg.env_file), "base_url": cfg.base_url, "variables": rows,
                       "overridden": overridden}, indent=1, default=str)


def evidence_run_list(app) -> list[dict[str, Any]]:
    """Folders under the evidence roots holding a summary.md or summary.json, newest first."""
    seen: dict[str, dict[str, Any]] = {}
    for root in app.roots.evidence:
        if not root.is_dir():
            continue
        for here, dirs, files in os.walk(root):  # symlinks are not followed: a run is a real folder inside
            depth = len(Path(here).relative_to(root).parts)
            if depth >= RUN_DEPTH:
                dirs[:] = []
            dirs.sort()
            found = [f for f in SUMMARIES if f in files and _readable(app, Path(here) / f)]
            found += [f for f in REPORTS if found and f in files and _readable(app, Path(here) / f)]
            if found and depth > 0:
                run = Path(here).relative_to(root).as_posix()
                if run not in seen:  # the first root holding a name is the one the template reads
                    seen[run] = {"run": run, "root": str(root), "mtime": os.stat(here).st_mtime,
                                 "uris": [f"{SCHEME}://evidence/{quote(run, safe='/')}/{f}" for f in found]}
            if len(seen) >= MAX_RUNS:
                break
    return sorted(seen.values(), key=lambda r: -r["mtime"])


def _readable(app, path: Path) -> bool:
    """A summary the template would serve: a file resolving inside the evidence roots (not a link out of them)."""
    try:
        return app.roots.confine(path, "evidence").is_file()
    except PathNotAllowed:
        return False


def _summary(app, run: str, name: str) -> str:
    run = run.strip().strip("/")
    if not run:
        raise ResourceFailure(f"no run named; list them with {SCHEME}://evidence/runs")
    last: PathNotAllowed | None = None
    for root in app.roots.evidence:
        try:
            path = app.roots.confine(root / run / name, "evidence", what=f"run {clip(run)}")
        except PathNotAllowed as exc:  # a symlink out of the roots, say: refused, never read
            last = exc
            continue
        if path.is_file():  # its head within RESULT_BUDGET, naming the file that holds the whole
            return fit_text(path.read_text(errors="replace"), whole=f"the whole is the file {path}", keep="head")
    if last is not None:
        raise ResourceFailure(str(last))
    raise ResourceFailure(f"no {name} for run {clip(run)} under the evidence roots "
                          f"({', '.join(map(str, app.roots.evidence))}); list the runs with {SCHEME}://evidence/runs")


@resource(f"{SCHEME}://evidence/{{run*}}/summary.md", title="Evidence run summary (markdown)",
          mime_type="text/markdown")
def run_summary_md(app, run: str) -> str:
    """A run's summary.md (run: its folder relative to the evidence root, as evidence/runs lists it)."""
    return _summary(app, run, "summary.md")


@resource(f"{SCHEME}://evidence/{{run*}}/summary.json", title="Evidence run summary (JSON)",
          mime_type="application/json")
def run_summary_json(app, run: str) -> str:
    """A run's summary.json (run: its folder relative to the evidence root, as evidence/runs lists it)."""
    return _summary(app, run, "summary.json")


@resource(f"{SCHEME}://evidence/{{run*}}/capacity.md", title="Capacity run report (markdown)",
          mime_type="text/markdown")
def run_capacity_md(app, run: str) -> str:
    """A capacity run's capacity.md: the search's points with each term's median and interval."""
    return _summary(app, run, "capacity.md")


@resource(f"{SCHEME}://evidence/{{run*}}/capacity.json", title="Capacity run report (JSON)",
          mime_type="application/json")
def run_capacity_json(app, run: str) -> str:
    """A capacity run's capacity.json (run: its folder relative to the evidence root, as evidence/runs lists it)."""
    return _summary(app, run, "capacity.json")


@resource(f"{SCHEME}://demo/latest", title="Latest demo report", mime_type="text/markdown")
def demo_report(app) -> str:
    """The newest `./vllm-t4 demo` report (report.md of the newest folder directly under an evidence root whose
    report.json is a demo report), preceded by a comment naming its folder."""
    found = []
    for root in app.roots.evidence:
        for folder in (root.iterdir() if root.is_dir() else ()):
            rj, rm = folder / "report.json", folder / "report.md"
            if folder.is_symlink() or not (rj.is_file() and rm.is_file()):
                continue
            try:  # the files read, not only their folder: a report linked out of the roots is none of ours
                rj, rm = (app.roots.confine(f, "evidence", what="demo report") for f in (rj, rm))
            except PathNotAllowed:
                continue
            try:
                data = json.loads(rj.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and "probe_verdict" in data and "served" in data:
                found.append((_written_at(data, rm), rj.stat().st_mtime, str(folder), rm))
    if not found:
        raise ResourceFailure("no demo report under the evidence roots "
                              f"({', '.join(map(str, app.roots.evidence))}): follow the deploy_cpu prompt (prompts/get "
                              "deploy_cpu) for the same walk through these tools (from a shell: ./vllm-t4 demo "
                              "writes this report)")
    *_, folder, report = max(found)
    return f"<!-- {folder} -->\n" + fit_text(report.read_text(errors="replace"), keep="head",
                                              budget=RESULT_BUDGET - len(folder) - 10,
                                              whole=f"the whole is the file {report}")


_MD_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}) UTC", re.M)


def _written_at(data: dict, md: Path) -> float:
    """When a demo report was written, by its own timestamp (report.json's finished_at, else the UTC time on
    report.md's date line): file times are reset by a checkout or a copy. Undated reports sort before dated ones
    (-inf), among themselves by file time."""
    try:
        if isinstance(data.get("finished_at"), str):
            return datetime.fromisoformat(data["finished_at"]).timestamp()
        if m := _MD_DATE.search(md.read_text(errors="replace")[:2000]):
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M").replace(tzinfo=timezone.utc).timestamp()
    except (OSError, ValueError):
        pass
    return float("-inf")


# ------------------------------------------------------------------------------------------------ prompts


@dataclass(frozen=True)
class Ref:
    """A value taken from an earlier step's result: `field` of step number `step` (1-based)."""

    step: int
    field: str

    def __str__(self) -> str:
        return f"<{self.field} from step {self.step}>"


@dataclass(frozen=True)
class Step:
    tool: str
    args: dict[str, Any]
    why: str                       # what the step does and what to look at in its result
    when: str = ""                 # empty: always; else the condition, for people
    condition: str = ""            # the same condition by key, for programs (see CONDITIONS)
    # where the member is optional (deploy_cpu): None in both walks, True only when a member is named, False only
    # without one (the tiny stand-in)
    member: bool | None = None


# The conditions steps may carry, by key: the walk-through test decides each on the machine at hand.
CONDITIONS = {
    "source_missing": "the source folder does not exist yet",
    "turing": "preflight's turing_clamp check fails (a T4 whose vLLM lacks the clamp)",
    "build_b_missing": "build_b does not exist yet",
    "a_not_served": "server_status shows no server, or one serving another model than build_a",
}


_LABEL = re.compile(r"[A-Za-z0-9._+-]+")  # a label as the tools it is passed to take it


@dataclass
class PromptSpec:
    name: str
    title: str
    description: str
    arguments: dict[str, tuple[str, str]]  # name -> (default, description)
    intro: str
    steps: list[Step]
    toolsets: tuple[str, ...]
    outro: str = ""
    # where the member is optional (deploy_cpu: the tiny stand-in without one), the values that follow whether one
    # is named, as (without a member, with one): an argument's default, or text of the prompt's own
    by_member: dict[str, tuple[str, str]] = field(default_factory=dict)
    # the tool after which the walk ends for a member the planner fits in no T4 build (deploy_t4: plan_fit), the
    # outro then saying so with the planner's figures
    stop_unless_fits: str = ""

    def bind(self, values: dict[str, str] | None = None) -> list[Step]:
        """The steps of the walk the values ask for (with or without a member), the arguments filled in ({name}
        in string values)."""
        vals = self.values(values)
        named = bool(vals.get("member"))
        steps = [s for s in self.steps if s.member in (None, named)]
        if self.stopped(vals):
            steps = steps[:[s.tool for s in steps].index(self.stop_unless_fits) + 1]

        def fill(v: Any) -> Any:
            if isinstance(v, str):
                whole = re.fullmatch(r"\{(\w+)\}", v)
                return vals[whole.group(1)] if whole else v.format(**vals)
            if isinstance(v, list):
                return [fill(x) for x in v]
            return v

        return [Step(s.tool, {k: fill(v) for k, v in s.args.items()}, s.why.format(**vals), s.when.format(**vals),
                     s.condition, s.member) for s in steps]

    def stopped(self, vals: dict[str, Any]) -> bool:
        """Whether the walk ends early: the member fits no T4 build and this prompt serves on a T4."""
        return bool(self.stop_unless_fits) and vals.get("fits_t4") is False

    def check(self, given: dict[str, Any] | None) -> None:
        """Refuse an argument this prompt does not take (FastMCP drops it silently) or a value longer than any path,
        label or hub id it stands for."""
        for k, v in (given or {}).items():
            if k not in self.arguments:
                raise ValueError(f"prompt {self.name}: unknown argument {clip(k)}; it takes "
                                 f"{', '.join(self.arguments)}")
            if len(str(v)) >= PATH_MAX:
                raise ValueError(f"prompt {self.name}: argument {k} is {len(str(v))} characters; give at most "
                                 f"{PATH_MAX - 1} (a path, a label or a hub id)")
            if any(ord(c) < 32 or ord(c) == 127 for c in str(v)):  # a newline would add steps of its own
                raise ValueError(f"prompt {self.name}: argument {k} holds a control character (a newline?); give "
                                 f"one line")
            if k == "member" and v:  # empty: the prompt's default (deploy_cpu: the tiny stand-in)
                try:
                    by_name(str(v))
                except RepackError as exc:
                    raise ValueError(f"prompt {self.name}: {exc}") from None
            if k.startswith("label") and not _LABEL.fullmatch(str(v)):
                raise ValueError(f"prompt {self.name}: argument {k} {clip(str(v))!r} must be a label of letters, "
                                 f"digits, '.', '_', '+' or '-' (no spaces)")

    def values(self, given: dict[str, str] | None = None) -> dict[str, Any]:
        # FastMCP passes every argument, its default too: a value equal to the declared default is not a choice,
        # so that by_member's default (deploy_cpu with a member) holds
        given = {k: v for k, v in (given or {}).items() if v and v != self.arguments.get(k, (None,))[0]}
        named = bool(given.get("member") or self.arguments.get("member", ("",))[0])
        vals: dict[str, Any] = ({k: d for k, (d, _) in self.arguments.items()}
                                | {k: pair[named] for k, pair in self.by_member.items()} | given)
        if vals.get("member"):  # defaults that name the member follow it; the T4 flags come from the planner
            m = by_name(vals["member"])
            vals = {k: v.replace("{member}", m.name) if isinstance(v, str) else v for k, v in vals.items()}
            vals["member"] = m.name
            vals.update(member_values(m))
            for k, build in (("label_a", "int4-emb"), ("label_b", "bf16-emb")):
                # another member's records and sweeps sit beside E2B's under the evidence root: named apart
                if k in self.arguments and k not in given and m.name != "E2B":
                    vals[k] = f"{m.name}-{build}"
        for k in self.by_member.keys() - self.arguments.keys():  # the prompt's own text may name the values
            vals[k] = vals[k].format(**vals)
        return vals

    def steps_text(self, values: dict[str, str] | None = None) -> str:
        """The numbered tool calls, one a line, in markdown."""
        lines = []
        for i, s in enumerate(self.bind(values), 1):
            args = ", ".join(f"{k}={_shown(v)}" for k, v in s.args.items())
            lines.append(f"{i}. `{s.tool}({args})`" + (f" — only when {s.when}" if s.when else "") + f": {s.why}")
        return "\n".join(lines)

    def render(self, values: dict[str, str] | None = None) -> str:
        """The prompt's text: what to do, the numbered calls, and where to look afterwards."""
        vals = self.values(values)
        outro = vals["stop_note"] if self.stopped(vals) else self.outro.format(**vals)
        return "\n\n".join(x for x in (self.intro.format(**vals), self.steps_text(values), outro) if x)


def _shown(v: Any) -> str:
    if isinstance(v, Ref):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_shown(x) for x in v) + "]"
    return json.dumps(v)


PROMPTS: dict[str, PromptSpec] = {}


def prompt(spec: PromptSpec) -> PromptSpec:
    PROMPTS[spec.name] = spec
    return spec


_BUILD = "gemma-4-{member}-it-qat-q4_0-w4a16-ct-text"
prompt(PromptSpec(
    name="deploy_t4", title="Deploy a Gemma 4 member on a T4",
    description="From a bare machine to a served all-4-bit build: preflight, plan, fetch, probe, repack, clamp, "
                "start, check; each call either succeeds or its result or error says what to do.",
    arguments={"member": MEMBER_ARG,
               "source": ("gemma-4-{member}-it-qat-q4_0-unquantized", "The QAT source folder (relative: under the "
                                                                      "first models root)"),
               "output": (_BUILD + "-emb4", "The all-4-bit build to write and serve (under a models root)"),
               "repo_id": ("google/gemma-4-{member}-it-qat-q4_0-unquantized",
                           "The hub repo the source is fetched from when it is missing")},
    toolsets=("deploy", "hub", "repack", "gpu", "serve"), stop_unless_fits="plan_fit",
    intro="Deploy {output} from {source} with the gemma4-t4 MCP tools (the default toolsets and gpu and hub: "
          "start the server with --toolsets default,gpu,hub). On a machine without an NVIDIA GPU follow deploy_cpu "
          "instead. Call the tools in this order; after each, read `summary`. When a call fails, its error is one "
          "line naming the argument or the fix: do that, then repeat the call. Long calls stream progress; if your "
          "client times out, add toolset jobs and run them through start_job and job_status. Before anything is "
          "fetched, {fit}.",
    steps=[
        Step("preflight", {"step": "all"}, "every check ok, warn, fail or n/a with a one-line fix; do each failing "
                                           "check's fix before going on"),
        Step("plan_fit", {"member": "{member}"}, "each build's size, load and KV cache tokens on a T4, and "
                                                 "{plan_flags}"),
        Step("fetch_checkpoint", {"repo_id": "{repo_id}", "out": "{source}"},
             "downloads the build files into the models root (the licence must be accepted on the hub and HF_TOKEN "
             "set; the error says so)", when="the source folder does not exist", condition="source_missing"),
        Step("probe_checkpoint", {"path": "{source}"}, "the verdict must be qat (every text tensor on the 4-bit "
                                                       "grid)"),
        Step("preflight", {"step": "repack", "source": "{source}", "out": "{output}"},
             "the source's config.json and the free disk the repack needs"),
        Step("repack_checkpoint", {"source": "{source}", "output": "{output}"},
             "writes the all-4-bit build; force=true replaces a build this tool wrote"),
        Step("patch_turing", {"action": "apply"}, "the one-time attention clamp vLLM needs on a T4 (sm_75)",
             when="preflight's turing_clamp check fails", condition="turing"),
        Step("start_vllm_server", {"model": "{output}", "gpu_memory_utilization": "{gpu_memory_utilization}",
                                   "max_model_len": "{max_model_len}", "max_num_seqs": "{max_num_seqs}"},
             "serves the build with the planner's T4 flags; the result has the KV cache size and the start time"),
        Step("query_model", {"prompt": "Write one sentence about the Tesla T4."},
             "one greedy answer, which shows the build serves: {member} answers in words (the tiny stand-in answers "
             "tokens of its training pattern, not sentences: compare_tokens checks those)"),
    ]))

_TINY = "tiny-gemma4-qat"

prompt(PromptSpec(
    name="deploy_cpu", title="The whole walk on CPU, from the tiny stand-in or a member",
    description="On a machine without an NVIDIA GPU: make the tiny stand-in source (or fetch a member's), probe it, "
                "repack both builds, serve the all-4-bit one on vLLM's CPU backend, then compare_builds; default "
                "toolsets only (and hub for a member).",
    arguments={"member": ("", "A Gemma 4 member fetched from the hub: E2B, E4B, 12B, 26B-A4B or 31B (empty: "
                              "the tiny stand-in made here, nothing downloaded)"),
               "source": (_TINY, "The source folder (relative: under the first models root); with a member "
                                 "gemma-4-<member>-it-qat-q4_0-unquantized"),
               "output": ("tiny-emb4", "The all-4-bit build (int4 embeddings); with a member "
                                       "gemma-4-<member>-it-qat-q4_0-w4a16-ct-text-emb4"),
               "output_bf16": ("tiny-bf16-emb", "The bf16-embedding build; with a member "
                                                "gemma-4-<member>-it-qat-q4_0-w4a16-ct-text"),
               "repo_id": ("google/gemma-4-{member}-it-qat-q4_0-unquantized",
                           "With a member: the hub repo its source is fetched from when it is missing")},
    by_member={"source": (_TINY, "gemma-4-{member}-it-qat-q4_0-unquantized"),
               "output": ("tiny-emb4", _BUILD + "-emb4"), "output_bf16": ("tiny-bf16-emb", _BUILD),
               "repo_id": ("", "google/gemma-4-{member}-it-qat-q4_0-unquantized"),
               "what": ("the tiny stand-in", "{member}"),
               "origin": ("The source is a tiny Gemma-4-shaped QAT checkpoint made here, so nothing is downloaded.",
                          "The source is {member}'s QAT checkpoint from the hub ({repo_id}): fetching it needs the "
                          "hub toolset (start the server with --toolsets default,hub, or call "
                          "enable_toolset(toolset=\"hub\")). {cpu_fit}."),
               "answer": ("the tiny stand-in answers tokens of its training pattern, not sentences",
                          "{member} answers in words")},
    toolsets=("deploy", "repack", "serve", "measure", "hub"),
    intro="Walk from nothing to two served, checked and measured builds of {what} on this CPU with the gemma4-t4 "
          "MCP tools (the default toolsets). {origin} Call the tools in this order and read each `summary`; a "
          "failed call's error names the tool and arguments that fix it: call that, then repeat the call.",
    steps=[
        Step("preflight", {"step": "all"}, "platform cpu; do each failing check's fix before going on"),
        Step("make_tiny_model", {"out": "{source}"}, "the stand-in source (trained once, then cached)",
             when="the source folder does not exist", condition="source_missing", member=False),
        Step("fetch_checkpoint", {"repo_id": "{repo_id}", "out": "{source}"},
             "downloads {member}'s QAT checkpoint into the models root (the licence must be accepted on the hub "
             "and HF_TOKEN set; the error says so)", when="the source folder does not exist",
             condition="source_missing", member=True),
        Step("probe_checkpoint", {"path": "{source}"}, "the verdict must be qat"),
        Step("preflight", {"step": "repack", "source": "{source}", "out": "{output}"},
             "the source's config.json and the free disk the repack needs"),
        Step("repack_checkpoint", {"source": "{source}", "output": "{output_bf16}", "embed_int4": False},
             "the bf16-embedding build"),
        Step("repack_checkpoint", {"source": "{source}", "output": "{output}"}, "the all-4-bit build"),
        Step("start_vllm_server", {"model": "{output}"}, "serves the all-4-bit build on CPU"),
        Step("query_model", {"prompt": "Write one sentence about the Tesla T4."}, "one greedy answer: {answer}"),
    ],
    outro="Then follow compare_builds with build_a={output}, build_b={output_bf16} and source={source}: the "
          "memory each build takes (vram_status: on CPU the server's RSS and PSS beside the weights on disk), "
          "whether both give the same greedy tokens, and their throughput with a verdict per cell."))

prompt(PromptSpec(
    name="compare_builds", title="Compare two builds (tokens and throughput)",
    description="The article's comparison of two builds on one machine (a GPU or a CPU): record A's greedy "
                "tokens, serve B in A's place, check B against them, sweep both, compare the sweeps. A is the build deploy_t4 left "
                "serving, so it is not started again.",
    arguments={"member": MEMBER_ARG,
               "build_a": (_BUILD + "-emb4", "The build whose tokens are recorded (the all-4-bit build deploy_t4 "
                                             "serves)"),
               "build_b": (_BUILD, "The build checked against A (the bf16-embedding build by default; repacked "
                                   "from source when missing)"),
               "label_a": ("int4-emb", "Label of build A in the sweep tables and its token record's name (no "
                                       "spaces; another member than E2B: <member>-int4-emb)"),
               "label_b": ("bf16-emb", "Label of build B (no spaces; another member than E2B: <member>-bf16-emb)"),
               "source": ("gemma-4-{member}-it-qat-q4_0-unquantized", "The QAT source, to build build_b when it is "
                                                                     "missing")},
    toolsets=("repack", "serve", "measure", "deploy"),
    intro="Compare {build_a} (A) with {build_b} (B) with the gemma4-t4 MCP tools.{t4_warning} The builds are "
          "served one at a time on this machine (a GPU or a CPU), so A's greedy tokens are recorded to a file and B "
          "is checked against it. Call the tools in this "
          "order and read each `summary`; a failed call's error names the fix.",
    steps=[
        Step("repack_checkpoint", {"source": "{source}", "output": "{build_b}", "embed_int4": False},
             "the bf16-embedding build", when="{build_b} does not exist", condition="build_b_missing"),
        Step("start_vllm_server", {"model": "{build_a}", "replace": True},
             "serves A in place of what serves (a plain start when nothing does)",
             when="server_status shows the server is not serving {build_a}", condition="a_not_served"),
        Step("vram_status", {}, "A's memory: on a GPU the card's, on CPU `host` (RSS and PSS beside the weights)"),
        Step("compare_tokens", {"mode": "record", "reference": "tokens/{label_a}.json"},
             "A's greedy tokens for the eight article prompts, written under the evidence root"),
        Step("run_sweep", {"label": "{label_a}", "out": "sweeps"},
             "A's throughput over the article's grid (input_lens, concurrencies: narrow them for a quick look)"),
        Step("start_vllm_server", {"model": "{build_b}", "replace": True},
             "serves B in place of A on the port clients use, through the front door (FRONT_DOOR=1 as shipped): "
             "B starts beside A where the machine holds both (a CPU: cores of its own; a GPU: its share of the "
             "card), else A stops and requests wait at the door while B loads (a T4 at 0.9, said first); no request "
             "fails; if B fails or refuses requests, A keeps or takes back the traffic and the error names B's fix "
             "and its kept log (server_logs). With FRONT_DOOR=0 the port is dead while B loads"),
        Step("vram_status", {}, "B's memory, to set beside A's"),
        Step("compare_tokens", {"mode": "check", "reference": "tokens/{label_a}.json"},
             "B against A's record: identical prompts, else the first divergence and whether it is a near-tie"),
        Step("run_sweep", {"label": "{label_b}", "out": "sweeps"}, "B's throughput over the same grid and prompts"),
        Step("compare_sweeps", {"run_dirs": [Ref(9, "run_dir"), Ref(5, "run_dir")],
                                "output": "sweeps/{label_a}-vs-{label_b}.md"},
             "per cell A's output tok/s against B's (B's run first: the baseline) with its 95% interval and a "
             "verdict (faster, slower, within noise), and cost per million tokens"),
        Step("stop_vllm_server", {}, "done: frees the GPU or the CPU cores and memory the server held"),
    ],
    outro=f"The runs' summaries are readable as resources ({SCHEME}://evidence/runs lists them)."))


def walkthrough() -> list[tuple[str, int, Step]]:
    """The fresh-VM walk-through: deploy_t4 then compare_builds with their defaults, as (prompt, step no., step).
    (deploy_cpu is the same walk on a machine without a GPU.)"""
    out = []
    for name in ("deploy_t4", "compare_builds"):
        out += [(name, i, s) for i, s in enumerate(PROMPTS[name].bind(), 1)]
    return out


def prompt_function(spec: PromptSpec) -> Callable[..., str]:
    """The FastMCP prompt function of `spec`: its arguments (strings with defaults) and the rendered text."""

    def fn(**kwargs: str) -> str:
        return spec.render({k: v for k, v in kwargs.items() if v})

    params = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=d,
                                annotation=Annotated[str, Field(description=desc)])
              for k, (d, desc) in spec.arguments.items()]
    fn.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    fn.__annotations__ = {p.name: p.annotation for p in params} | {"return": str}
    fn.__name__ = spec.name
    fn.__doc__ = spec.description
    return fn


def resource_function(spec: ResourceSpec, app: Any) -> Callable[..., str]:
    """The FastMCP resource function of `spec` over `app`: run in a worker thread, failures as one line."""
    names = [p for p in inspect.signature(spec.fn).parameters if p != "app"]

    async def fn(**kwargs: str) -> str:
        try:
            text = await anyio.to_thread.run_sync(lambda: spec.fn(app, **kwargs))
            return fit_text(text, whole=f"the whole at {spec.uri}'s source")
        except (ResourceFailure, PathNotAllowed) as exc:
            # Nothing readable at this URI (no such run, a link out of the roots): invalid params, -32602, as the
            # spec answers a resource not found (SEP-2164), not an internal error; worded as the tools' errors are.
            raise ArgumentsRefused(str(to_tool_error(exc)), log_level=logging.DEBUG) from None
        except Exception as exc:
            raise ResourceError(str(to_tool_error(exc)), log_level=logging.DEBUG) from None

    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=str) for n in names]
    fn.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    fn.__annotations__ = {n: str for n in names} | {"return": str}
    fn.__name__ = spec.name
    fn.__doc__ = spec.description
    return fn


def register(mcp: Any, app: Any) -> None:
    """Adds every declared resource, resource template and prompt to the FastMCP server `mcp`."""
    for spec in RESOURCES.values():
        mcp.resource(spec.uri, name=spec.name, title=spec.title, description=spec.description,
                     mime_type=spec.mime_type)(resource_function(spec, app))
    for p in PROMPTS.values():  # arguments are strings: no generated "matching the following JSON schema" note
        made = FunctionPrompt.from_function(prompt_function(p), name=p.name, title=p.title, description=p.description)
        for arg in made.arguments or []:
            arg.description = p.arguments[arg.name][1]
        mcp.add_prompt(made)
