"""Build schemes, registered by name: ``w4a16`` (the QAT grid recovered exactly, the default) and ``w8a8``
(int8 weights per output channel with dynamic per-token int8 activations).

Every module of this package that defines a scheme registers it with ``@register``; the package imports them
all, so a new scheme is one module (plus its test and its name in repack.choices.SCHEMES, which the parameter
models check without importing numpy) and the build, the command line and the report find it here. The build's
report (report.py) is here too: each scheme fills its own section of it (base.SchemeReport).
"""

from __future__ import annotations

import importlib
import pkgutil

from ..choices import DEFAULT_SCHEME as DEFAULT
from ..choices import SCHEMES
from tools.core.errors import param

from ..errors import RepackError
from .base import REGISTRY, ErrorStats, Output, Scheme, SchemeOptions, SchemeReport, get, names, register


def for_table(name: str, table: str) -> type[Scheme]:
    """The scheme that quantizes `table` in a build of scheme `name` (its own, or the one it delegates to)."""
    s = get(name)
    seen = {s.name}
    while table not in s.tables:
        if s.tables_via is None or s.tables_via in seen:
            raise RepackError(f"{param('scheme')} {name}: no scheme quantizes the {table} table",
                              {"option": "--scheme", "value": name, "table": table, "problem": "no-scheme-for-table"},
                              field="scheme")
        s = get(s.tables_via)
        seen.add(s.name)
    return s


for _m in pkgutil.iter_modules(__path__):
    if _m.name != "base":
        importlib.import_module(f"{__name__}.{_m.name}")
if sorted(REGISTRY) != sorted(SCHEMES):  # the parameter models check names against that list
    raise ImportError(f"repack/schemes registers {sorted(REGISTRY)}, but repack.choices.SCHEMES lists "
                      f"{sorted(SCHEMES)}: add the new scheme's name there")

__all__ = ["DEFAULT", "REGISTRY", "ErrorStats", "Output", "Scheme", "SchemeOptions", "SchemeReport", "for_table", "get",
           "names", "register"]
