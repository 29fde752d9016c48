"""Bad input exits 2 whatever the command, in one line naming the option or the file, before any server is asked
(the servers named here do not exist): a number that is not finite or out of range, an empty --out, a reference
or prompts file that is missing, run folders that are not runs or not finished. These ended in a traceback, in a
run with a timeout of 0, in the current folder, or with exit 1 (a failure of the work, not of the input)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers.fixtures import ROOT

ARTICLE = ROOT / "evidence" / "article-t4"
NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing serves there


def _stopped_sweep(tmp_path: Path) -> Path:
    run = tmp_path / "stopped"
    shutil.copytree(ARTICLE / "emb4", run)
    data = json.loads((run / "summary.json").read_text())
    data["finished"] = None
    (run / "summary.json").write_text(json.dumps(data))
    return run


def _cases(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, what the one line must name)"""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    sweep = ["sweep", "--base-url", NOWHERE, "--out", str(tmp_path / "ev")]
    capacity = ["capacity", "--base-url", NOWHERE, "--out", str(tmp_path / "ev")]
    return {
        "sweep-cell-timeout-nan": (sweep + ["--cell-timeout", "nan"], "--cell-timeout"),
        "sweep-cell-timeout-0": (sweep + ["--cell-timeout", "0"], "--cell-timeout"),
        "sweep-cell-timeout-negative": (sweep + ["--cell-timeout", "-5"], "--cell-timeout"),
        "sweep-cell-timeout-a-year": (sweep + ["--cell-timeout", "31536000"], "--cell-timeout"),
        "sweep-out-empty": (["sweep", "--base-url", NOWHERE, "--out", ""], "--out"),
        "sweep-price-inf": (sweep + ["--price-per-hour", "inf"], "--price-per-hour"),
        "sweep-label-newline": (sweep + ["--label", "a\nb"], "--label"),
        "capacity-cell-timeout-nan": (capacity + ["--cell-timeout", "nan"], "--cell-timeout"),
        "capacity-max-1e308": (capacity + ["--max", "1e308"], "--max"),
        "decode-timeout-inf": (["decode", "--base-url", NOWHERE, "--out", str(tmp_path / "ev"),
                                "--request-timeout-s", "inf"], "--request-timeout-s"),
        "pareto-out-empty": (["pareto", str(ARTICLE / "emb4"), "--out", ""], "--out"),
        "compare-record-out-empty": (["compare", "record", "--base-url", NOWHERE, "--out", ""], "--out"),
        "compare-record-max-tokens-negative": (["compare", "record", "--base-url", NOWHERE, "--out",
                                                str(tmp_path / "t.json"), "--max-tokens", "-5"], "--max-tokens"),
        "compare-record-prompts-missing": (["compare", "record", "--base-url", NOWHERE, "--out",
                                            str(tmp_path / "t.json"), "--prompts", str(tmp_path / "none.txt")],
                                           str(tmp_path / "none.txt")),
        "compare-check-reference-missing": (["compare", "check", str(tmp_path / "none.json"), "--base-url",
                                             NOWHERE], str(tmp_path / "none.json")),
        "sweep-compare-price-nan": (["sweep-compare", str(ARTICLE / "bf16"), str(ARTICLE / "emb4"),
                                     "--price-per-hour", "nan"], "--price-per-hour"),
        "sweep-compare-stopped-run": (["sweep-compare", str(ARTICLE / "bf16"), str(_stopped_sweep(tmp_path))],
                                      "stopped"),
        "eval-compare-not-runs": (["eval-compare", str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "a")),
        # a missing --env-file exited 1 (a failure of the work), where doctor exited 2 for the same file
        "status-env-file-missing": (["status", "--env-file", str(tmp_path / "none.env")], "--env-file"),
        "env-file-first-missing": (["--env-file", str(tmp_path / "none.env"), "stop"], str(tmp_path / "none.env")),
        "decode-env-file-missing": (["decode", "--env-file", str(tmp_path / "none.env"), "--out",
                                    str(tmp_path / "ev")], "--env-file"),
    }


NAMES = ["sweep-cell-timeout-nan", "sweep-cell-timeout-0", "sweep-cell-timeout-negative", "sweep-cell-timeout-a-year",
         "sweep-out-empty", "sweep-price-inf", "sweep-label-newline", "capacity-cell-timeout-nan",
         "capacity-max-1e308", "decode-timeout-inf", "pareto-out-empty", "compare-record-out-empty",
         "compare-record-max-tokens-negative", "compare-record-prompts-missing", "compare-check-reference-missing",
         "sweep-compare-price-nan", "sweep-compare-stopped-run", "eval-compare-not-runs", "status-env-file-missing",
         "env-file-first-missing", "decode-env-file-missing"]


@pytest.mark.parametrize("case", NAMES)
def test_bad_input_exits_2_in_one_line_naming_it(case, tmp_path, capsys, monkeypatch):
    from tools.cli import main

    monkeypatch.chdir(tmp_path)  # an empty --out must not mean this folder
    cases = _cases(tmp_path)
    assert sorted(cases) == sorted(NAMES)
    argv, named = cases[case]
    before = sorted(os.listdir(tmp_path))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert named in err, err
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, here or in --out
