"""The one probe of a vLLM server (or vllm-router) being up: GET /health answered with 200."""

from __future__ import annotations

import httpx


def answers(base_url: str, *, client: httpx.Client | None = None, timeout: float = 3.0) -> bool:
    """Whether `base_url` answers /health with 200 now; any HTTP failure (refused, timed out) is a no. `client`:
    one the caller polls with (its own timeout)."""
    url = f"{base_url.rstrip('/')}/health"
    try:
        reply = client.get(url) if client is not None else httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return False
    return reply.status_code == 200


__all__ = ["answers"]
