"""The sweep worker's patches of vLLM's benchmark (`_Bench` in tools/measure/sweep/worker.py), checked against the
installed vLLM without a server.

The worker replaces attributes of `vllm.benchmarks.serve` (the tokenizer loader, the /metrics fetchers) and then
calls `serve.main`. That works only while the code main runs looks those names up in the module's globals at call
time. A vLLM that imports the loader inside a function, moves `benchmark()` to another module, or drops or renames
a fetcher would keep calling its own functions and the sweep would go on quietly: a tokenizer load per call and
four /metrics reads per repeat, counted in the measured time. The check reads the bytecode of every function of the
module that serve.main reaches through its globals.
"""

from __future__ import annotations

import dis
import inspect
import textwrap
import types

_PATCHED = {"get_tokenizer", "fetch_spec_decode_metrics", "fetch_diffusion_metrics"}


def _codes(code: types.CodeType):
    """The code object and those nested in it (inner functions, comprehensions, lambdas)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _global_loads(module: types.ModuleType, start: str) -> dict[str, set[str]]:
    """{name: the module's functions that load it as a global} over every function that `start` reaches through
    global names, counting only functions whose globals are the module's own (they see a replaced attribute)."""
    loads: dict[str, set[str]] = {}
    seen: set[str] = set()
    todo = [start]
    while todo:
        fn_name = todo.pop()
        if fn_name in seen:
            continue
        seen.add(fn_name)
        fn = inspect.unwrap(vars(module)[fn_name])
        for code in _codes(fn.__code__):
            for ins in dis.get_instructions(code):
                if ins.opname != "LOAD_GLOBAL":
                    continue
                loads.setdefault(ins.argval, set()).add(fn_name)
                target = vars(module).get(ins.argval)
                if inspect.isfunction(target) and inspect.unwrap(target).__globals__ is vars(module):
                    todo.append(ins.argval)
    return loads


def test_the_worker_replaces_names_that_vllm_serve_main_looks_up_as_module_globals():
    import vllm.benchmarks.serve as serve

    from tools.measure.sweep.worker import _Bench

    before = dict(vars(serve))
    try:
        _Bench()
        patched = {name for name, value in vars(serve).items() if before.get(name) is not value}
    finally:
        vars(serve).update(before)  # the module is shared with the rest of the session
    assert patched == _PATCHED  # what the worker replaces; a new patch needs this check too
    assert all(inspect.isfunction(before.get(name)) for name in patched), \
        f"vllm.benchmarks.serve lacks {sorted(n for n in patched if not inspect.isfunction(before.get(n)))}"
    loads = _global_loads(serve, "main")
    missing = sorted(name for name in patched if name not in loads)
    assert not missing, (f"vllm.benchmarks.serve.main no longer reaches {missing} through the module's globals: "
                         f"the worker's replacements would not be called")
    assert "main_async" in loads["get_tokenizer"]
    assert "benchmark" in loads["fetch_spec_decode_metrics"] and "benchmark" in loads["fetch_diffusion_metrics"]


def test_a_name_imported_inside_a_function_or_read_from_another_module_is_not_counted():
    """The bytecode walk itself: only lookups in the module's own globals count."""
    other = types.ModuleType("other")
    exec("def fetch():\n    return 'other'\ndef far():\n    return fetch()\n", vars(other))
    mod = types.ModuleType("mod")
    vars(mod)["far"] = other.far
    exec(textwrap.dedent("""
        def fetch():
            return 1
        def get_tokenizer():
            return 2
        def main():
            from os import getcwd as get_tokenizer
            return [helper(x) for x in far()], get_tokenizer
        def helper(x):
            return (lambda: fetch())()
    """), vars(mod))
    loads = _global_loads(mod, "main")
    assert loads["fetch"] == {"helper"}  # through a comprehension and a lambda, in the module's own function
    assert "get_tokenizer" not in loads  # imported inside main: a replaced attribute would not reach it
    assert loads["far"] == {"main"} and "far" not in {f for fs in loads.values() for f in fs}  # not walked into
