"""The hostile-output matrix: every command that writes an output, against every class of output path (exists, a
file where a folder is wanted or the reverse, a parent that is a file, read-only, a full disk), from the command
line; and every MCP tool that writes, against an output outside the roots. Each answer is one line naming the
path, exit status 2, no traceback, and nothing left behind. None needs a server: the output is checked before any
is asked (the server's URL here is a port nothing listens on, so a check made after asking would fail otherwise).

Read-only and full places are real tmpfs mounts where the sandbox may mount (CI runs as root: chmod would not stop
a write); elsewhere those two classes are skipped, since an injected errno would not exercise the check made
before the write. The repack's output is checked by its own matrix (tests/repack/test_repack_bad_input.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.mounts import MOUNT, fill, listing
from tools.cli import main

DEAD = "http://127.0.0.1:9"
# command -> (argv before --out, whether --out names a file rather than a folder of runs)
WRITERS: dict[str, tuple[list[str], bool]] = {
    "decode": (["decode", "--base-url", DEAD], False),
    "decode-sweep": (["decode-sweep", "--draft-tokens", "0"], False),
    "sweep": (["sweep", "--base-url", DEAD], False),
    "fidelity record": (["fidelity", "record", "--base-url", DEAD], True),
    "compare record": (["compare", "record", "--base-url", DEAD], True),
    "eval": (["eval", "--tasks", "tiny_pattern_mc", "--base-url", DEAD], False),
    "fetch": (["fetch", "acme/tiny"], False),
    "capacity": (["capacity", "--base-url", DEAD], False),
}
KINDS = ["exists", "wrong-kind", "parent-is-file", "read-only", "full"]


def _place(kind: str, tmp_path: Path, mounts, is_file: bool, command: str) -> tuple[Path, Path]:
    """(the --out to give, the folder whose listing must not change)."""
    area = tmp_path / "area"
    area.mkdir()
    if kind == "exists":
        if is_file:
            (area / "out.json").write_text("theirs\n")
            return area / "out.json", area
        (area / "out").mkdir()
        (area / "out" / "theirs.txt").write_text("x")
        return area / "out", area
    if kind == "wrong-kind":
        if is_file:
            (area / "out.json").mkdir()
            return area / "out.json", area
        (area / "out").write_text("a file\n")
        return area / "out", area
    if kind == "parent-is-file":
        (area / "plain").write_text("a file\n")
        return area / "plain" / ("out.json" if is_file else "out"), area
    if not MOUNT:
        pytest.skip("this sandbox cannot mount")
    if kind == "read-only":
        mounts(area / "m", "ro")
    else:
        mounts(area / "m")
        fill(area / "m")
    inner = area / "m"
    return inner / ("out.json" if is_file else "out"), inner


# An existing folder of runs is where runs go (not a refusal), except for fetch, whose output is the folder itself.
CASES = [(c, k) for c in WRITERS for k in KINDS if k != "exists" or WRITERS[c][1] or c == "fetch"]


@pytest.mark.parametrize("command,kind", CASES)
def test_every_writer_refuses_every_hostile_output_in_one_line(command, kind, tmp_path, mounts, capsys, monkeypatch):
    argv, is_file = WRITERS[command]
    out, watched = _place(kind, tmp_path, mounts, is_file, command)
    monkeypatch.setenv("STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("HF_ENDPOINT", DEAD)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    before = listing(watched)
    capsys.readouterr()
    rc = main([*argv, "--out", str(out)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"vllm-t4 {command}: ") and "Traceback" not in err, err
    assert str(out) in lines[0] or str(out.parent) in lines[0], lines[0]
    assert "server" not in lines[0] and "network" not in lines[0], lines[0]  # refused before asking
    assert listing(watched) == before
    assert not (tmp_path / "state").exists()


# The MCP tools that write, each with an output outside the roots: refused by name, nothing written there.
MCP_WRITERS = {
    "run_decode_bench": lambda out: {"out": out, "base_url": DEAD},
    "run_sweep": lambda out: {"out": out, "base_url": DEAD},
    "run_eval": lambda out: {"tasks": ["tiny_pattern_mc"], "out": out, "base_url": DEAD},
    "compare_logprobs": lambda out: {"mode": "record", "reference": out + "/ref.json", "base_url": DEAD},
    "compare_tokens": lambda out: {"mode": "record", "reference": out + "/tok.json", "base_url": DEAD},
    "fetch_checkpoint": lambda out: {"repo_id": "acme/tiny", "out": out},
}


def test_every_mcp_writer_refuses_an_output_outside_the_roots(tmp_path, monkeypatch):
    import asyncio

    from fastmcp import Client
    from fastmcp.exceptions import ToolError

    from tools.core.paths import Roots
    from tools.mcp.app import Settings, create_server

    (tmp_path / "models").mkdir()
    (tmp_path / "evidence").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.setenv("HF_ENDPOINT", DEAD)
    roots = Roots.from_env([str(tmp_path / "models")], [str(tmp_path / "evidence")], environ={})
    mcp = create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}), toolsets="all")

    async def go():
        got = {}
        async with Client(mcp) as c:
            for tool, args in MCP_WRITERS.items():
                with pytest.raises(ToolError) as e:
                    await c.call_tool(tool, args(str(outside)))
                got[tool] = str(e.value)
        return got

    for tool, msg in asyncio.run(go()).items():
        assert "\n" not in msg and "outside" in msg and "Traceback" not in msg, (tool, msg)
        assert "server" not in msg.split("outside")[0], (tool, msg)
    assert os.listdir(outside) == []
