"""Where vLLM's Triton unified attention decides its KV tile size, found by what the code does (Python's `ast`).

The decision is the module-level function that takes the head size and whose result, assigned to a name, reaches
the `TILE_SIZE=` argument of a Triton kernel launch (today `_get_tile_size`, assigned to TILE_SIZE_PREFILL and
TILE_SIZE_DECODE in `unified_attention`). `find_decision` returns where the Turing clamp goes (after the last
statement that sets those names, before the first that only reads them) and the expressions it needs: the head
size and element size the decision is given, the launch's BLOCK_M and the variable its num_stages comes from.
A file where any of these cannot be found is refused (`ClampRefused`): a patch that does nothing is worse.

`decided_tiles` runs the decision function itself on a stand-in Turing device (capability 7.5, 64 KiB of shared
memory per block) at head 512: an upstream fix made inside the decision shows there as tiles that already fit.
That is code from the file, so the tools run it through `decided_tiles_bounded`: in a child process of its own
(`python -m tools.serving.turing.decision`, the question on stdin, the answer on stdout), ended after a timeout,
so a decision that loops, raises KeyboardInterrupt or calls exit() is one line (`DecisionNotRun`), never a hang,
a traceback or this process's exit.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tools.core.errors import BadInput, ToolFailure
from tools.core.process import kill_group, python_child_env
from tools.core.root import PROJECT_ROOT

EXPECTED = ("a module-level function taking the head size whose result, assigned to a name, is the TILE_SIZE of "
            "the attention kernel's launch")


class ClampRefused(BadInput):
    """The file holds no tile-size decision the clamp understands (another vLLM version)."""


@dataclass(frozen=True)
class Decision:
    function: str  # the caller that launches the kernel (unified_attention)
    decision: str  # the function that picks the tile size (_get_tile_size)
    tiles: tuple[str, ...]  # the names the decision is assigned to (TILE_SIZE_PREFILL, TILE_SIZE_DECODE)
    head: str  # source of the head size passed to the decision
    element: str  # source of the element size passed to the decision
    block_m: str  # source of the launch's BLOCK_M
    stages: str  # the variable the launch's num_stages comes from
    after_line: int  # the clamp goes after this (1-based) line
    indent: str


def refuse(path: str | Path, why: str) -> ClampRefused:
    return ClampRefused(f"{path}: the Turing clamp cannot find vLLM's tile-size decision ({why}); it expected "
                        f"{EXPECTED}: another vLLM version; pin the vLLM in pyproject.toml or update "
                        "tools/serving/turing/decision.py")


def _names(node: ast.AST, ctx: type) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ctx)}


def _assignments(func: ast.FunctionDef) -> dict[str, list[ast.expr]]:
    """name -> every value assigned to it (plain and annotated assignments to a single name) inside `func`."""
    found: dict[str, list[ast.expr]] = {}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    found.setdefault(t.id, []).append(node.value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found.setdefault(node.target.id, []).append(node.value)
    return found


def _head_param(fn: ast.FunctionDef) -> str | None:
    return next((a.arg for a in fn.args.args if "head" in a.arg.lower()), None)


def _returns_a_value(fn: ast.FunctionDef) -> bool:
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
    return bool(returns) and all(r.value is not None for r in returns)


def _bound_args(call: ast.Call, fn: ast.FunctionDef) -> dict[str, ast.expr]:
    params = [a.arg for a in fn.args.args]
    bound = {params[i]: arg for i, arg in enumerate(call.args) if i < len(params)}
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    return bound


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _tile_sources(func: ast.FunctionDef, launches: list[ast.Call], funcs: dict[str, ast.FunctionDef]
                  ) -> tuple[list[str], dict[str, ast.Call]]:
    """Follows each launch's TILE_SIZE back through name-to-name assignments to the names a decision call sets."""
    assigned = _assignments(func)
    todo = [v.id for c in launches if isinstance(v := _keyword(c, "TILE_SIZE"), ast.Name)]
    seen: list[str] = []
    tiles: list[str] = []
    calls: dict[str, ast.Call] = {}
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.append(name)
        for value in assigned.get(name, []):
            if isinstance(value, ast.Name):
                todo.append(value.id)
            elif isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in funcs:
                fn = funcs[value.func.id]
                head = _head_param(fn)
                if head and head in _bound_args(value, fn) and _returns_a_value(fn):
                    tiles.append(name)
                    calls.setdefault(name, value)
    tiles.sort(key=lambda n: calls[n].lineno)  # in the file's order: prefill, then decode
    return tiles, calls


def _stages(func: ast.FunctionDef, launch: ast.Call) -> str | None:
    """The variable the launch's num_stages comes from: a `num_stages=NAME` keyword, or `D["num_stages"] = NAME`
    for a dict D the launch spreads with `**D`."""
    direct = _keyword(launch, "num_stages")
    if direct is not None:
        return direct.id if isinstance(direct, ast.Name) else None
    spread = {k.value.id for k in launch.keywords if k.arg is None and isinstance(k.value, ast.Name)}
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name):
            for t in node.targets:
                if (isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in spread
                        and isinstance(t.slice, ast.Constant) and t.slice.value == "num_stages"):
                    return node.value.id
    return None


