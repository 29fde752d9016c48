"""The suite's own layout: its folders mirror the code's, what test modules share lives in tests/helpers (the
stand-ins in tests/helpers/stand_ins), and no test module imports another test module."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

from tests.helpers.fixtures import ROOT

TESTS = ROOT / "tests"
HELPERS = TESTS / "helpers"
# Folders whose tests drive every command through both front ends, a subject no one code folder holds.
CROSS_CUTTING = {"front_ends"}


def _test_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def _imported(path: Path) -> list[str]:
    """Every module name `path` imports, `from a.b import c` giving both a.b and a.b.c."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return names


def test_no_test_module_imports_another_test_module():
    """A test module that needs something of another's asks tests/helpers for it instead."""
    found = {str(p.relative_to(ROOT)): [n for n in _imported(p) if n.split(".")[-1].startswith("test_")]
             for p in _test_modules()}
    assert not {k: v for k, v in found.items() if v}


def test_shared_code_has_one_home():
    """Outside tests/helpers, a .py file under tests/ is a test module or a conftest.py."""
    stray = [str(p.relative_to(ROOT)) for p in TESTS.rglob("*.py")
             if "__pycache__" not in p.parts and HELPERS not in p.parents
             and not p.name.startswith("test_") and p.name != "conftest.py"]
    assert not stray


def test_every_test_folder_mirrors_a_code_folder():
    """tests/X/Y tests the code in X/Y (repack/, gemma4_t4_vllm/) or tools/X/Y, or is a cross-cutting folder."""
    folders = {p.parent.relative_to(TESTS) for p in _test_modules()} - {Path(".")}
    unmapped = [str(f) for f in sorted(folders)
                if f.parts[0] not in CROSS_CUTTING and not (ROOT / f).is_dir() and not (ROOT / "tools" / f).is_dir()]
    assert not unmapped


def test_test_module_names_are_unique():
    """pytest imports a test module by its file name (no __init__.py in tests/): two of one name would clash."""
    twice = [name for name, n in Counter(p.name for p in _test_modules()).items() if n > 1]
    assert not twice
