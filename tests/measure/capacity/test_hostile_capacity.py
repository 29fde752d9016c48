"""Hostile input to `./vllm-t4 capacity` beyond its SLO text: load and sweep options out of range (one line
naming the flag, exit 2, nothing created), and a server whose /v1/models reply is not an OpenAI-compatible list
(one line naming --base-url, exit 1, no traceback), on the command line and over MCP."""

from __future__ import annotations

import json

import pytest

from tests.helpers.stand_ins.measure import models_body_stand_in, serve_in_thread
from tools.cli import main


@pytest.mark.parametrize("argv, flag", [
    (["--max", "inf"], "--max"),
    (["--max", "nan"], "--max"),
    (["--repeats", "0"], "--repeats"),
    (["--output-len", "0"], "--output-len"),
    (["--price-per-hour", "-1"], "--price-per-hour"),
    (["--label", "a/b"], "--label"),
    (["--label", "a" * 300], "--label"),
])
def test_out_of_range_options_are_one_line_naming_the_flag(tmp_path, capsys, argv, flag):
    out = tmp_path / "out"
    rc = main(["capacity", "--base-url", "http://127.0.0.1:9", "--out", str(out), *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert flag in err, err
    assert not out.exists()  # nothing created


@pytest.mark.parametrize("body", ['[1, 2]', '{"data": {"a": 1}}', '{"data": ["x"]}',
                                  '{"data": [{"id": "m", "max_model_len": 1e999}]}', 'not json'])
def test_a_server_that_does_not_list_models_is_one_line(tmp_path, capsys, body):
    with serve_in_thread(models_body_stand_in(body.encode())) as url:
        rc = main(["capacity", "--base-url", url, "--out", str(tmp_path / "out"), "--json"])
    cap = capsys.readouterr()
    assert rc == 1 and "Traceback" not in cap.err
    err = json.loads(cap.out)
    assert err["error"].startswith(f"no vLLM server answers at {url}") and "--base-url" in err["error"]
    assert err["detail"]["argument"] == "base_url"
