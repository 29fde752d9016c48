"""Accuracy with lm-evaluation-harness: the tiny model's pattern tasks against real vLLM CPU servers, the paired
comparison, and bad input (one line, exit 2, no run folder)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tools.core.errors import ToolFailure
from tools.measure.evals import run as evals, tasks as eval_tasks
from tools.core.root import PROJECT_ROOT
from tools.measure.evals.compare import compare_evals
from tools.measure.evals.results import (TASKS_DIR, EvalCompareParams, EvalParams, TaskScore, confine_compare_params,
                                        confine_eval_params)

from tests.helpers.fixtures import stand_in_eval_run
from tests.helpers.stand_ins.measure import lm_eval_stand_in, serve_in_thread

TASKS = ["tiny_pattern_mc", "tiny_pattern_gen"]


def _cli(argv: list[str]) -> int:
    from tools.cli import main

    return main(argv)


def _no_run_folder(out: Path) -> None:
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert left == [], f"a failed eval left {left} in {out}"


def _one_line_error(capsys, name: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"vllm-t4 {name}: "), err
    return err[-1]


# --------------------------------------------------------------------------------------------------------------
# Without a server


def test_shipped_task_data_follows_the_tiny_models_pattern():
    """The JSONL files the tiny_pattern tasks read are what the tiny model's permutation gives (regenerate with
    `python -m tools.measure.evals.tasks --write-tiny-tasks` when the pattern changes)."""
    mc, gen = eval_tasks.tiny_pattern_docs(0)
    folder = TASKS_DIR / "tiny_pattern"
    shipped_mc = [json.loads(x) for x in (folder / "tiny_pattern_mc.jsonl").read_text().splitlines()]
    shipped_gen = [json.loads(x) for x in (folder / "tiny_pattern_gen.jsonl").read_text().splitlines()]
    assert shipped_mc == mc and shipped_gen == gen
    assert len(mc) >= 10
    for d in mc:  # four distinct choices, the pattern's successor among them exactly once
        assert len(set(d["choices"])) == 4
        assert d["choices"][d["label"]] == next(g["target"] for g in gen if g["context"] == d["context"])


def test_lm_eval_indexes_only_the_include_path_when_every_task_is_there(monkeypatch):
    """The eval's child runs lm-eval's own command line; when every task asked for is in the include path, the
    task manager lm-eval's command line makes (EvaluatorConfig.process_tasks) holds that folder alone, not
    lm-eval's ~14,700 built-in tasks (about 20 s of CPU per run). A run naming any other task keeps them."""
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.tasks import TaskManager

    from tools.measure.evals import lm_eval_main

    inc = str(TASKS_DIR)
    assert lm_eval_main.included_only(["run", "--tasks", "tiny_pattern_mc", "--include_path", inc])
    assert lm_eval_main.included_only(["run", "--tasks=tiny_pattern_mc,tiny_pattern_gen", f"--include_path={inc}"])
    assert not lm_eval_main.included_only(["run", "--tasks", "tiny_pattern_mc,hellaswag", "--include_path", inc])
    assert not lm_eval_main.included_only(["run", "--tasks", "tiny_pattern_mc"])
    monkeypatch.setattr(TaskManager, "__init__", TaskManager.__init__)  # put back after the test
    lm_eval_main.without_builtin_tasks()
    manager = EvaluatorConfig(tasks="tiny_pattern_mc", include_path=inc).process_tasks()
    assert sorted(manager.all_tasks) == ["tiny_pattern_gen", "tiny_pattern_mc"]



def test_eval_flags_come_from_the_params_model():
    from tools.cli import build_parser

    args = build_parser().parse_args(["eval", "--tasks", "a,b", "--tasks", "c", "--include-path", "/x", "--limit",
                                      "5", "--num-fewshot", "0", "--label", "emb4", "--out", "/o", "--base-url",
                                      "http://h:1", "--json"])
    p = EvalParams.from_cli_args(args)
    assert p.tasks == ["a", "b", "c"] and p.include_path == "/x" and p.limit == 5 and p.num_fewshot == 0
    assert p.label == "emb4" and p.out == "/o" and p.base_url == "http://h:1" and args.json
    p = EvalParams.from_cli_args(build_parser().parse_args(["eval", "--tasks", "a"]))
    assert p == EvalParams(tasks=["a"])  # unset flags keep the model's defaults
    # Every field of the model is a flag, with its description as help.
    helps = build_parser()._subparsers._group_actions[0].choices["eval"].format_help()
    for name in EvalParams.model_fields:
        assert "--" + name.replace("_", "-") in helps
    args = build_parser().parse_args(["eval-compare", "r1", "r2"])
    assert EvalCompareParams.from_cli_args(args).runs == ["r1", "r2"]


