"""A vLLM server's own endpoints as the measurements use them: the served model, /tokenize, /detokenize and
prompt logprobs, each failure one line. Fidelity scores corpora through it; the long prompts are sized with it."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx

from tools.core.api_key import auth_headers
from tools.core.errors import BadInput, ToolFailure, param
from tools.serving import first_listed_model
from tools.serving.config import load_config

# Fixed text whose tokenization fingerprints a tokenizer: ASCII, digits, punctuation, whitespace runs,
# accented and non-Latin script, an emoji.
TOKENIZER_PROBE = ("The quick brown fox jumps over the lazy dog. 0123456789 +-*/=<>()[]{} \"'`~!?@#$%^&_|\\\n"
                   "\t  tabs  and   spaces\r\nÀéîõü ßæøå Ωμέγα Привет 你好世界 こんにちは 🙂")
LOGPROB_DIGITS = 7  # decimals kept in REF.json: float32 logits carry no more


class ServerClient:
    """The few vLLM endpoints the measurements use (the served model, /tokenize, /detokenize, prompt logprobs),
    with one-line failures."""

    def __init__(self, base_url: str | None, timeout_s: float) -> None:
        self.base = (base_url or load_config().base_url).rstrip("/")
        self.client = httpx.Client(timeout=timeout_s, headers=auth_headers())
        try:
            first = first_listed_model(self.client, self.base)
        except ToolFailure:
            self.client.close()
            raise
        self.model: str = first["id"]
        self.root: str | None = first.get("root")
        self.max_model_len: int | None = first.get("max_model_len")

    def close(self) -> None:
        self.client.close()

    def tokenize(self, text: str | None = None, *, messages: list[dict] | None = None,
                 add_special_tokens: bool = False) -> list[int]:
        body: dict[str, Any] = {"model": self.model, "add_special_tokens": add_special_tokens}
        if messages is not None:
            body |= {"messages": messages, "add_generation_prompt": True}
        else:
            body["prompt"] = text
        try:
            r = self.client.post(f"{self.base}/tokenize", json=body)
        except httpx.HTTPError as exc:
            raise ToolFailure(f"{self.base}/tokenize failed ({type(exc).__name__}: {exc})") from exc
        if r.status_code == 404:
            raise BadInput(f"{self.base} has no /tokenize endpoint: fidelity needs a vLLM server, whose tokenizer "
                           f"it uses")
        if r.status_code != 200:
            raise ToolFailure(f"{self.base}/tokenize answered {r.status_code}: {r.text[:200]}")
        return [int(t) for t in r.json()["tokens"]]

    def detokenize(self, ids: list[int]) -> str | None:
        try:
            r = self.client.post(f"{self.base}/detokenize", json={"model": self.model, "tokens": ids})
            return r.json().get("prompt") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    def prompt_logprobs(self, ids: list[int], top_k: int, first: int
                        ) -> tuple[list[tuple[int, float]], list[dict[int, float]]]:
        """Per position first..len(ids)-1: (actual token, its logprob) and the top-k dict."""
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k}
        try:
            r = self.client.post(f"{self.base}/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise ToolFailure(f"{self.base}/v1/completions failed ({type(exc).__name__}: {exc})") from exc
        if r.status_code != 200:
            msg = r.text[:300]
            if "logprob" in msg.lower():
                raise BadInput(f"{self.base} refused prompt_logprobs={top_k} ({' '.join(msg.split())}); serve with "
                               f"--max-logprobs {top_k} or more, or record with a smaller {param('top_k')}", field="top_k")
            raise ToolFailure(f"{self.base}/v1/completions answered {r.status_code}: {msg}")
        choice = (r.json().get("choices") or [{}])[0]
        plp = choice.get("prompt_logprobs")
        if not isinstance(plp, list) or len(plp) != len(ids):
            raise BadInput(f"{self.base} returned no prompt_logprobs for a {len(ids)}-token prompt: fidelity needs "
                           f"a vLLM server with prompt_logprobs support")
        actual: list[tuple[int, float]] = []
        tops: list[dict[int, float]] = []
        for j in range(first, len(ids)):
            entry = plp[j]
            if not isinstance(entry, dict) or str(ids[j]) not in entry:
                raise BadInput(f"{self.base} returned prompt_logprobs without the prompt token at position {j}: "
                               f"it must be vLLM's format (token id -> logprob, rank)")
            top: dict[int, float] = {}
            for tok, info in entry.items():
                if info.get("rank") is not None and int(info["rank"]) <= top_k:
                    top[int(tok)] = round(float(info["logprob"]), LOGPROB_DIGITS)
            # vLLM always lists the actual token; keep the k best if rank ties pushed more in.
            if len(top) > top_k:
                top = dict(sorted(top.items(), key=lambda kv: -kv[1])[:top_k])
            actual.append((ids[j], round(float(entry[str(ids[j])]["logprob"]), LOGPROB_DIGITS)))
            tops.append(top)
        return actual, tops

    def fingerprint(self) -> tuple[str, dict[str, Any]]:
        """sha256 of the probe's tokenizations (plain, special tokens, chat template) and what was hashed."""
        plain = self.tokenize(TOKENIZER_PROBE)
        special = self.tokenize(TOKENIZER_PROBE, add_special_tokens=True)
        try:
            chat: list[int] | None = self.tokenize(messages=[{"role": "user", "content": TOKENIZER_PROBE}])
        except ToolFailure:
            chat = None  # a model without a chat template: hashed as null
        payload = {"plain": plain, "special": special, "chat": chat}
        digest = hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()
        return digest, {"probe_tokens": len(plain), "max_probe_id": max(plain + special + (chat or []))}
