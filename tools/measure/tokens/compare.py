"""Greedy token identity between two builds: exact generated token ids, first divergence, near-tie or not.

Two ways: two live endpoints at once (`compare_live`), or record build A's tokens to a file now
(`record_reference`) and compare build B with it later (`check_against`) — one T4 serves one build at a time.

Every prompt goes through the server's chat template (/v1/chat/completions), temperature 0, `max_tokens` new
tokens, `return_token_ids` for the exact ids (not text), and the top `top_logprobs` alternatives per position
(`return_tokens_as_token_ids`, so alternatives are ids too). At the first position where the ids differ the
contexts are still identical, so the reference's alternatives there say whether the two builds disagreed on a
near-tie (the other side's token within the reference's top-k) or diverged for real.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

import httpx
from pydantic import BaseModel, Field

from tools.core.api_key import auth_headers
from tools.core.atomic_files import write_file
from tools.core.errors import BadInput, ToolFailure, op, param
from tools.core.params import Seconds
from tools.measure.endpoint import EndpointParams, resolve_endpoint, resolve_name
from tools.measure.tokens.long_prompts import long_prompts
from tools.core.output_check import check_output_file
from tools.core.progress import Progress
from tools.core import clock
from tools.serving import first_listed_model
from tools.measure.provenance import config_sha256

RECORD_KIND = "gemma4-t4/token-record"
RECORD_VERSION = 1

# The article's three first, then five more of different shapes (list, code, translation, prose, format).
DEFAULT_PROMPTS: tuple[str, ...] = (
    "What is the capital of France? Answer in one word.",
    "List the first ten prime numbers, comma separated.",
    "What does the HTTP status code 418 mean?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate 'Good morning, how are you today?' into German and French.",
    "Explain in three sentences why the sky is blue.",
    "Give three tips for writing a clear bug report, as a numbered list.",
    "Write a haiku about a graphics card cooling down after a long benchmark.",
)


class TokenCompareParams(EndpointParams):
    """Options of a token comparison; the `./vllm-t4 compare` flags and the compare_tokens MCP arguments are
    derived from these."""

    MCP_EXCLUDE: ClassVar[frozenset[str]] = frozenset({"prompts_file", "timeout_s"})
    MULTILINE: ClassVar[frozenset[str]] = frozenset({"prompts"})

    mode: Literal["record", "check", "live"] = Field(
        "check", description="record: save the build's tokens to reference; check: compare with that; live: "
                             "compare with other_url or other_instance")
    reference: str | None = Field(None, description="Token record file (record: written, check: read)")
    other_url: str | None = Field(None, description="live: the candidate's URL")
    other_instance: str | None = Field(None, description="live: the candidate instance")
    prompts: list[str] | None = Field(None, description="record/live: prompts (default: the article's eight)")
    prompts_file: str | None = Field(None, description="record/live: a JSON list or one prompt per line")
    max_tokens: int = Field(160, ge=1, le=1_000_000, description="Generated tokens per prompt")
    top_logprobs: int = Field(5, ge=0, le=20, description="Alternatives per position (near-tie check)")
    force: bool = Field(False, description="record: replace an existing reference file")
    timeout_s: Seconds = Field(600.0, description="Seconds per request")
    long: bool = Field(False, description="record/live: add the ~2k/8k/14k-token prompts that fit "
                                          "max_model_len")


class Generation(BaseModel):
    prompt: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = Field(None, description="Prompt length in tokens, chat template included")
    top_logprobs: list[dict[int, float]] = Field(default_factory=list,
                                                 description="Per generated position: token id -> logprob")


class TokenRecord(BaseModel):
    kind: str = RECORD_KIND
    version: int = RECORD_VERSION
    created: str
    base_url: str
    model: str | None = None
    model_root: str | None = None
    checkpoint_config_sha256: str | None = None
    max_tokens: int
    top_logprobs: int
    generations: list[Generation]
    path: str | None = Field(None, description="Where the record was written or read")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def summary(self) -> str:
        n = sum(len(g.token_ids) for g in self.generations)
        return f"recorded {len(self.generations)} prompts, {n} tokens from {self.model} at {self.base_url}"


class PromptComparison(BaseModel):
    prompt: str
    same_tokens: bool
    reference_len: int
    candidate_len: int
    prompt_tokens: int | None = Field(None, description="Prompt length in tokens, chat template included")
    first_divergence: int | None = Field(None, description="0-based generated position of the first difference")
    reference_token: int | None = None
    candidate_token: int | None = None
    verdict: Literal["identical", "near-tie", "divergence", "length"] = "identical"
    candidate_in_reference_topk: bool | None = None
    reference_in_candidate_topk: bool | None = None
    logprob_gap: float | None = Field(None, description="Reference's logprob of its token minus of the candidate's "
                                                        "token at the divergence (small: a near-tie)")


class TokenComparison(BaseModel):
    reference: str
    candidate: str
    identical: int
    total: int
    prompts: list[PromptComparison]
    max_tokens: int
    top_logprobs: int

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def summary(self) -> str:
        return f"{self.identical} of {self.total} prompts token-identical"

    def text(self) -> str:
        lines: list[str] = []
        for p in self.prompts:
            lines.append(f"PROMPT: {short_prompt(p.prompt, p.prompt_tokens)}")
            lines.append(f"SAME TOKENS: {p.same_tokens}")
            if not p.same_tokens:
                if p.verdict == "length":
                    lines.append(f"  lengths differ: reference {p.reference_len}, candidate {p.candidate_len} "
                                 f"tokens, identical up to position {p.first_divergence}")
                else:
                    gap = "" if p.logprob_gap is None else f", logprob gap {p.logprob_gap:.3f}"
                    lines.append(f"  first divergence at token {p.first_divergence}: reference {p.reference_token}, "
                                 f"candidate {p.candidate_token} ({p.verdict}{gap})")
        lines.append(f"{self.summary} ({self.reference} vs {self.candidate})")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------


def short_prompt(prompt: str, prompt_tokens: int | None = None) -> str:
    """The prompt for display: long-context prompts shortened to their first and last words."""
    if len(prompt) <= 200:
        return prompt
    flat = " ".join(prompt.split())
    size = f" ({prompt_tokens} prompt tokens)" if prompt_tokens else ""
    return f"{flat[:60]} … {flat[-80:]}{size}"


def _default_base_url(params: Any = None) -> str:
    """The endpoint params choose (base_url, instance or router), else the default instance or tpu.env's port."""
    return resolve_endpoint(params).base_url


