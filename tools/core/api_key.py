"""The vLLM server's API key: read from the environment (VLLM_API_KEY, the variable vLLM itself reads), never
written to a state file, a log or evidence; sent by every tool that calls the server.

A server on a non-loopback HOST is refused without it (tools.serving.server.launch); vLLM gets it through its
environment rather than `--api-key`, which would put it in the command line the state file records, in `ps` and
in vLLM's log of its arguments.
"""

from __future__ import annotations

import ipaddress
import os

API_KEY_ENV = "VLLM_API_KEY"
# What vllm bench serve and lm-eval's local-completions read for their Authorization header.
CLIENT_KEY_ENV = "OPENAI_API_KEY"


def api_key() -> str | None:
    key = os.environ.get(API_KEY_ENV, "").strip()
    return key or None


def auth_headers() -> dict[str, str]:
    """The Authorization header of a request to the server; none when no key is set."""
    key = api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def with_client_key(env: dict[str, str]) -> dict[str, str]:
    """`env` of a child that calls the server (vllm bench serve, lm-eval) with the key where those read it."""
    key = api_key()
    return {**env, CLIENT_KEY_ENV: key} if key else env


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost: reachable from this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


__all__ = ["API_KEY_ENV", "CLIENT_KEY_ENV", "api_key", "auth_headers", "is_loopback", "with_client_key"]
