"""The one probe of a vLLM server (or vllm-router) being up: GET /health answered with 200."""

from __future__ import annotations

import time

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


def wait(base_url: str, timeout_s: float, *, poll_s: float = 0.2) -> bool:
    """Whether `base_url` answers /health within timeout_s, asked every poll_s until it does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answers(base_url):
            return True
        time.sleep(poll_s)
    return False


__all__ = ["answers", "wait"]