def load_prompts(path: str | Path) -> list[str]:
    """A JSON list of strings, or a text file with one prompt per non-empty line."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: prompts file not found; pass a JSON list of strings or one prompt per line")
    text = p.read_text()
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise BadInput(f"{p}: not valid JSON ({exc}); expected a list of prompt strings") from exc
        if not isinstance(data, list) or not all(isinstance(x, str) and x.strip() for x in data) or not data:
            raise BadInput(f"{p}: expected a non-empty JSON list of non-empty prompt strings")
        return list(data)
    prompts = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not prompts:
        raise BadInput(f"{p}: no prompts in the file; write one prompt per line")
    return prompts


def _model_of(client: httpx.Client, base_url: str) -> tuple[str, str | None]:
    first = first_listed_model(client, base_url)
    return first["id"], first.get("root")


def _parse_token(tok: str) -> int:
    # With return_tokens_as_token_ids the token strings are "token_id:<id>".
    if tok.startswith("token_id:"):
        return int(tok.split(":", 1)[1])
    raise ToolFailure(f"the server returned logprob token {tok!r} instead of 'token_id:N'; it must be vLLM "
                      f"(return_tokens_as_token_ids)")


def generate(base_url: str, prompts: list[str], *, max_tokens: int = 160, top_logprobs: int = 5,
             timeout_s: float = 600.0, progress: Progress | None = None) -> TokenRecord:
    """Greedy chat completions for every prompt, with exact token ids and top-k alternatives per position."""
    base = base_url.rstrip("/")
    if max_tokens <= 0:
        raise BadInput(f"max_tokens must be positive, got {max_tokens}")
    if not 0 <= top_logprobs <= 20:
        raise BadInput(f"top_logprobs must be 0..20 (vLLM's default limit), got {top_logprobs}")
    gens: list[Generation] = []
    with httpx.Client(timeout=timeout_s, headers=auth_headers()) as client:
        model, root = _model_of(client, base)
        for i, prompt in enumerate(prompts):
            body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                                    "temperature": 0, "max_tokens": max_tokens, "return_token_ids": True}
            if top_logprobs:
                body |= {"logprobs": True, "top_logprobs": top_logprobs, "return_tokens_as_token_ids": True}
            try:
                r = client.post(f"{base}/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                raise ToolFailure(f"request {i + 1} to {base} failed ({type(exc).__name__}: {exc})") from exc
            if r.status_code != 200:
                raise ToolFailure(f"{base}/v1/chat/completions answered {r.status_code} for prompt {i + 1}: "
                                  f"{r.text[:200]}")
            data = r.json()
            choice = data["choices"][0]
            ids = choice.get("token_ids")
            if ids is None:
                raise ToolFailure(f"{base} returned no token_ids: it must be a vLLM server that supports "
                                  f"return_token_ids")
            tops: list[dict[int, float]] = []
            for pos in ((choice.get("logprobs") or {}).get("content") or []):
                tops.append({_parse_token(t["token"]): float(t["logprob"]) for t in pos.get("top_logprobs", [])})
            gens.append(Generation(prompt=prompt, token_ids=[int(x) for x in ids],
                                   text=choice["message"].get("content") or "",
                                   finish_reason=choice.get("finish_reason"), top_logprobs=tops,
                                   prompt_tokens=(data.get("usage") or {}).get("prompt_tokens")))
            if progress is not None:
                progress(i + 1, len(prompts), f"{base}: prompt {i + 1}/{len(prompts)}, {len(ids)} tokens")
    sha = None
    if root and Path(root).is_dir():
        sha = config_sha256(root)
    return TokenRecord(created=clock.iso(), base_url=base, model=model,
                       model_root=root, checkpoint_config_sha256=sha, max_tokens=max_tokens,
                       top_logprobs=top_logprobs, generations=gens)


def save_record(rec: TokenRecord, path: str | Path, *, force: bool = True) -> Path:
    """Writes the record whole (a refusal names the path); force=False: BadInput when `path` exists by then (a
    record started beside this one finished first), nothing overwritten."""
    p = Path(path)
    rec.path = str(p)
    try:
        return write_file(p, json.dumps(rec.to_dict(), indent=1) + "\n", replace=force)
    except FileExistsError:
        raise BadInput(f"{p} appeared while recording; nothing overwritten (pass {param('force', True)} to replace "
                       f"it)", detail={"path": str(p)}, field="force") from None


def load_record(path: str | Path) -> TokenRecord:
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{p}: reference file not found; write one with {op('compare_tokens.record', out=str(p))}")
    try:
        data = json.loads(p.read_text())
    except ValueError as exc:
        raise BadInput(f"{p}: not JSON ({exc}); pass a file written by {op('compare_tokens.record')}") from exc
    if not isinstance(data, dict) or data.get("kind") != RECORD_KIND:
        raise BadInput(f"{p}: not a token record (kind {data.get('kind') if isinstance(data, dict) else None!r});"
                       f" pass a file written by {op('compare_tokens.record')}")
    rec = TokenRecord.model_validate(data)
    rec.path = str(p)
    return rec


def compare_generations(ref: Generation, cand: Generation) -> PromptComparison:
    a, b = ref.token_ids, cand.token_ids
    out = PromptComparison(prompt=ref.prompt, same_tokens=a == b, reference_len=len(a), candidate_len=len(b),
                           prompt_tokens=cand.prompt_tokens or ref.prompt_tokens)
    if a == b:
        return out
    n = min(len(a), len(b))
    pos = next((i for i in range(n) if a[i] != b[i]), n)
    out.first_divergence = pos
    if pos == n:  # one is a prefix of the other: stopped earlier (a different max_tokens or an abort)
        out.verdict = "length"
        return out
    ra, cb = a[pos], b[pos]
    out.reference_token, out.candidate_token = ra, cb
    ref_top = ref.top_logprobs[pos] if pos < len(ref.top_logprobs) else None
    cand_top = cand.top_logprobs[pos] if pos < len(cand.top_logprobs) else None
    if ref_top:
        out.candidate_in_reference_topk = cb in ref_top
        if cb in ref_top and ra in ref_top:
            out.logprob_gap = ref_top[ra] - ref_top[cb]
    if cand_top:
        out.reference_in_candidate_topk = ra in cand_top
    checks = [x for x in (out.candidate_in_reference_topk, out.reference_in_candidate_topk) if x is not None]
    out.verdict = "near-tie" if checks and all(checks) else "divergence"
    return out


def compare_records(ref: TokenRecord, cand: TokenRecord, *, reference_name: str | None = None,
                    candidate_name: str | None = None) -> TokenComparison:
    if [g.prompt for g in ref.generations] != [g.prompt for g in cand.generations]:
        raise BadInput("the two records hold different prompts; compare a build against a reference made "
                       "with the same prompts")
    prompts = [compare_generations(r, c) for r, c in zip(ref.generations, cand.generations)]
    return TokenComparison(reference=reference_name or ref.path or f"{ref.model} at {ref.base_url}",
                           candidate=candidate_name or cand.path or f"{cand.model} at {cand.base_url}",
                           identical=sum(p.same_tokens for p in prompts), total=len(prompts), prompts=prompts,
                           max_tokens=ref.max_tokens, top_logprobs=ref.top_logprobs)


def _prompts(params: TokenCompareParams, base_url: str | None = None) -> list[str]:
    if params.prompts_file:
        prompts = load_prompts(params.prompts_file)
    elif params.prompts:
        if not all(isinstance(p, str) and p.strip() for p in params.prompts):
            raise BadInput("prompts must be non-empty strings")
        prompts = list(params.prompts)
    else:
        prompts = list(DEFAULT_PROMPTS)
    if params.long:
        prompts += long_prompts(base_url or _default_base_url(params), max_tokens=params.max_tokens,
                                timeout_s=params.timeout_s)
    return prompts


def record_reference(out: str | Path, params: TokenCompareParams | None = None, *, progress: Progress | None = None
                     ) -> TokenRecord:
    """Record the reference build's tokens (the server at params.base_url) to `out`."""
    params = params or TokenCompareParams()
    if Path(out).exists() and not params.force:
        raise BadInput(f"{out} exists; pass {param('force', True)} to replace it, or give another file",
                       detail={"path": str(out)}, field="force")
    check_output_file(out)  # a folder, a parent that is a file, read-only or full: before the server is asked
    base = _default_base_url(params)
    rec = generate(base, _prompts(params, base), max_tokens=params.max_tokens, top_logprobs=params.top_logprobs,
                   timeout_s=params.timeout_s, progress=progress)
    save_record(rec, out, force=params.force)
    return rec


