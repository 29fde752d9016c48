"""Every operation the code names to a caller (tools.core.errors.op) is one each front end can spell: a command
(tools.core.commands.COMMAND_LINES, which every `Command` declaration is held to) and an MCP tool (derived from the
`@tool(ops=...)` declarations), or for MCP a declared way to do it without a tool."""

from __future__ import annotations

import argparse
import ast
import importlib

import pytest

from tests.helpers.fixtures import ROOT
from tools.cli import MODULES
from tools.core.commands import COMMAND_LINES, Command, add_commands, check_declared, command_line, spellings
from tools.core.errors import op, render
from tools.mcp import catalog
from tools.mcp.wording import MCP, OPERATION_TOOLS, WITHOUT_TOOL

PACKAGES = ("tools", "repack", "gemma4_t4_vllm")
TOP_MODULES = ("server.py", "patch_triton_turing.py")


def _named_operations() -> dict[str, list[str]]:
    """Each literal `op("...")` in the project's code -> where it is written."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")] + [ROOT / m for m in TOP_MODULES]
    found: dict[str, list[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "op"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                found.setdefault(node.args[0].value, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_the_scan_finds_the_operations_the_code_names():
    named = _named_operations()
    assert {"start", "stop", "fetch", "swap", "pareto", "compare_tokens.record", "fidelity.record"} <= set(named)


def test_every_operation_the_code_names_has_a_command():
    missing = {name: where for name, where in _named_operations().items() if name not in COMMAND_LINES}
    assert not missing, f"no command does these operations: {missing}"


def test_every_operation_the_code_names_has_an_mcp_tool_or_a_declared_way():
    assert catalog.load_all()  # every tool module imported: their declarations are the table
    missing = {name: where for name, where in _named_operations().items()
               if name not in OPERATION_TOOLS and name not in WITHOUT_TOOL}
    assert not missing, f"no MCP tool does these operations and WITHOUT_TOOL does not say how: {missing}"
    assert not set(WITHOUT_TOOL) & set(OPERATION_TOOLS), "an operation with a tool is also declared without one"


def test_the_mcp_table_names_declared_tools_and_every_tool_op_has_a_command():
    assert {tool for tool, _ in OPERATION_TOOLS.values()} <= set(catalog.load_all())
    assert set(OPERATION_TOOLS) <= set(COMMAND_LINES), set(OPERATION_TOOLS) - set(COMMAND_LINES)


def test_each_front_end_spells_an_operation_from_its_declarations():
    msg = f"run {op('fetch', repo_id='google/x', out='models/x')}, then {op('fidelity.record')}"
    assert render(msg, MCP) == ("run fetch_checkpoint (repo_id=google/x, out=models/x), then "
                                "compare_logprobs (mode=record)")
    assert command_line("fetch", {"repo_id": "google/x", "out": "models/x"}) == \
        "`./vllm-t4 fetch google/x --out models/x`"
    assert command_line("compare_tokens.record", {}) == "`./vllm-t4 compare record`"
    assert command_line("repack", {"source": "a", "output": "b"}) == "`python3 -m repack build a b`"
    assert render(op("swap"), MCP) == ("`./vllm-t4 swap` as root on the server's machine (no MCP tool: the "
                                       "swapfile needs root)")


def test_a_command_is_its_operation_by_name_unless_it_says_otherwise():
    router = Command("router", "r", children=[Command("start", "s")])
    compare = Command("compare", "c", op="compare_tokens", children=[Command("record", "r")])
    ops = spellings([router, compare, Command("sweep-compare", "x")], "./prog")
    assert ops == {"router": ("./prog router", ()), "router.start": ("./prog router start", ()),
                   "compare_tokens": ("./prog compare", ()), "compare_tokens.record": ("./prog compare record", ()),
                   "sweep_compare": ("./prog sweep-compare", ())}


def test_every_command_declaration_is_typed_as_the_table_says():
    declared = {}
    vllm_t4 = set(MODULES.values()) - {"tools.cli"}  # tools.cli lists `demo` only (tools.cli.register)
    for prog, modules in (("./vllm-t4", vllm_t4), ("python3 -m repack", ("tools.cli.repack_cli",))):
        for module in modules:
            declared.update(spellings(importlib.import_module(module).COMMANDS, prog))
    declared["demo"] = COMMAND_LINES["demo"]  # the demo's own front end, run in ./vllm-t4's place
    scripts = {"tiny_model", "patch_turing", "vram"}  # programs of their own, with no subcommands
    assert declared == {op: line for op, line in COMMAND_LINES.items() if op not in scripts}


def test_a_command_out_of_step_with_the_table_is_refused_at_registration():
    check_declared([Command("fetch", "f", positional=("repo_id",))], "./vllm-t4")
    with pytest.raises(LookupError, match="fetch"):
        check_declared([Command("fetch", "f")], "./vllm-t4")  # its bare argument missing
    with pytest.raises(LookupError, match="bogus"):
        add_commands(argparse.ArgumentParser().add_subparsers(), [Command("bogus", "b")])
