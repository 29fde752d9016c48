"""Which model a server serves: what its GET /v1/models lists, read by one function for every caller (the
measurements' clients, provenance, the token comparison), with one pair of failures."""

from __future__ import annotations

from typing import Any

import httpx

from tools.core.errors import ToolFailure, op, param


def listed_models(client: httpx.Client, base_url: str) -> list[dict[str, Any]]:
    """Each model the server at base_url lists (its id, root, max_model_len). httpx errors when it does not
    answer; ValueError when its answer is no model list as an OpenAI-compatible server gives."""
    r = client.get(f"{base_url}/v1/models")
    r.raise_for_status()
    body = r.json()
    data = body.get("data") if isinstance(body, dict) else None
    if (not isinstance(body, dict) or not isinstance(data, (list, type(None)))
            or not all(isinstance(m, dict) for m in data or [])):
        raise ValueError(f"{base_url}/v1/models did not list models as an OpenAI-compatible server does")
    return data or []


def first_listed_model(client: httpx.Client, base_url: str) -> dict[str, Any]:
    """The first model the server lists: one-line ToolFailures when no server answers at base_url (or its answer
    is no model list) and when it lists no model."""
    try:
        data = listed_models(client, base_url)
    except (httpx.HTTPError, ValueError) as exc:
        raise ToolFailure(f"no vLLM server answers at {base_url} ({type(exc).__name__}); start one with "
                          f"{op('start')} or pass {param('base_url')}", field="base_url") from exc
    if not data:
        raise ToolFailure(f"the server at {base_url} lists no model in /v1/models")
    return data[0]


__all__ = ["first_listed_model", "listed_models"]
