"""The server a measurement talks to, chosen one way everywhere: a URL, a named instance, or the router.

Every measuring operation's parameter model inherits `EndpointParams` (so `--base-url | --instance | --router` and
the MCP arguments come from one place), and calls `resolve_endpoint` to turn them into a base URL, what it is,
and for the router the instances behind it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import httpx
from pydantic import Field

from tools.core.api_key import auth_headers
from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.metrics import total
from tools.core.params import OpParams
from tools.serving import door_on_port, recorded_router, resolve_instance, running
from tools.serving.config import ServeConfig, load_config


class EndpointParams(OpParams):
    """Where to measure: at most one of base_url, instance, router."""

    base_url: str | None = Field(None, description="Server URL (default: the started server)")
    instance: str | None = Field(None, description="A started instance's name")
    router: bool = Field(False, description="Through the router")


@dataclass
class Endpoint:
    base_url: str
    kind: Literal["url", "instance", "router", "config"]  # config: tpu.env's HOST:PORT, nothing recorded there
    name: str | None = None                               # the instance's name
    policy: str | None = None                             # the router's
    backends: list[dict[str, str]] = field(default_factory=list)  # the router's: [{instance, base_url}]
    # the instance's serving config (provenance)
    config: ServeConfig | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("config")
        return d

    def describe(self) -> str:
        if self.kind == "router":
            return f"the router at {self.base_url} over " + ", ".join(b["instance"] for b in self.backends)
        if self.kind == "instance":
            return f"instance {self.name} at {self.base_url}"
        return self.base_url


def resolve_endpoint(params: Any, cfg: ServeConfig | None = None, *, env_file: Any = None,
                     managed: bool = False) -> Endpoint:
    """base_url, instance or router of `params` (an EndpointParams) as an Endpoint.

    None of them: the default instance when it runs, else the front door when FRONT_DOOR=1 and it runs, else
    (managed=False) the config's HOST:PORT and
    (managed=True, the MCP tools) a refusal: the config's port may belong to anything.
    """
    base_url = getattr(params, "base_url", None)
    instance = getattr(params, "instance", None)
    router = bool(getattr(params, "router", False))
    given = [n for n, v in (("base_url", base_url), ("instance", instance), ("router", router)) if v]
    if len(given) > 1:
        raise BadInput(f"{' and '.join(given)} exclude each other: give one endpoint", {"given": given})
    if base_url:
        return Endpoint(base_url=base_url.rstrip("/"), kind="url")
    if cfg is None:
        cfg = load_config(env_file)
    if router:
        st = recorded_router(cfg)
        if st is None:
            raise ToolFailure(f"no router is running; start one with {op('router.start', instances='a,b')}",
                              {"router": True})
        return Endpoint(base_url=st.base_url, kind="router", policy=st.policy,
                        backends=[asdict(b) for b in st.backends], config=cfg)
    if instance:
        st = resolve_instance(cfg, instance)
        return Endpoint(base_url=st.base_url, kind="instance", name=instance,
                        config=replace(cfg, instance=st.instance))
    alive = running(cfg)
    if "default" in alive:
        return Endpoint(base_url=alive["default"].base_url, kind="instance", name="default",
                        config=replace(cfg, instance=""))
    door = door_on_port(cfg)
    if door is not None:  # the port clients use is the front door's
        return Endpoint(base_url=door.base_url, kind="router", policy=door.policy,
                        backends=[asdict(b) for b in door.backends], config=cfg)
    if managed:
        named = ", ".join(alive)
        raise ToolFailure("no vLLM server is running" + (f" as the default instance (running: {named}; pass "
                                                         "instance)" if named else "")
                          + f"; start one with {op('start')} (or pass {param('base_url')})")
    return Endpoint(base_url=cfg.base_url, kind="config", config=cfg)


def request_counts(backends: list[dict[str, str]], *, timeout: float = 5.0) -> dict[str, float | None]:
    """instance -> requests its vLLM has finished (`vllm:request_success_total`, every finish reason summed), for
    the router's `backends` ([{instance, base_url}]); None where /metrics does not answer. Deltas over a run tell
    how the router spread it."""
    out: dict[str, float | None] = {}
    for b in backends:
        try:
            text = httpx.get(f"{b['base_url']}/metrics", timeout=timeout, headers=auth_headers()).text
        except httpx.HTTPError:
            out[b["instance"]] = None
            continue
        value = total(text, "vllm:request_success_total")
        out[b["instance"]] = value if value is not None else 0.0
    return out


def resolve_name(text: str, cfg: ServeConfig | None = None, *, env_file: Any = None) -> Endpoint:
    """A URL (it has '://') or an instance name: `compare live A B`'s endpoints."""
    if "://" in text:
        return Endpoint(base_url=text.rstrip("/"), kind="url")
    return resolve_endpoint(EndpointParams(instance=text), cfg, env_file=env_file)
