"""The CPU path inside MCP without vLLM: the stand-in source tool, and the refusals on the walk that name the
tool and arguments that fix them on this platform."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError


def run(coro):
    return asyncio.run(coro)


async def _error(mcp, tool: str, args: dict) -> str:
    async with Client(mcp) as c:
        with pytest.raises(ToolError) as ei:
            await c.call_tool(tool, args)
    return str(ei.value)


@pytest.mark.parametrize("platform, remedy", [
    ("cpu", "make a source with make_tiny_model (out=tiny-gemma4-qat), build it with repack_checkpoint "
            "(source=tiny-gemma4-qat, output=emb4)"),
    ("cuda", "make a source with fetch_checkpoint (repo_id=google/gemma-4-E2B-it-qat-q4_0-unquantized, "
             "out=SOURCE), build it with repack_checkpoint (source=SOURCE, output=emb4)"),
])
def test_a_start_on_a_missing_model_names_the_calls_that_make_it(mcp, platform, remedy):
    mcp.gemma._platform = platform
    err = run(_error(mcp, "start_vllm_server", {"model": "emb4"}))
    assert err.startswith("model emb4 does not exist under the models roots: ") and remedy in err, err


def test_a_probe_or_repack_of_a_missing_source_names_the_stand_in_on_cpu(mcp):
    mcp.gemma._platform = "cpu"
    probe = run(_error(mcp, "probe_checkpoint", {"path": "tiny"}))
    assert probe.endswith("path tiny does not exist under the models roots: make it with make_tiny_model "
                          "(out=tiny)"), probe
    repack = run(_error(mcp, "repack_checkpoint", {"source": "tiny", "output": "emb4"}))
    assert "make it with make_tiny_model (out=tiny)" in repack, repack
    mcp.gemma._platform = "cuda"
    assert "fetch_checkpoint (repo_id=google/gemma-4-E2B-it-qat-q4_0-unquantized, out=tiny)" in run(
        _error(mcp, "probe_checkpoint", {"path": "tiny"}))


def test_a_missing_folder_named_as_a_members_checkpoint_is_fetched_never_stood_in_for(mcp):
    """A stand-in written under a real checkpoint's name would be repacked and served as that member: on any
    machine the remedy is the member's own repository."""
    for platform in ("cpu", "cuda"):
        mcp.gemma._platform = platform
        for member in ("E4B", "26B-A4B"):
            name = f"gemma-4-{member}-it-qat-q4_0-unquantized"
            err = run(_error(mcp, "probe_checkpoint", {"path": name}))
            assert f"make it with fetch_checkpoint (repo_id=google/{name}, out={name})" in err, err
            assert "make_tiny_model" not in err


def test_make_tiny_model_refuses_what_it_would_replace(mcp, tmp_path):
    models = tmp_path / "models"
    (models / "taken").mkdir()
    (models / "taken" / "notes.txt").write_text("mine")
    err = run(_error(mcp, "make_tiny_model", {"out": "taken"}))
    assert err == f"out {models / 'taken'} exists: pass force=true to replace it, or choose another", err
    err = run(_error(mcp, "make_tiny_model", {"out": "taken", "force": True}))
    assert "replaces only a folder this tool wrote" in err and (models / "taken" / "notes.txt").is_file()
    # a checkpoint is no mark of this tool: a repack build or a fetched source has a config.json too
    for name, own in (("build", "repack-report.json"), ("fetched", "fetch-manifest.json")):
        (models / name).mkdir()
        for f in ("config.json", own):
            (models / name / f).write_text("{}")
        err = run(_error(mcp, "make_tiny_model", {"out": name, "force": True}))
        assert f"out {models / name} exists and force=true replaces only a folder this tool wrote" in err, err
        assert "did not write it" in err and sorted(p.name for p in (models / name).iterdir()) == sorted(
            ["config.json", own])
    assert "is a root or holds one" in run(_error(mcp, "make_tiny_model", {"out": str(models)}))
    assert "outside the models roots" in run(_error(mcp, "make_tiny_model", {"out": str(tmp_path / "x")}))


def test_make_tiny_model_writes_a_source_probe_calls_qat(mcp, tmp_path):
    """The stand-in from an empty models root (trained once per content address, then copied from the cache)."""
    seen = []

    async def go():
        async with Client(mcp) as c:
            made = await c.call_tool("make_tiny_model", {},
                                     progress_handler=lambda p, t, m: seen.append(p) or asyncio.sleep(0))
            probe = await c.call_tool("probe_checkpoint", {"path": made.structured_content["path"]})
            again = await c.call_tool("make_tiny_model", {"force": True})
            return made, probe, again

    made, probe, again = run(go())
    out = tmp_path / "models" / "tiny-gemma4-qat"
    assert made.structured_content["path"] == str(out) and (out / "config.json").is_file()
    assert made.structured_content["accuracy"] > 0.95 and seen[-1] == 1
    assert made.content[0].text.startswith(f"wrote the tiny QAT source {out}")
    assert json.loads(made.content[1].text) == made.structured_content
    assert probe.structured_content["verdict"] == "qat"
    assert again.structured_content["path"] == str(out)  # a checkpoint it wrote is replaced with force=true


def test_make_tiny_model_takes_the_shape_of_the_command_lines_model(mcp, tmp_path, monkeypatch):
    """shape (repack.stand_ins.tiny_shapes: e2b by default, e4b, moe) reaches the stand-in's build, declared once for the
    MCP tool and `python -m repack.tiny_model` (repack.params.TinyModelParams); another is refused in one line naming
    it, before anything is written."""
    from repack.stand_ins import tiny_model
    from repack.params import TinyModelParams
    from repack.stand_ins.tiny_shapes import SHAPE_NAMES
    from tools.mcp.repack_tools import TinyParams

    made: list[dict] = []

    def stand_in(out, **kw):  # the shape is what this checks, not the training (the stdio walk trains the E4B one)
        made.append(kw)
        Path(out).mkdir(parents=True)
        tiny_model.mark(Path(out), "source")
        return tiny_model.TinyModelInfo(Path(out), 1.0, ["w"], 0)

    monkeypatch.setattr(tiny_model, "cached_tiny_qat_checkpoint", stand_in)

    async def go():
        async with Client(mcp) as c:
            listed = {t.name: t for t in await c.list_tools()}["make_tiny_model"]
            default = await c.call_tool("make_tiny_model", {})
            e4b = await c.call_tool("make_tiny_model", {"out": "e4b", "shape": "e4b"})
            bad = await c.call_tool("make_tiny_model", {"out": "e8b", "shape": "e8b"}, raise_on_error=False)
            return listed, default, e4b, bad

    listed, default, e4b, bad = run(go())
    assert issubclass(TinyParams, TinyModelParams) and SHAPE_NAMES == ("e2b", "e4b", "moe")
    assert listed.input_schema["properties"]["shape"]["enum"] == list(SHAPE_NAMES)
    assert made == [{"shape": "e2b"}, {"shape": "e4b"}]
    assert default.structured_content["shape"] == "e2b" and e4b.structured_content["shape"] == "e4b"
    assert e4b.content[0].text.startswith(f"wrote the tiny QAT source {tmp_path / 'models' / 'e4b'}, shaped as e4b")
    text = bad.content[0].text
    assert bad.is_error and "argument shape: " in text and "\n" not in text and "e4b" in text, text
    assert not (tmp_path / "models" / "e8b").exists() and len(made) == 2
