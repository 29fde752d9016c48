"""The code's shape, held by the suite: import-linter's layers and no-cycle contracts (pyproject.toml), no module
taking another module's private names, imports of the project's own modules at the top of a module (a function-level
import is for a heavy or optional dependency only), and modules and functions of one concern."""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
from pathlib import Path

from tests.helpers.fixtures import ROOT

PACKAGES = ("tools", "repack", "gemma4_t4_vllm")
TOP_MODULES = ("server.py", "patch_triton_turing.py")
# Third-party packages slow to import (or not installed everywhere): imported where they are used.
HEAVY = {"vllm", "torch", "transformers", "matplotlib", "numba", "huggingface_hub", "lm_eval", "datasets",
         "llvmlite", "compressed_tensors", "safetensors", "tokenizers", "pynvml", "prometheus_client", "fastmcp",
         "mcp", "uvicorn", "starlette", "scipy"}
# The project's modules that exist to hold a heavy dependency: importing them is importing it.
HEAVY_OWN = {"repack.grid._kernel_numba", "repack.build.build", "repack.build.probe", "tools.mcp.app",
             "gemma4_t4_vllm.int4_matmul"}  # numba, numpy, fastmcp
MODULE_LINES, FUNCTION_LINES = 500, 80
REASON = "# Longer than"  # a module or function past the limit says why, in a comment starting so, at its top


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    return sorted(files + [ROOT / m for m in TOP_MODULES])


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, here: str, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = here.split(".") if is_pkg else here.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def _own(module: str) -> bool:
    return module.split(".")[0] in PACKAGES or module in ("server", "patch_triton_turing")


def test_import_linter_contracts_hold():
    """Layers one way (core <- repack, plugin <- gpu <- serving <- measure <- front ends), no cycles, and code
    outside tools/serving kept to its public face (tools.serving, its config and ops)."""
    proc = subprocess.run([str(Path(sys.executable).with_name("lint-imports")), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def _package_private_module(package: str, name: str, here: str) -> bool:
    """A package's private module, imported from inside that package: private to the package, not to a module."""
    base = ROOT.joinpath(*package.split("."))
    is_module = (base / f"{name}.py").exists() or (base / name / "__init__.py").exists()
    return is_module and here.startswith(package + ".")


def test_no_private_names_across_modules():
    found = []
    for path in _sources():
        here = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(node, here, path.name == "__init__.py")
                if not _own(target) or target == here:
                    continue
                found += [f"{here}: from {target} import {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")
                          and not _package_private_module(target, a.name, here)]
    assert not found, "\n".join(found)


def test_nothing_imports_the_top_modules():
    found = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.name} imports {n}" for n in names if n in ("server", "patch_triton_turing")]
    assert not found, found


def _function_imports(tree: ast.AST):
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    yield fn, node


def test_function_level_imports_are_for_heavy_dependencies_only():
    """A function-level import of the project's own module hides an edge (or a cycle) from a reader."""
    found = []
    for path in _sources():
        here = _module_name(path)
        for fn, node in _function_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:  # `from pkg import module` imports the module
                base = _resolve(node, here, path.name == "__init__.py")
                targets = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base for a in node.names]
            for t in targets:
                if _own(t) and t not in HEAVY_OWN:
                    found.append(f"{here}:{node.lineno} in {fn.name}(): import of {t}")
    assert not found, f"{len(found)} function-level imports of the project's modules:\n" + "\n".join(found)


def _has_reason(lines: list[str], start: int, within: int = 12) -> bool:
    return any(line.strip().startswith(REASON) for line in lines[start:start + within])


def test_modules_and_functions_of_one_concern():
    long_modules, long_functions = [], []
    for path in _sources():
        text = path.read_text()
        lines = text.splitlines()
        if len(lines) > MODULE_LINES and not _has_reason(lines, 0, 40):  # after the module's docstring
            long_modules.append(f"{path.relative_to(ROOT)}: {len(lines)} lines")
        for fn in ast.walk(ast.parse(text, str(path))):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = fn.end_lineno - fn.lineno + 1
                if n > FUNCTION_LINES and not _has_reason(lines, fn.lineno - 1):
                    long_functions.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}(): {n} lines")
    assert not long_modules and not long_functions, "\n".join(long_modules + long_functions)


def test_a_server_is_started_and_stopped_in_one_module():
    """One server's life has one home (tools.serving.server.server, with its Server object): its start and stop
    are defined there only, not beside it in another module."""
    defined: dict[str, list[str]] = {}
    for path in _sources():
        for fn in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(fn, ast.FunctionDef) and fn.name in ("start_server", "stop_server"):
                defined.setdefault(fn.name, []).append(str(path.relative_to(ROOT)))
    assert defined == {"start_server": ["tools/serving/server/server.py"],
                       "stop_server": ["tools/serving/server/server.py"]}, defined


def test_the_time_is_read_in_the_clock_module_only():
    """`datetime.now(`, and a date written with `strftime(` or `time.gmtime(`, in tools/core/clock.py alone: every
    record, lock, log name and heading takes its time and format there."""
    files = _sources() + sorted((ROOT / "bench").glob("*.py"))
    found = [f"{p.relative_to(ROOT)}: {word}" for p in files for word in ("datetime.now(", ".strftime(", "time.gmtime(")
             if word in p.read_text() and p != ROOT / "tools/core/clock.py"]
    assert not found, found

# Exceptions the project raises that are not failures: a job's cancellation and SIGTERM as an interrupt must pass
# every `except ToolFailure` on their way out.
NOT_FAILURES = {"JobCancelled", "Terminated"}


def test_every_failure_type_derives_from_the_projects():
    """A caller catches the project's failures as tools.core.errors.ToolFailure (BadInput for its own input):
    an exception class of the project's derives from it, directly or through another of the project's."""
    declared: dict[str, tuple[str, list[str]]] = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                         for b in node.bases]
                declared[node.name] = (f"{path.relative_to(ROOT)}:{node.lineno}", bases)

    def root(name: str, seen: frozenset[str] = frozenset()) -> str:
        bases = declared.get(name, ("", []))[1]
        own = [b for b in bases if b in declared and b not in seen]
        return root(own[0], seen | {name}) if own and name != "ToolFailure" else name

    exceptions = {n for n in dir(builtins) if isinstance(getattr(builtins, n), type)
                  and issubclass(getattr(builtins, n), BaseException)}
    wrong = [f"{where} {name}({', '.join(bases)})" for name, (where, bases) in declared.items()
             if name not in NOT_FAILURES and name != "ToolFailure"
             and (set(bases) & exceptions or root(name) in exceptions) and root(name) != "ToolFailure"]
    assert not wrong, "exception types outside tools.core.errors.ToolFailure:\n" + "\n".join(wrong)
