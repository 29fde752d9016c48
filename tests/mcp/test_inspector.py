"""The MCP Inspector's own CLI (pinned in tests/inspector/package.json, installed there by setup.sh) against
server.py over stdio, as people look at an MCP server: its strict tools/list reports no error and no warning on
the default toolsets and with every toolset listed, and it lists the resources, templates and prompts without
complaint. Node is a test tool here, never a serving one: without npm on the machine this module cannot run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PINNED = ROOT / "tests" / "inspector"
CLI = PINNED / "node_modules" / ".bin" / "mcp-inspector"

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="no Node on this machine: setup.sh installs "
                                "the MCP Inspector where npm exists")


def inspect(method: str, *args: str, tmp_path: Path) -> tuple[dict, str]:
    """One Inspector CLI call against server.py: (its JSON answer, its stderr)."""
    if not CLI.exists():
        pytest.fail(f"the MCP Inspector is not installed in {PINNED}: run ./setup.sh (or npm install --prefix "
                    f"{PINNED.relative_to(ROOT)} --ignore-scripts)")
    (tmp_path / "models").mkdir(exist_ok=True)
    (tmp_path / "evidence").mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT), GEMMA4_T4_MODELS_ROOTS=str(tmp_path / "models"),
               GEMMA4_T4_EVIDENCE_ROOTS=str(tmp_path / "evidence"), STATE_DIR=str(tmp_path / "run"))
    env.pop("GEMMA4_T4_TOOLSETS", None)
    strict = ["--strict"] if method == "tools/list" else []  # the Inspector lints tools' schemas only
    proc = subprocess.run([str(CLI), "--cli", *strict, sys.executable, str(ROOT / "server.py"), *args,
                           "--method", method], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout), proc.stderr


@pytest.mark.parametrize("toolsets", [[], ["--toolsets", "all"]], ids=["default", "all"])
def test_inspector_strict_tools_list_has_no_warning(toolsets, tmp_path):
    listed, err = inspect("tools/list", *toolsets, tmp_path=tmp_path)
    findings = [line for line in err.splitlines() if line.startswith(("Warning:", "Error:"))]
    assert not findings, err[:4000]
    assert len(listed["tools"]) >= (30 if toolsets else 13)
    for t in listed["tools"]:  # every field typed (a free-form one undeclared and said so)
        for name, prop in t["outputSchema"]["properties"].items():
            assert "type" in prop or "anyOf" in prop or "const" in prop, (t["name"], name)


@pytest.mark.parametrize("method,key", [("resources/list", "resources"), ("resources/templates/list",
                                                                          "resourceTemplates"),
                                        ("prompts/list", "prompts")])
def test_inspector_lists_resources_and_prompts(method, key, tmp_path):
    listed, err = inspect(method, tmp_path=tmp_path)
    assert listed[key], listed
    assert "warning" not in err.lower() and "error" not in err.lower(), err[:4000]