def check_against(reference: str | Path, params: TokenCompareParams | None = None, *, progress: Progress | None = None
                  ) -> TokenComparison:
    """Compare the server at params.base_url with a recorded reference (its prompts and max_tokens)."""
    params = params or TokenCompareParams()
    ref = load_record(reference)
    base = _default_base_url(params)
    cand = generate(base, [g.prompt for g in ref.generations], max_tokens=ref.max_tokens,
                    top_logprobs=max(ref.top_logprobs, params.top_logprobs if params.top_logprobs else 0),
                    timeout_s=params.timeout_s, progress=progress)
    return compare_records(ref, cand, reference_name=str(reference), candidate_name=f"{cand.model} at {base}")


def compare_live(url_a: str, url_b: str, params: TokenCompareParams | None = None, *, progress: Progress | None = None
                 ) -> TokenComparison:
    """Both builds live: url_a is the reference, url_b the candidate."""
    params = params or TokenCompareParams()
    prompts = _prompts(params, url_a)
    n = len(prompts)

    def half(offset: int) -> Progress | None:
        if progress is None:
            return None
        return lambda d, t, m: progress(offset + d, 2 * n, m)

    a = generate(url_a, prompts, max_tokens=params.max_tokens, top_logprobs=params.top_logprobs,
                 timeout_s=params.timeout_s, progress=half(0))
    b = generate(url_b, prompts, max_tokens=params.max_tokens, top_logprobs=params.top_logprobs,
                 timeout_s=params.timeout_s, progress=half(n))
    return compare_records(a, b, reference_name=f"{a.model} at {a.base_url}",
                           candidate_name=f"{b.model} at {b.base_url}")


def compare_tokens(params: TokenCompareParams | None = None, *, progress: Progress | None = None,
                   **overrides: Any) -> TokenComparison | TokenRecord:
    """One entry point for the three modes (the MCP tool): record -> TokenRecord, check/live -> TokenComparison."""
    params = TokenCompareParams(**{**(params or TokenCompareParams()).model_dump(), **overrides})
    if params.mode == "record":
        if not params.reference:
            raise BadInput("mode 'record' needs reference: the file to write the tokens to")
        return record_reference(params.reference, params, progress=progress)
    if params.mode == "check":
        if not params.reference:
            raise BadInput("mode 'check' needs reference: a file written by mode 'record'")
        return check_against(params.reference, params, progress=progress)
    if params.mode == "live":
        if bool(params.other_url) == bool(params.other_instance):
            raise BadInput("mode 'live' needs other_url (or other_instance): the second build's endpoint "
                           "(base_url, instance or router is the reference)")

        other = params.other_url or resolve_name(params.other_instance).base_url
        return compare_live(_default_base_url(params), other, params, progress=progress)
    raise BadInput(f"mode {params.mode!r} is not one of record, check, live")