def _insertion(path: str | Path, func: ast.FunctionDef, tiles: list[str], fixed: list[str]) -> ast.stmt:
    """The last statement of `func` that sets a tile name; none may read them before it, nor set `fixed` after."""
    body = func.body
    sets = [i for i, s in enumerate(body) if _names(s, ast.Store) & set(tiles)]
    reads = [i for i, s in enumerate(body) if _names(s, ast.Load) & set(tiles) and i not in sets]
    last = sets[-1]
    if reads and reads[0] < last:
        raise refuse(path, f"{', '.join(tiles)} are read at line {body[reads[0]].lineno} before they are last set "
                           f"at line {body[last].lineno}")
    later = [(n, body[i].lineno) for i in range(last + 1, len(body)) for n in fixed if n in _names(body[i], ast.Store)]
    if later:
        raise refuse(path, f"{later[0][0]} is set again at line {later[0][1]}, after the tile sizes")
    return body[last]


def _module_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Assign):
            names |= _names(node, ast.Store)
    return names


def _candidates(funcs: dict[str, ast.FunctionDef]) -> Iterator[tuple[ast.FunctionDef, list[ast.Call]]]:
    for f in funcs.values():
        launches = [c for c in ast.walk(f) if isinstance(c, ast.Call) and _keyword(c, "TILE_SIZE") is not None]
        if launches:
            yield f, launches


def find_decision(text: str, path: str | Path) -> Decision:
    """The tile-size decision of `text` and where the clamp goes; ClampRefused when it is not there."""
    try:
        tree = ast.parse(text)
    except SyntaxError as exc:
        raise refuse(path, f"not Python: {exc.msg} at line {exc.lineno}") from None
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    found = []
    for f, launches in _candidates(funcs):
        tiles, calls = _tile_sources(f, launches, funcs)
        if tiles:
            found.append((f, launches, tiles, calls))
    if not found:
        raise refuse(path, "no kernel launch's TILE_SIZE comes from such a function")
    if len(found) > 1:
        raise refuse(path, f"{len(found)} functions launch with a decided TILE_SIZE: "
                           + ", ".join(f[0].name for f in found))
    func, launches, tiles, calls = found[0]
    call = calls[tiles[0]]
    fn = funcs[call.func.id]  # type: ignore[attr-defined]
    bound = _bound_args(call, fn)
    element = next((v for k, v in bound.items() if "elem" in k.lower()), None)
    if element is None:
        raise refuse(path, f"{fn.name} is not given the element size")
    launch = next((c for c in launches if _keyword(c, "BLOCK_M") is not None and _stages(func, c)), None)
    if launch is None:
        raise refuse(path, f"no launch in {func.name} passes BLOCK_M and a num_stages the clamp can set")
    if "current_platform" not in _module_names(tree):
        raise refuse(path, "current_platform is not imported")
    block_m, stages = ast.unparse(_keyword(launch, "BLOCK_M")), _stages(func, launch)  # type: ignore[arg-type]
    at = _insertion(path, func, tiles, [stages, block_m])  # type: ignore[list-item]
    return Decision(func.name, fn.name, tuple(tiles), ast.unparse(bound[_head_param(fn)]),  # type: ignore[index]
                    ast.unparse(element), block_m, stages, at.end_lineno or at.lineno, " " * at.col_offset)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------
# Running the decision on a stand-in Turing device

class _Capability(tuple):
    major = property(lambda self: self[0])
    minor = property(lambda self: self[1])

    def to_int(self) -> int:
        return self[0] * 10 + self[1]


class TuringPlatform:
    """vLLM's current_platform as a T4 answers it: the capability questions a tile decision may ask."""

    def __init__(self, major: int = 7, minor: int = 5):
        self.cap = _Capability((major, minor))

    def get_device_capability(self, device_id: int = 0) -> _Capability:
        return self.cap

    def has_device_capability(self, c: Any, device_id: int = 0) -> bool:
        return self.cap.to_int() >= (c if isinstance(c, int) else c[0] * 10 + c[1])

    def is_device_capability(self, c: Any, device_id: int = 0) -> bool:
        return self.cap.to_int() == (c if isinstance(c, int) else c[0] * 10 + c[1])

    def is_device_capability_family(self, c: int, device_id: int = 0) -> bool:
        return self.cap.to_int() // 10 == c // 10

    def is_cuda(self) -> bool:
        return True

    def __getattr__(self, name: str) -> Any:  # is_rocm, is_xpu, ...: not this device
        return lambda *a, **k: False


