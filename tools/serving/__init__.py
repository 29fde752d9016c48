"""The serving room's public face: what code outside tools/serving uses (with tools.serving.config and
tools.serving.ops, which stay public too). An import-linter contract (pyproject.toml) keeps the front ends,
the measurements and the rest to this face; the sub-packages behind it are free to change.

- `Server`: one instance's server, its whole life (start, wait until ready, status, query, log, stop; a
  context manager for a command's own server), and the functions it is made of; which model a server serves
  (`listed_models`, `first_listed_model`: its /v1/models) and whether it answers (`health`).
- the front door and the instances: `service` (start, stop and status of the port clients use), `router`,
  `switch_process`, `fleet_status`, `stop_all`, `SwitchResult`.
- what a start needs first: `run_preflight`, `ensure`, `fetch_checkpoint`, `Hardware`, the swap file, the Turing
  clamp (`turing_patch`), the speculative config's checks.
- the records: the state file (`load_state`), the router's (`recorded_router`, `door_on_port`), the instances'
  placement (`running`, `resolve_instance`, `process_owners`).

Names are loaded on first use (PEP 562): importing the face costs what its user reads, not the whole room
(the MCP server's start-up imports most of it anyway; a command that only checks a config does not).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> (module, attribute); attribute None: the module itself
_FACE: dict[str, tuple[str, str | None]] = {
    # one server's life
    **{n: ("tools.serving.server.server", n) for n in (
        "Server", "start_server", "stop_server", "server_status", "query", "read_log", "log_path",
        "behind_door_state", "stop_each")},
    **{n: ("tools.serving.server.results", n) for n in (
        "QueryResult", "ServerStatus", "StartResult", "StopResult")},
    "health": ("tools.serving.server.health", None),
    **{n: ("tools.serving.server.models", n) for n in ("first_listed_model", "listed_models")},
    "replace_target": ("tools.serving.server.replace", "target"),
    # the front door and the instances
    "service": ("tools.serving.frontdoor.service", None),
    "router": ("tools.serving.frontdoor.router", None),
    "switch_process": ("tools.serving.frontdoor.switch_process", None),
    "SwitchResult": ("tools.serving.frontdoor.door", "SwitchResult"),
    **{n: ("tools.serving.frontdoor.router", n) for n in (
        "RouterStartResult", "RouterStatus", "RouterStopResult", "router_status", "start_router", "stop_router")},
    **{n: ("tools.serving.frontdoor.instances", n) for n in ("fleet_status", "stop_all")},
    # before a start
    **{n: ("tools.serving.preflight.steps", n) for n in (
        "PreflightParams", "PreflightReport", "run_preflight", "ensure")},
    **{n: ("tools.serving.preflight.model_files", n) for n in ("TINY_SOURCE", "make_source", "missing_model_fix")},
    **{n: ("tools.serving.preflight.swap", n) for n in ("ensure_swap", "swap_report")},
    **{n: ("tools.serving.preflight.speculative", n) for n in (
        "parse_speculative_config", "validate_speculative_config")},
    "Hardware": ("tools.serving.preflight.hardware", "Hardware"),
    **{n: ("tools.serving.hub.fetch", n) for n in ("MANIFEST", "FetchParams", "FetchResult", "fetch_checkpoint")},
    "hf_token": ("tools.serving.hub.access", "hf_token"),
    "turing_patch": ("tools.serving.turing.patch", None),
    "PatchStatus": ("tools.serving.turing.patch", "PatchStatus"),
    # the records
    **{n: ("tools.serving.records.state", n) for n in ("Unrecorded", "load_state", "replace_file")},
    "recorded_router": ("tools.serving.records.router_state", "recorded"),
    "load_router": ("tools.serving.records.router_state", "load"),
    "door_on_port": ("tools.serving.records.router_state", "door_on_port"),
    "resolve_instance": ("tools.serving.records.placement", "resolve"),
    **{n: ("tools.serving.records.placement", n) for n in ("running", "process_owners")},
}

if TYPE_CHECKING:  # what the names are, for readers and type checkers; loaded lazily at run time
    from tools.serving.frontdoor import router, service, switch_process
    from tools.serving.frontdoor.door import SwitchResult
    from tools.serving.frontdoor.instances import fleet_status, stop_all
    from tools.serving.frontdoor.router import (RouterStartResult, RouterStatus, RouterStopResult, router_status,
                                                start_router, stop_router)
    from tools.serving.hub.access import hf_token
    from tools.serving.hub.fetch import MANIFEST, FetchParams, FetchResult, fetch_checkpoint
    from tools.serving.preflight.hardware import Hardware
    from tools.serving.preflight.model_files import TINY_SOURCE, make_source, missing_model_fix
    from tools.serving.preflight.speculative import parse_speculative_config, validate_speculative_config
    from tools.serving.preflight.steps import PreflightParams, PreflightReport, ensure, run_preflight
    from tools.serving.preflight.swap import ensure_swap, swap_report
    from tools.serving.records.placement import process_owners, running
    from tools.serving.records.placement import resolve as resolve_instance
    from tools.serving.records.router_state import door_on_port
    from tools.serving.records.router_state import load as load_router
    from tools.serving.records.router_state import recorded as recorded_router
    from tools.serving.records.state import Unrecorded, load_state, replace_file
    from tools.serving.server import health
    from tools.serving.server.replace import target as replace_target
    from tools.serving.server.models import first_listed_model, listed_models
    from tools.serving.server.results import QueryResult, ServerStatus, StartResult, StopResult
    from tools.serving.server.server import (Server, behind_door_state, log_path, query, read_log, server_status,
                                             start_server, stop_each, stop_server)
    from tools.serving.turing import patch as turing_patch
    from tools.serving.turing.patch import PatchStatus


def __getattr__(name: str) -> Any:
    try:
        module, attr = _FACE[name]
    except KeyError:
        raise AttributeError(f"module 'tools.serving' has no attribute {name!r}") from None
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_FACE])


__all__ = sorted(_FACE)