@pytest.mark.parametrize("argv, needle", [
    (["--limit", "0"], "--limit"),
    (["--label", "a/b"], "--label"),
])
def test_eval_refuses_bad_flags_with_one_line(tmp_path, capsys, argv, needle):
    rc = _cli(["eval", "--tasks", "x", "--out", str(tmp_path / "ev"), *argv])
    assert rc == 2
    assert needle in _one_line_error(capsys, "eval")
    _no_run_folder(tmp_path / "ev")


def test_eval_refuses_a_missing_include_path(tmp_path, capsys):
    rc = _cli(["eval", "--tasks", "x", "--include-path", str(tmp_path / "nope"), "--out", str(tmp_path / "ev")])
    assert rc == 2
    line = _one_line_error(capsys, "eval")
    assert "nope" in line and "not a folder" in line
    _no_run_folder(tmp_path / "ev")


def test_eval_refuses_when_no_server_answers(tmp_path, capsys):
    from tests.helpers.fixtures import free_port

    url = f"http://127.0.0.1:{free_port()}"
    rc = _cli(["eval", "--tasks", "tiny_pattern_mc", "--base-url", url, "--out", str(tmp_path / "ev"), "--json"])
    assert rc == 2
    out = json.loads(capsys.readouterr().out)
    assert url in out["error"] and "./vllm-t4 start" in out["error"]
    _no_run_folder(tmp_path / "ev")


def test_paired_difference_matches_the_hand_computation(tmp_path):
    a = {i: float(i % 2) for i in range(40)}                 # 0,1,0,1,...  acc 0.5
    b = {i: 1.0 if i % 4 != 0 else 0.0 for i in range(40)}  # acc 0.75
    ra, rb = stand_in_eval_run(tmp_path / "a", "ref", a), stand_in_eval_run(tmp_path / "b", "cand", b)
    cmp = compare_evals(EvalCompareParams(runs=[str(ra), str(rb)]))
    (row,) = cmp.rows
    d = [b[i] - a[i] for i in range(40)]
    mean = sum(d) / 40
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / 39 / 40)
    assert row.paired and row.n_paired == 40
    assert row.diff == pytest.approx(0.25) and row.diff_stderr == pytest.approx(se)
    assert row.within_noise is (abs(mean) < 2 * se)
    assert row.values == [0.5, 0.75] and "| t | acc |" in cmp.markdown

    # The same documents scored the same way: within noise with a zero stderr.
    rc = stand_in_eval_run(tmp_path / "c", "same", a)
    (row,) = compare_evals(EvalCompareParams(runs=[str(ra), str(rc)])).rows
    assert row.diff == 0 and row.diff_stderr == 0 and row.within_noise is True

    # Documents whose content differs (doc_hash) are not paired.
    rd = stand_in_eval_run(tmp_path / "d", "other", a, hashes={0: "x", 1: "y"})
    (row,) = compare_evals(EvalCompareParams(runs=[str(ra), str(rd)])).rows
    assert row.n_paired == 38 and "doc_hash" in row.note


def test_eval_compare_refuses_a_folder_that_is_not_a_run(tmp_path, capsys):
    rc = _cli(["eval-compare", str(tmp_path), str(tmp_path)])
    assert rc == 2
    assert "summary.json" in _one_line_error(capsys, "eval-compare")