def _turing_torch(shared: int) -> Any:
    props = SimpleNamespace(major=7, minor=5, name="Tesla T4", shared_memory_per_block=49152,
                            shared_memory_per_block_optin=shared, shared_memory_per_multiprocessor=shared)
    cuda = SimpleNamespace(get_device_properties=lambda *a, **k: props, get_device_capability=lambda *a, **k: (7, 5),
                           current_device=lambda: 0, is_available=lambda: True)
    return SimpleNamespace(cuda=cuda)


def _needed_functions(tree: ast.Module, name: str) -> list[ast.FunctionDef]:
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    order, todo = [], [name]
    while todo:
        fn = funcs.get(todo.pop())
        if fn is None or fn in order:
            continue
        order.append(fn)
        todo += [c.func.id for c in ast.walk(fn) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)]
    return order


def decided_tiles(text: str, decision: str, head_size: int, element_size: int, shared: int) -> list[int]:
    """What `decision` returns on a stand-in Turing device (prefill and decode); raises whatever it raises."""
    tree = ast.parse(text)
    module = ast.Module(body=[ast.FunctionDef(**{**vars(f), "decorator_list": []})  # type: ignore[arg-type]
                              for f in reversed(_needed_functions(tree, decision))], type_ignores=[])
    logger = SimpleNamespace(**{k: (lambda *a, **kw: None) for k in ("info", "info_once", "warning", "warning_once",
                                                                      "debug")})
    scope: dict[str, Any] = {"current_platform": TuringPlatform(), "torch": _turing_torch(shared), "logger": logger}
    exec(compile(ast.fix_missing_locations(module), "<tile decision>", "exec"), scope)
    fn = scope[decision]
    tiles = []
    for prefill in (True, False):
        args: dict[str, Any] = {}
        for p in inspect.signature(fn).parameters.values():
            low = p.name.lower()
            args[p.name] = (head_size if "head" in low else element_size if "elem" in low else prefill
                            if "prefill" in low else 0 if "window" in low else 16 if "block" in low
                            else p.default if p.default is not p.empty else None)
        tiles.append(int(fn(**args)))
    return tiles


# ----------------------------------------------------------------------------------------------------------------
# ... in a child process of its own, bounded

DECISION_TIMEOUT_S = 30.0  # the decision is a few comparisons; the child's start is most of this
_ANSWER = "gemma4-t4-tiles "  # prefixes the child's answer line: the file's own code may print too


class DecisionNotRun(ToolFailure):
    """The decision could not be run to an answer (it raised, exited, or ran past the timeout): one line."""


def decided_tiles_bounded(text: str, decision: str, head_size: int, element_size: int, shared: int,
                          timeout_s: float | None = None) -> list[int]:
    """decided_tiles in a child process ended after `timeout_s`; DecisionNotRun says in one line why there is no
    answer (what the decision raised, the status it exited with, or the timeout)."""
    limit = DECISION_TIMEOUT_S if timeout_s is None else timeout_s
    question = json.dumps({"text": text, "decision": decision, "head_size": head_size,
                           "element_size": element_size, "shared": shared})
    try:
        proc = subprocess.Popen([sys.executable, "-m", "tools.serving.turing.decision"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                env=python_child_env(PROJECT_ROOT), start_new_session=True)
    except OSError as exc:
        raise DecisionNotRun(f"its child process could not start ({exc.strerror or exc})") from None
    try:
        out, _ = proc.communicate(question, timeout=limit)
    except subprocess.TimeoutExpired:
        kill_group(proc, grace_s=1)
        raise DecisionNotRun(f"{decision} did not return within {limit:g} s") from None
    except BaseException:
        kill_group(proc, grace_s=1)
        raise
    answers = [ln[len(_ANSWER):] for ln in out.splitlines() if ln.startswith(_ANSWER)]
    try:
        answer = json.loads(answers[-1]) if answers else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("error"), str):
        raise DecisionNotRun(f"{decision} {answer['error']}")
    if (not isinstance(answer, dict) or not isinstance(answer.get("tiles"), list)
            or not all(type(t) is int for t in answer["tiles"])):
        raise DecisionNotRun(f"{decision} ended its process (exit status {proc.returncode}) without an answer")
    return answer["tiles"]


def _child() -> int:
    """The child's side: the question from stdin, one answer line on the real stdout whatever the code does."""
    answer_to = os.fdopen(os.dup(1), "w")
    sys.stdout = sys.stderr  # the file's own prints must not look like an answer
    try:
        q = json.loads(sys.stdin.read())
        answer: dict[str, Any] = {"tiles": decided_tiles(q["text"], q["decision"], q["head_size"],
                                                         q["element_size"], q["shared"])}
    except SystemExit as exc:
        answer = {"error": f"called exit({exc.code!r})"}
    except BaseException as exc:  # noqa: BLE001 - whatever foreign code raises is the answer
        why = " ".join(str(exc).split())[:200]
        answer = {"error": f"raised {type(exc).__name__}" + (f": {why}" if why else "")}
    answer_to.write(_ANSWER + json.dumps(answer) + "\n")
    answer_to.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(_child())
