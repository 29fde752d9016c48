"""The suite's own layout: its folders mirror the code's, what test modules share lives in tests/helpers (the
stand-ins in tests/helpers/stand_ins, stand-in HTTP servers among them), and no test module imports another test
module."""

from __future__ import annotations

import ast
import importlib
from collections import Counter
from pathlib import Path

from tests.helpers.fixtures import ROOT

TESTS = ROOT / "tests"
HELPERS = TESTS / "helpers"
# Folders whose tests drive every command through both front ends, a subject no one code folder holds.
CROSS_CUTTING = {"front_ends"}
# What defining or starting an HTTP server takes: importing one of these is doing it outside tests/helpers/stand_ins.
HTTP_SERVER_MODULES = ("http.server", "socketserver", "aiohttp.web", "starlette", "uvicorn", "wsgiref")


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


def _stand_in_handlers(tree: ast.Module) -> set[str]:
    """The names a module binds, from tests/helpers/stand_ins, to HTTP handler classes (subclassing one is defining
    a handler)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.helpers.stand_ins"):
            module = importlib.import_module(node.module)
            names |= {a.asname or a.name for a in node.names if _is_handler(getattr(module, a.name, None))}
    return names


def _is_handler(obj: object) -> bool:
    # by name: importing http.server here would be this module defining what it looks for
    return isinstance(obj, type) and any((c.__module__, c.__name__) == ("http.server", "BaseHTTPRequestHandler")
                                         for c in obj.__mro__)


def _http_servers_defined(path: Path) -> list[str]:
    """Where `path` defines an HTTP handler (a class statement or type(...) deriving from one) or imports what
    starts an HTTP server."""
    tree = ast.parse(path.read_text(), str(path))
    handlers = {"BaseHTTPRequestHandler"} | _stand_in_handlers(tree)

    def handler(base: ast.expr) -> bool:
        return (base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)) in handlers

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and any(handler(b) for b in node.bases):
            found.append(f"{node.lineno}: class {node.name}")
        elif (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type" and len(node.args) == 3
              and isinstance(node.args[1], ast.Tuple) and any(handler(b) for b in node.args[1].elts)):
            found.append(f"{node.lineno}: type(...)")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{node.lineno}: import {m}" for m in modules
                      if any(m == s or m.startswith(s + ".") for s in HTTP_SERVER_MODULES)]
    return found


def test_stand_in_http_servers_have_one_home():
    """No test module defines an HTTP handler or starts an HTTP server of its own: tests/helpers/stand_ins has them,
    a test's own state given to them as arguments."""
    found = {str(p.relative_to(ROOT)): f for p in _test_modules() if (f := _http_servers_defined(p))}
    assert not found, "\n".join(f"{k}: {', '.join(v)}" for k, v in found.items())