@pytest.mark.parametrize("entry", ["dotdot", "absolute"])
def test_eval_compare_refuses_a_samples_entry_outside_the_run(tmp_path, capsys, entry):
    ref = stand_in_eval_run(tmp_path / "ev" / "ref", "ref", {0: 1.0, 1: 0.0, 2: 1.0})
    outside = stand_in_eval_run(tmp_path / "outside", "secret", {0: 1.0, 1: 1.0, 2: 1.0})
    secret = outside / "lm_eval" / "m" / "samples_t_2026-01-01T00-00-00.jsonl"
    bad = stand_in_eval_run(tmp_path / "ev" / "bad", "bad", {0: 1.0, 1: 1.0, 2: 1.0})
    summary = json.loads((bad / "summary.json").read_text())
    summary["files"]["samples:t"] = (f"{bad}/../../outside/{secret.relative_to(outside)}" if entry == "dotdot"
                                     else str(secret))
    (bad / "summary.json").write_text(json.dumps(summary))

    rc = _cli(["eval-compare", str(ref), str(bad)])
    assert rc == 2
    line = _one_line_error(capsys, "eval-compare")
    assert f"run {bad}" in line and "samples:t" in line and "not a file inside the run folder" in line
    assert "`./vllm-t4 eval` wrote" in line  # the operation as the command line renders it


