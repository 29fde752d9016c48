"""Whether a server that answers /health serves what clients send: a short greedy completion, then a chat
completion through the build's own chat template. A refusal (any HTTP 4xx/5xx with a body) is final: the start
ends at once with the server's own message and the parameter that fixes it, instead of waiting out its timeout;
only the statuses that mean "not yet" (NOT_YET: 503 while loading, 429, 502, 504) are waited on.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from tools.core.errors import param
from tools.serving.preflight import model_files

# Readiness is a completion of several tokens from a prompt of several tokens: a one-token probe can pass on an
# engine whose traced graphs were specialised on the warm-up's shape and fail every real prompt.
READINESS_PROMPT = "The quick brown fox jumps over the lazy dog."
WARM_UP_MESSAGE = "Say hello."
MAX_TOKENS = 4

# Answers that mean "not yet", not "no": still loading (503), busy (429), a proxy whose upstream is not up yet
# (502, 504). The start keeps waiting on them, up to its timeout.
NOT_YET = frozenset({429, 502, 503, 504})
_CONTEXT = re.compile(r"maximum context length is (\d+) tokens")
_INPUT = re.compile(r"contains (?:at least )?(\d+) input tokens|your request has (\d+) input tokens|"
                    r"(\d+) characters")
# What a refusal's message says -> (the start's parameter that fixes it, how).
_FIXES: list[tuple[re.Pattern, str, str]] = [
    (_CONTEXT, "max_model_len", "raise it"),
    (re.compile(r"max_tokens.*too large|max_completion_tokens", re.IGNORECASE), "max_model_len", "raise it"),
    (re.compile(r"The model `[^`]*` does not exist", re.IGNORECASE), "served_name", "clients ask for this name"),
]


@dataclass
class Refusal:
    """A server's refusal of the readiness or warm-up request."""

    request: str                 # "readiness completion" or "chat warm-up"
    status: int
    message: str                 # the server's own message (from its JSON error, else the body)
    parameter: str | None = None  # the start's parameter that fixes it, where the message says which
    fix: str | None = None       # one line, with param() marks

    def line(self) -> str:
        """The fix first (a long server message may be clipped by a client), then what the server said."""
        text = f"the {self.request} was refused with HTTP {self.status}: {self.message}"
        return f"{self.fix}; {text}" if self.fix else text

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def server_message(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message"}}, {"message"}, {"detail"}), else the body."""
    try:
        data = json.loads(body)
    except ValueError:
        return " ".join(body.split())[:300]
    if isinstance(data, dict):
        err = data.get("error")
        for value in ((err.get("message") if isinstance(err, dict) else err), data.get("message"),
                      data.get("detail")):
            if isinstance(value, str) and value.strip():
                return " ".join(value.split())[:500]
    return " ".join(body.split())[:300]


def refusal(request: str, status: int, body: str) -> Refusal:
    """A refusal with the parameter its message points at (max_model_len for a context limit)."""
    message = server_message(body)
    for pattern, name, how in _FIXES:
        if not pattern.search(message):
            continue
        if name == "max_model_len":
            limit = _CONTEXT.search(message)
            now = f" than {limit.group(1)}" if limit else ""
            fix = f"pass a larger {param('max_model_len')}{now}: a request and its reply must fit in it"
        else:
            fix = f"check {param(name)}: {how}"
        return Refusal(request, status, message, name, fix)
    return Refusal(request, status, message)


def has_chat_template(model: str) -> bool:
    """A local build that ships a chat template (model_files.chat_template: as vLLM reads it)."""
    return model_files.chat_template(Path(model)) is not None


def _post(client: httpx.Client, url: str, body: dict, request: str) -> tuple[dict | None, Refusal | None]:
    """(the JSON answer of a 200, None) / (None, the refusal) / (None, None): no answer yet."""
    try:
        r = client.post(url, json=body, timeout=60.0)
    except httpx.HTTPError:
        return None, None
    if r.status_code >= 400 and r.status_code not in NOT_YET and r.text.strip():
        return None, refusal(request, r.status_code, r.text)
    if r.status_code != 200:
        return None, None
    try:
        data = r.json()
    except ValueError:
        return None, None
    return (data if isinstance(data, dict) else {}), None


def first_completion(client: httpx.Client, base_url: str, served_name: str) -> tuple[str | None, Refusal | None]:
    """(the text of a short greedy completion, None), (None, the refusal), or (None, None) when nothing usable
    answered yet."""
    data, refused = _post(client, f"{base_url}/v1/completions", {
        "model": served_name, "prompt": READINESS_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        "readiness completion")
    if data is None:
        return None, refused
    try:
        text = data["choices"][0]["text"]
    except (KeyError, IndexError, TypeError):
        return None, None
    return (text, None) if isinstance(text, str) else (None, None)


def chat_warm_up(client: httpx.Client, base_url: str, served_name: str) -> tuple[bool, Refusal | None]:
    """A chat completion as clients send it (through the build's chat template): (answered, refusal)."""
    data, refused = _post(client, f"{base_url}/v1/chat/completions", {
        "model": served_name, "messages": [{"role": "user", "content": WARM_UP_MESSAGE}],
        "max_tokens": MAX_TOKENS, "temperature": 0}, "chat warm-up")
    return data is not None, refused


__all__ = ["MAX_TOKENS", "NOT_YET", "READINESS_PROMPT", "Refusal", "chat_warm_up", "first_completion", "has_chat_template",
           "refusal", "server_message"]
