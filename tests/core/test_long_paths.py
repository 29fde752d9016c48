"""A path the file system refuses (a name over 255 bytes: ENAMETOOLONG) is bad input wherever a user gives it: one
line naming it, exit 2, through the command line and MCP alike. Every OSError on a path is mapped in one place
(tools.core.atomic_files.path_failure, called by the command line's handler and MCP's error rendering), so a call
site that did not foresee one still answers in one line; these ended in a traceback (MCP: "OSError: [Errno 36]")."""

from __future__ import annotations

import asyncio
import errno
import json

import pytest
from fastmcp import Client

from tools.core.errors import BadInput, ToolFailure

LONG = "a" * 300


def _cases(tmp_path):
    far = str(tmp_path / LONG)
    return {
        "start-model": (["start", "--model", far], {}),
        "doctor-model-name": (["doctor"], {"MODEL_NAME": far}),
        "fetch-out": (["fetch", "E4B", "--out", far], {}),
        "start-drafter": (["start", "--model", str(tmp_path)],
                          {"SPECULATIVE_CONFIG": json.dumps({"model": far, "num_speculative_tokens": 2})}),
    }


@pytest.mark.parametrize("case", ["start-model", "doctor-model-name", "fetch-out", "start-drafter"])
def test_a_name_over_255_bytes_is_one_line_exit_2(case, tmp_path, capsys, monkeypatch):
    from tools.cli import main

    monkeypatch.setenv("STATE_DIR", str(tmp_path / "run"))
    argv, env = _cases(tmp_path)[case]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = main(argv)
    err = capsys.readouterr().err
    failures = [ln for ln in err.splitlines() if ln.startswith("vllm-t4 ")]  # a progress line may come first
    assert "Traceback" not in err and len(failures) == 1 and err.strip().endswith(failures[0]), err
    assert rc == 2 and "too long" in failures[0], err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("vllm.json"))


def test_mcp_preflight_names_a_name_over_255_bytes(tmp_path):
    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    (tmp_path / "models").mkdir()
    roots = Roots.from_env([str(tmp_path / "models")], [str(tmp_path / "ev")], environ={})
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run"),
                                                                 "model": str(tmp_path / LONG)}))

    async def go():
        async with Client(mcp) as c:
            return await c.call_tool("preflight", {}, raise_on_error=False)

    r = asyncio.run(go())
    text = r.content[0].text
    assert "OSError" not in text and "Errno" not in text and "\n" not in text, text
    assert "too long" in text, text


@pytest.mark.parametrize("code, kind", [(errno.ENAMETOOLONG, BadInput), (errno.EACCES, BadInput),
                                         (errno.ENOENT, BadInput), (errno.ENOSPC, ToolFailure)])
def test_path_failure_is_one_line_naming_the_path(code, kind):
    from tools.core.atomic_files import path_failure

    exc = path_failure(OSError(code, "x", "/d/" + LONG))
    assert type(exc) is kind or (kind is BadInput and isinstance(exc, BadInput))
    assert "\n" not in str(exc) and "/d/aaa" in str(exc) and len(str(exc)) < 400
    assert isinstance(exc, BadInput) == (code != errno.ENOSPC)