# --------------------------------------------------------------------------------------------------------------
# Against the tiny model on vLLM's CPU backend


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """Datasets and hub lookups offline: the tasks must load from the repository's JSONL files alone."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_DATASETS_OFFLINE", "1")
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    yield
    mp.undo()


def _above_chance(score: TaskScore, chance: float) -> None:
    assert score.n == 17 and score.stderr is not None
    # Measurably above chance: more than three standard errors, and a binomial tail below 1e-6.
    k = round(score.value * score.n)
    tail = sum(math.comb(score.n, i) * chance ** i * (1 - chance) ** (score.n - i) for i in range(k, score.n + 1))
    assert score.value > chance + 3 * max(score.stderr, 1e-9) and tail < 1e-6, (score, tail)


@pytest.fixture(scope="module")
def emb4_run(emb4_server, offline, tmp_path_factory):
    events: list[tuple[int, int, str]] = []
    out = tmp_path_factory.mktemp("eval-emb4")
    res = evals.run_eval(EvalParams(tasks=TASKS, label="emb4", out=str(out), base_url=emb4_server.base_url),
                         progress=lambda d, t, m: events.append((d, t, m)), serve_config=emb4_server)
    return res, events, out


@pytest.mark.vllm
def test_eval_scores_the_tiny_models_pattern_above_chance(emb4_run):
    res, events, out = emb4_run
    run = Path(res.run_dir)
    assert run.parent == out and run.is_dir() and [p.name for p in out.iterdir()] == [run.name]
    by = {(s.task, s.metric): s for s in res.scores}
    _above_chance(by[("tiny_pattern_mc", "acc")], 0.25)
    # Generation: chance of hitting the one right character among the 94 printable ones.
    _above_chance(by[("tiny_pattern_gen", "exact_match")], 1 / 94)
    # lm-eval's own results JSON and per-sample records, the summary and the provenance.
    results = json.loads(Path(res.files["lm_eval_results"]).read_text())
    assert results["results"]["tiny_pattern_mc"]["acc,none"] == by[("tiny_pattern_mc", "acc")].value
    for task in TASKS:
        lines = Path(res.files[f"samples:{task}"]).read_text().splitlines()
        assert len(lines) == 17 and {"doc_id", "doc_hash"} <= set(json.loads(lines[0]))
    summary = json.loads((run / "summary.json").read_text())
    for row in summary["scores"]:
        assert {"task", "metric", "value", "stderr", "n"} <= set(row)
    md = (run / "summary.md").read_text()
    assert "| tiny_pattern_mc | acc | none |" in md
    prov = json.loads((run / "provenance.json").read_text())
    assert prov["checkpoint_config_sha256"] and prov["eval"]["lm_eval_version"] == "0.4.13"
    assert prov["eval"]["task_versions"] == {"tiny_pattern_mc": 1.0, "tiny_pattern_gen": 1.0}
    assert prov["eval"]["model"] == "gemma-4-tiny-text-emb4" and prov["eval"]["limit"] is None
    # Progress: lm-eval's phases and its request counter reaching the total.
    assert any("loglikelihood" in m for _, _, m in events) and any("generate_until" in m for _, _, m in events)
    assert any(t > 0 and d == t for d, t, _ in events)


@pytest.mark.vllm
def test_eval_cli_json_and_compare_the_two_builds(emb4_run, bf16_server, offline, tmp_path, capsys):
    res, _, _ = emb4_run
    out = tmp_path / "ev"
    rc = _cli(["eval", "--tasks", ",".join(TASKS), "--label", "text", "--out", str(out), "--base-url",
               bf16_server.base_url, "--limit", "12", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    summary = json.loads(cap.out)
    rows = {(r["task"], r["metric"]): r for r in summary["scores"]}
    assert rows[("tiny_pattern_mc", "acc")]["n"] == 12 and rows[("tiny_pattern_mc", "acc")]["value"] > 0.25
    assert "tiny_pattern_mc" in cap.err and "requests" in cap.err  # progress on stderr

    rc = _cli(["eval-compare", res.run_dir, summary["run_dir"], "--json"])
    cmp = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert [r["label"] for r in cmp["runs"]] == ["emb4", "text"]
    mc = next(r for r in cmp["rows"] if r["task"] == "tiny_pattern_mc")
    assert mc["paired"] and mc["n_paired"] == 12 and mc["candidate"] == "text"
    assert mc["within_noise"] is not None and mc["diff"] is not None
    assert "| tiny_pattern_gen | exact_match |" in cmp["markdown"]


@pytest.fixture(scope="module")
def stub_server(tmp_path_factory):
    """An HTTP server that describes itself as vLLM does (/v1/models, /version) and serves nothing else: enough for
    the failures lm-eval reports before its first request, without starting vLLM."""
    with serve_in_thread(lm_eval_stand_in(tmp_path_factory.mktemp("stub-tokenizer"))) as url:
        yield url


def test_eval_unknown_task_is_one_line_and_leaves_nothing(stub_server, offline, tmp_path, capsys):
    rc = _cli(["eval", "--tasks", "tiny_pattern_mc,no_such_task_xyz", "--out", str(tmp_path / "ev"), "--base-url",
               stub_server])
    assert rc == 2
    line = _one_line_error(capsys, "eval")
    assert "unknown lm-eval task(s): no_such_task_xyz" in line
    _no_run_folder(tmp_path / "ev")


def test_eval_dataset_not_loadable_offline_is_one_line(stub_server, offline, tmp_path, capsys):
    inc = tmp_path / "tasks"
    inc.mkdir()
    (inc / "hub_task.yaml").write_text(
        "task: hub_only_task\ndataset_path: gemma4-t4-nonexistent/nonexistent-dataset\noutput_type: "
        "multiple_choice\ntest_split: test\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: 0\n"
        "metric_list:\n  - metric: acc\n")
    rc = _cli(["eval", "--tasks", "hub_only_task", "--include-path", str(inc), "--out", str(tmp_path / "ev"),
               "--base-url", stub_server])
    assert rc == 2
    line = _one_line_error(capsys, "eval")
    assert "cannot be loaded offline" in line and "nonexistent-dataset" in line
    _no_run_folder(tmp_path / "ev")


def test_the_task_check_passes_what_lm_eval_may_resolve(offline, tmp_path, monkeypatch):
    # Builtin names (lm-eval's own YAMLs), glob patterns and include-folder tasks whose hub dataset some local
    # cache holds all go on to lm-eval; only what it would certainly refuse is refused early.
    eval_tasks.check_tasks_before_running(EvalParams(tasks=["arc_easy", "tiny_pattern_mc", "no_such_*"]),
                                      TASKS_DIR)
    inc = tmp_path / "tasks"
    inc.mkdir()
    (inc / "_base.yaml").write_text("dataset_path: some-org/cached-set\noutput_type: multiple_choice\n"
                                    "doc_to_text: !function utils.text\n")
    (inc / "hub_task.yaml").write_text("include: _base.yaml\ntask: hub_task\ntest_split: test\n")
    params = EvalParams(tasks=["hub_task"], include_path=str(inc))
    with pytest.raises(ToolFailure, match="hub_task reads the hub dataset some-org/cached-set"):
        eval_tasks.check_tasks_before_running(params, inc)
    cache = Path(os.environ["HF_DATASETS_CACHE"])
    (cache / "some-org___cached-set").mkdir()
    try:
        eval_tasks.check_tasks_before_running(params, inc)
    finally:
        (cache / "some-org___cached-set").rmdir()
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    eval_tasks.check_tasks_before_running(params, inc)  # online, the hub may have it


def test_lm_evals_own_refusals_are_explained_in_one_line():
    # What lm-eval prints when a name or a dataset passes the early check and fails inside it.
    params = EvalParams(tasks=["x_*"])
    msg, detail = evals._explain_failure("Traceback (most recent call last):\n  ...\nValueError: Tasks not found: "
                                         "x_*\n", 1, params)
    assert msg.startswith("unknown lm-eval task(s): x_*; see `python -m lm_eval ls tasks`")
    assert detail["returncode"] == 1
    log = ("Traceback (most recent call last):\n  ...\nConnectionError: Couldn't reach 'org/set' on the Hub "
           "(LocalEntryNotFoundError)\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        msg, _ = evals._explain_failure(log, 1, params)
    assert msg.startswith("a task's dataset cannot be loaded offline: ConnectionError: Couldn't reach 'org/set'")
    assert msg.endswith("unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE")


def test_mcp_paths_stay_inside_the_roots(tmp_path):
    from tools.core.paths import Roots

    roots = Roots.from_env(models=[str(tmp_path / "models")], evidence=[str(tmp_path / "evidence")])
    (tmp_path / "evidence" / "tasks").mkdir(parents=True)
    p = confine_eval_params(EvalParams(tasks=["t"], include_path="tasks", out="runs"), roots)
    assert p.include_path == str(tmp_path / "evidence" / "tasks") and p.out == str(tmp_path / "evidence" / "runs")
    # The project's own task folder is always allowed.
    p = confine_eval_params(EvalParams(tasks=["t"], include_path=str(TASKS_DIR), out="r"), roots)
    assert p.include_path == str(TASKS_DIR)
    with pytest.raises(ToolFailure, match="include_path .*outside the evidence roots"):
        confine_eval_params(EvalParams(tasks=["t"], include_path=str(tmp_path), out="r"), roots)
    with pytest.raises(ToolFailure, match="out .*outside the evidence roots"):
        confine_eval_params(EvalParams(tasks=["t"], out=str(tmp_path / "elsewhere")), roots)
    with pytest.raises(ToolFailure, match="run .*outside the evidence roots"):
        confine_compare_params(EvalCompareParams(runs=[str(tmp_path), str(tmp_path)]), roots)


def test_progress_is_read_from_lm_evals_output(tmp_path):
    import io

    out = (b"2026-01-01:00:00:00 INFO [api.task:312] Building contexts for tiny_pattern_mc on rank 0...\n"
           b"2026-01-01:00:00:01 INFO [evaluator:570] Running loglikelihood requests\n"
           b"Requesting API:   0%|          | 0/68 [00:00<?, ?it/s]\r"
           b"Requesting API:  50%|#####     | 34/68 [00:01<00:01, 30it/s]\r"
           b"Requesting API: 100%|##########| 68/68 [00:02<00:00, 30it/s]\n")
    reader = evals._OutputReader(io.BytesIO(out), tmp_path / "log")
    reader.thread.join(10)
    events = []
    while not reader.events.empty():
        events.append(reader.events.get())
    assert events[0] == (0, 0, "Building contexts for tiny_pattern_mc")
    assert events[1] == (0, 0, "Running loglikelihood requests")
    assert (34, 68, "Running loglikelihood requests: requests") in events
    assert events[-1] == (68, 68, "Running loglikelihood requests: requests")
    log = (tmp_path / "log").read_text()
    assert "68/68" in log and "Running loglikelihood requests" in log


def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run(tmp_path):
    """A run's temporary folder is the evidence module's (EvidenceRun): one left by a run killed with SIGKILL is
    removed by the next run into the same --out, while a live run's stays."""
    import subprocess
    import sys

    killed = ("import os, sys; from tools.measure.evals import run as evals; "
              "from tools.measure.evals.results import EvalParams; "
              "evals._run_folder(EvalParams(tasks=['tiny_pattern_mc'], label='killed', out=sys.argv[1]), 'm'); "
              "os.kill(os.getpid(), 9)")
    dead = subprocess.run([sys.executable, "-c", killed, str(tmp_path)], cwd=PROJECT_ROOT)
    assert dead.returncode == -9
    left = [p for p in tmp_path.iterdir() if "killed" in p.name]  # the folder and its lock file
    assert any(p.is_dir() and p.name.startswith(".") and ".partial" in p.name for p in left), left
    live = evals._run_folder(EvalParams(tasks=TASKS, label="live", out=str(tmp_path)), "m")
    assert not any(p.exists() for p in left) and live.dir.is_dir()
    live.abandon()
