"""Logprob fidelity between two builds: KL divergence, top-1 agreement and perplexity over a text corpus.

`record_logprobs` scores a corpus on the serving build (the reference) and writes REF.json; `check_logprobs`
scores the same tokens on another build and compares, in the manner of llama.cpp's `perplexity
--kl-divergence`, but through vLLM's OpenAI server so that each build runs in the engine and dtype it ships with.

How a corpus is scored. The text is tokenized once by the server's own /tokenize (so this module never loads a
tokenizer), cut into windows of `window` tokens (default 1024, at most max_model_len - 1 with the tokenizer's
BOS in front; only whole windows are scored), and each window is sent as token ids to /v1/completions with
`max_tokens=1` and `prompt_logprobs=top_k` (vLLM's limit is max_logprobs, 20 by default). vLLM returns, per
prompt position, the top-k tokens and the logprob of the token actually there. Every position of a window after
its first token is scored, each under exactly the same context on both builds.

What a check can compute from two top-k lists. vLLM returns each build's own top-k, so a reference token may be
missing from the candidate's list. Per position, over the reference's listed tokens R (its top-k plus the
actual token) and one tail bucket for everything else:

- a token of R that the candidate listed gets the candidate's own probability;
- a token of R that the candidate did not list has, on the candidate, at most the probability of the
  candidate's k-th token (it would otherwise be in its top-k): it gets exactly that upper bound, shrunk so
  that those tokens together never take more than the mass the candidate left unlisted;
- the rest of each side's mass goes to the tail bucket.

`kld` is KL(reference || candidate) over that partition (both sides are proper distributions on it, so it is
>= 0). `kld_lower_bound` merges the missing tokens into the tail instead: by the log-sum inequality it never
exceeds the full-vocabulary KLD. `matched_mass` is the share of the reference's listed probability mass on
tokens the candidate listed too; when it is near 1 the two figures agree and both are close to the full KLD.

REF.json is one JSON object written a window per line, as the windows are scored (only one window's top-k is
ever in memory), to a temporary file renamed into place at the end: an interrupted recording leaves no REF.json.
Its header fingerprints the served model: `tokenizer_sha256` is the sha256 of what the server's /tokenize returns
for a fixed probe (plain, with special tokens, and through the chat template), so two servers hash alike exactly
when they tokenize alike, whatever files the tokenizer came from; plus the vocabulary size and the text model's
shape fields from the checkpoint's config.json when the server's model folder is local. config.json's own hash is
not used: it differs between builds of one model on purpose (quantization settings).
"""

from __future__ import annotations

import heapq
import json
import math
import time
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from repack.family.config import text_of
from tools.core.errors import BadInput, ToolFailure, param
from tools.core.params import Seconds
from tools.measure.uncertainty import FASTER, SLOWER, WITHIN_NOISE, paired_ratio
from tools.measure.fidelity.files import RefWriter, load_corpus, read_reference
from tools.core.output_check import check_output_file
from tools.core.progress import Progress
from tools.core import clock
from tools.measure.server_client import ServerClient
from tools.measure.endpoint import EndpointParams, resolve_endpoint

DEFAULT_WINDOW = 1024
MAX_TOP_K = 20  # vLLM's default max_logprobs
# The config fields that make two checkpoints the same model to a tokenizer and a logit vector.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "global_head_dim", "hidden_size_per_layer_input",
                "vocab_size_per_layer_input", "num_kv_shared_layers", "layer_types")


# ------------------------------------------------------------------------------------------------------------
# Parameters and results (the CLI flags and the MCP tool's arguments are derived from these models)


class RecordLogprobsParams(EndpointParams):
    out: str = Field(description="REF.json to write (refused if it exists, unless force)")
    corpus: str | None = Field(None, description="UTF-8 text file to score (default: the corpus shipped in "
                                                 "tools/measure/data/)")
    max_corpus_tokens: int | None = Field(None, ge=1, description="score at most this many corpus tokens "
                                                                  "(default: the whole corpus)")
    window: int = Field(DEFAULT_WINDOW, ge=8, description="tokens per scored window (default 1024; lowered to "
                                                          "the server's max_model_len - 1 - BOS)")
    top_k: int = Field(MAX_TOP_K, ge=1, le=MAX_TOP_K, description="top tokens kept per position (vLLM allows "
                                                                  "up to max_logprobs, 20 by default)")
    force: bool = Field(False, description="replace an existing out file")
    timeout_s: Seconds = Field(600.0, description="seconds per window request")


class CheckLogprobsParams(EndpointParams):
    reference: str = Field(description="REF.json written by `fidelity record`")
    worst: int = Field(10, ge=0, le=1000, description="how many positions with the largest KLD to list")
    timeout_s: Seconds = Field(600.0, description="seconds per window request")

    CLI_POSITIONAL: ClassVar[tuple[str, ...]] = ("reference",)


class CompareLogprobsParams(EndpointParams):
    """Both modes in one argument set (the MCP tool `compare_logprobs`)."""

    mode: Literal["record", "check"] = Field(description="record: score the serving build into reference; "
                                                         "check: score it against reference")
    reference: str = Field(description="REF.json: written in mode record, read in mode check")
    corpus: str | None = Field(None, description="record: UTF-8 text file (default: the shipped corpus)")
    max_corpus_tokens: int | None = Field(None, ge=1, description="record: at most this many corpus tokens")
    window: int = Field(DEFAULT_WINDOW, ge=8, description="record: tokens per window (default 1024)")
    top_k: int = Field(MAX_TOP_K, ge=1, le=MAX_TOP_K, description="record: top tokens kept per position")
    force: bool = Field(False, description="record: replace an existing reference file")
    worst: int = Field(10, ge=0, le=1000, description="check: positions with the largest KLD to list")


class RecordLogprobsResult(BaseModel):
    path: str = Field(description="the REF.json written")
    model: str = Field(description="served model id of the reference build")
    base_url: str = Field(description="server that was scored")
    tokens: int = Field(description="positions scored (corpus tokens with a logprob)")
    windows: int = Field(description="windows scored")
    window: int = Field(description="tokens per window")
    top_k: int = Field(description="top tokens kept per position")
    corpus: str = Field(description="corpus file")
    corpus_tokens: int = Field(description="tokens in the whole corpus")
    tokenizer_sha256: str = Field(description="fingerprint of the served tokenizer (see the module doc)")
    vocab_size: int | None = Field(description="vocabulary size from the checkpoint's config, if local")
    wall_s: float = Field(description="seconds spent")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def text(self) -> str:
        return (f"recorded {self.tokens} positions ({self.windows} windows of {self.window} tokens, top-{self.top_k})"
                f" from {self.model} at {self.base_url} in {self.wall_s:.0f} s\n{self.path}")


class WorstPosition(BaseModel):
    position: int = Field(description="0-based corpus token index")
    kld: float = Field(description="KL(reference || candidate) at this position, nats")
    token: int = Field(description="the corpus token at this position")
    reference_top1: int = Field(description="reference's most likely token")
    candidate_top1: int = Field(description="candidate's most likely token")
    context: str | None = Field(None, description="the text just before the position (detokenized)")


class CheckLogprobsResult(BaseModel):
    reference: str = Field(description="REF.json compared against")
    reference_model: str = Field(description="served model id when the reference was recorded")
    candidate_model: str = Field(description="served model id of the candidate build")
    base_url: str = Field(description="candidate server")
    tokens: int = Field(description="positions compared")
    windows: int = Field(description="windows compared")
    top_k: int = Field(description="top tokens per position on each side")
    mean_kld: float = Field(description="mean KL(reference || candidate), nats, over the top-k + tail partition")
    median_kld: float = Field(description="median per-position KLD")
    p99_kld: float = Field(description="99th percentile of the per-position KLD")
    max_kld: float = Field(description="largest per-position KLD")
    mean_kld_lower_bound: float = Field(description="mean KLD with unmatched tokens merged into the tail: never "
                                                    "above the full-vocabulary KLD")
    top1_agreement: float = Field(description="share of positions where both builds rank the same token first")
    matched_mass: float = Field(description="share of the reference's listed probability mass on tokens the "
                                            "candidate listed too")
    ppl_reference: float = Field(description="perplexity of the reference build on the corpus")
    ppl_candidate: float = Field(description="perplexity of the candidate build on the corpus")
    ppl_ratio: float = Field(description="ppl_candidate / ppl_reference")
    ppl_ratio_interval: list[float] | None = Field(
        None, description="95% interval of the per-window perplexity ratio's geometric mean (one-sample t over "
                          "windows, tools.measure.uncertainty); none with fewer than two windows")
    ppl_verdict: str | None = Field(None, description="higher, lower or within noise: the candidate's perplexity "
                                                      "against the reference's, from that interval")
    worst_positions: list[WorstPosition] = Field(description="positions with the largest KLD, largest first")
    wall_s: float = Field(description="seconds spent")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def text(self) -> str:
        lines = [
            f"reference: {self.reference_model} ({self.reference})",
            f"candidate: {self.candidate_model} at {self.base_url}",
            f"tokens: {self.tokens} in {self.windows} windows, top-{self.top_k} per position",
            f"mean KLD: {self.mean_kld:.6g}  (lower bound {self.mean_kld_lower_bound:.6g})",
            f"median KLD: {self.median_kld:.6g}  p99 KLD: {self.p99_kld:.6g}  max KLD: {self.max_kld:.6g}",
            f"top-1 agreement: {100 * self.top1_agreement:.3f}%",
            f"reference mass matched: {100 * self.matched_mass:.4f}%",
            f"PPL reference: {self.ppl_reference:.6g}  PPL candidate: {self.ppl_candidate:.6g}  "
            f"ratio: {self.ppl_ratio:.6f}" + (
                f" (95% {self.ppl_ratio_interval[0]:.6f}-{self.ppl_ratio_interval[1]:.6f} over windows) "
                f"{self.ppl_verdict}" if self.ppl_ratio_interval else ""),
        ]
        if self.worst_positions:
            lines.append("largest KLD:")
            for w in self.worst_positions:
                ctx = "" if w.context is None else f"  after {w.context[-40:]!r}"
                lines.append(f"  position {w.position}: KLD {w.kld:.6g}, token {w.token}, top-1 reference "
                             f"{w.reference_top1} / candidate {w.candidate_top1}{ctx}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------
# The metric


class PositionScore(BaseModel):
    kld: float
    kld_lower_bound: float
    matched_mass: float   # reference probability on tokens both sides listed
    listed_mass: float    # reference probability on its listed tokens
    same_top1: bool


def score_position(ref_top: dict[int, float], ref_actual: tuple[int, float], cand_top: dict[int, float],
                   cand_actual: tuple[int, float]) -> PositionScore:
    """KLD of one position from each side's top-k (token -> logprob) and the actual token's logprob.

    See the module doc for the partition. A side's top-k dict holds only its top-k; the actual token is
    added to that side's listed set.
    """
    ref = dict(ref_top)
    ref[ref_actual[0]] = ref_actual[1]
    cand = dict(cand_top)
    cand[cand_actual[0]] = cand_actual[1]
    p = {t: math.exp(lp) for t, lp in ref.items()}
    q_listed = {t: math.exp(lp) for t, lp in cand.items()}
    q_unlisted = max(0.0, 1.0 - sum(q_listed.values()))
    # Any token the candidate did not list is no likelier than its k-th token.
    kth = math.exp(min(cand_top.values())) if cand_top else 0.0
    missing = [t for t in p if t not in q_listed]
    per_missing = min(kth, q_unlisted / len(missing)) if missing else 0.0
    q = {t: q_listed.get(t, per_missing) for t in p}

    def kl(pairs: list[tuple[float, float]]) -> float:
        total = 0.0
        for pi, qi in pairs:
            if pi > 0.0:
                total += pi * (math.log(pi) - math.log(max(qi, 1e-30)))
        return max(total, 0.0)  # a KL of proper distributions: negative only by float rounding

    p_tail = max(0.0, 1.0 - sum(p.values()))
    q_tail = max(0.0, 1.0 - sum(q.values()))
    kld = kl([(p[t], q[t]) for t in p] + [(p_tail, q_tail)])
    both = [t for t in p if t in q_listed]
    p_rest = max(0.0, 1.0 - sum(p[t] for t in both))
    q_rest = max(0.0, 1.0 - sum(q_listed[t] for t in both))
    lower = kl([(p[t], q_listed[t]) for t in both] + [(p_rest, q_rest)])
    top_r = max(ref_top.items(), key=lambda kv: kv[1])[0] if ref_top else ref_actual[0]
    top_c = max(cand_top.items(), key=lambda kv: kv[1])[0] if cand_top else cand_actual[0]
    return PositionScore(kld=kld, kld_lower_bound=min(lower, kld), matched_mass=sum(p[t] for t in both),
                         listed_mass=sum(p.values()), same_top1=top_r == top_c)


# ------------------------------------------------------------------------------------------------------------
# The server


def _endpoint_url(params: EndpointParams) -> str:
    """The server the params choose: base_url, a named instance, the router, else the default instance."""
    return resolve_endpoint(params).base_url


def _endpoint_of(params: EndpointParams) -> dict[str, Any]:
    return {k: getattr(params, k) for k in EndpointParams.model_fields}


def _text_shape(root: str | None) -> dict[str, Any]:
    """The text model's shape fields from a local checkpoint's config.json (empty when not local)."""
    if not root:
        return {}
    cfg_path = Path(root) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return {}
    text = text_of(cfg)
    return {k: text[k] for k in SHAPE_FIELDS if k in text}


# ------------------------------------------------------------------------------------------------------------
# The two operations


def record_logprobs(params: RecordLogprobsParams, progress: Progress | None = None) -> RecordLogprobsResult:
    """Score the corpus on the serving build and write REF.json (streamed, atomically)."""
    t0 = time.monotonic()
    out = Path(params.out)
    if out.exists() and not params.force:
        raise BadInput(f"{out} exists; pass {param('force', True)} to replace it or choose another {param('out')}",
                       field="out")
    if out.is_dir():
        raise BadInput(f"{out} is a folder; {param('out')} takes a file path", field="out")
    check_output_file(out)  # a parent that is a file, read-only or full: before the server is asked
    corpus_path, text, corpus_sha = load_corpus(params.corpus)
    srv = ServerClient(_endpoint_url(params), params.timeout_s)
    writer: RefWriter | None = None
    try:
        digest, probe_info = srv.fingerprint()
        prefix = srv.tokenize("", add_special_tokens=True)  # the BOS the tokenizer puts in front, if any
        ids = srv.tokenize(text)
        corpus_tokens = len(ids)
        if params.max_corpus_tokens:
            ids = ids[: params.max_corpus_tokens]
        window = params.window
        if srv.max_model_len:
            window = min(window, srv.max_model_len - len(prefix) - 1)  # room for the one generated token
        if window < 8:
            raise BadInput(f"{srv.base} serves max_model_len {srv.max_model_len}: too short for a window")
        n_windows = len(ids) // window
        if n_windows == 0:
            cut = f" (after {param('max_corpus_tokens')})" if params.max_corpus_tokens else ""
            raise BadInput(f"corpus {corpus_path}: {len(ids)} tokens{cut}, shorter than one window of {window}; pass "
                           f"a longer {param('corpus')} or a smaller {param('window')}", field="window")
        shape = _text_shape(srv.root)
        first = max(1, len(prefix))  # position 0 has no logprob
        header = {
            "created": clock.iso(), "base_url": srv.base,
            "model": srv.model, "model_root": srv.root, "max_model_len": srv.max_model_len,
            "tokenizer_sha256": digest, "tokenizer_probe": probe_info, "vocab_size": shape.get("vocab_size"),
            "text_shape": shape, "prefix_ids": prefix, "window": window, "top_k": params.top_k,
            "windows": n_windows, "first_scored": first,
            "corpus": {"path": str(corpus_path), "sha256": corpus_sha, "tokens": corpus_tokens,
                       "tokens_used": n_windows * window},
        }
        writer = RefWriter(out, header, force=params.force)
        scored = 0
        for w in range(n_windows):
            chunk = prefix + ids[w * window:(w + 1) * window]
            actual, tops = srv.prompt_logprobs(chunk, params.top_k, first)
            writer.window({"index": w, "start": w * window, "ids": chunk,
                           "actual": [lp for _, lp in actual],
                           "top": [[[t, lp] for t, lp in top.items()] for top in tops]})
            scored += len(actual)
            if progress is not None:
                progress(w + 1, n_windows, f"window {w + 1}/{n_windows} scored ({scored} positions)")
        writer.commit({"windows": n_windows, "tokens": scored, "complete": True})
        writer = None
    finally:
        if writer is not None:
            writer.abort()
        srv.close()
    return RecordLogprobsResult(path=str(out), model=srv.model, base_url=srv.base, tokens=scored,
                                windows=n_windows, window=window, top_k=params.top_k, corpus=str(corpus_path),
                                corpus_tokens=corpus_tokens, tokenizer_sha256=digest,
                                vocab_size=shape.get("vocab_size"), wall_s=round(time.monotonic() - t0, 3))


def _check_same_model(header: dict[str, Any], srv: ServerClient, digest: str, ref_path: str) -> None:
    if header.get("tokenizer_sha256") != digest:
        raise BadInput(f"{ref_path} was recorded with another tokenizer ({header.get('model')}: "
                       f"{str(header.get('tokenizer_sha256'))[:12]}…, {srv.model}: {digest[:12]}…); compare builds of "
                       f"the same model")
    shape = _text_shape(srv.root)
    ref_shape = header.get("text_shape") or {}
    for key in SHAPE_FIELDS:
        if key in shape and key in ref_shape and shape[key] != ref_shape[key]:
            raise BadInput(f"{ref_path} was recorded on a model with {key}={ref_shape[key]}, the server's "
                           f"{srv.model} has {key}={shape[key]}; compare builds of the same model")


def check_logprobs(params: CheckLogprobsParams, progress: Progress | None = None) -> CheckLogprobsResult:
    """Score the reference's windows on the serving build and compare them position by position."""
    import numpy as np

    t0 = time.monotonic()
    header, footer, windows = read_reference(params.reference)
    srv = ServerClient(_endpoint_url(params), params.timeout_s)
    try:
        digest, _ = srv.fingerprint()
        _check_same_model(header, srv, digest, params.reference)
        window, top_k, first = int(header["window"]), int(header["top_k"]), int(header["first_scored"])
        need = window + len(header.get("prefix_ids") or []) + 1
        if srv.max_model_len and srv.max_model_len < need:
            raise BadInput(f"{params.reference} has {window}-token windows; {srv.base} serves max_model_len "
                           f"{srv.max_model_len} < {need}: serve with a larger MAX_MODEL_LEN or record with a "
                           f"smaller {param('window')}")
        n_windows = int(footer.get("windows", header.get("windows", 0)))
        klds: list[float] = []
        lower_sum = matched = listed = 0.0
        same = 0
        nll_ref = nll_cand = 0.0
        per_window: list[tuple[float, float]] = []  # each window's (candidate, reference) perplexity
        worst: list[tuple[float, int, int, int, int, int, list[int]]] = []  # min-heap of the largest KLDs
        for w_i, win in enumerate(windows):
            ids = [int(x) for x in win["ids"]]
            actual_c, tops_c = srv.prompt_logprobs(ids, top_k, first)
            if len(actual_c) != len(win["actual"]):
                raise BadInput(f"{params.reference}: window {w_i} holds {len(win['actual'])} positions, the "
                               f"server scored {len(actual_c)}; the file is damaged, record it again")
            for j, (ref_lp, ref_top, (tok, cand_lp), cand_top) in enumerate(
                    zip(win["actual"], win["top"], actual_c, tops_c)):
                rt = {int(t): float(lp) for t, lp in ref_top}
                s = score_position(rt, (tok, float(ref_lp)), cand_top, (tok, cand_lp))
                klds.append(s.kld)
                lower_sum += s.kld_lower_bound
                matched += s.matched_mass
                listed += s.listed_mass
                same += s.same_top1
                nll_ref -= float(ref_lp)
                nll_cand -= cand_lp
                if params.worst:
                    pos = int(win["start"]) + j + first - len(header.get("prefix_ids") or [])
                    r1 = max(rt.items(), key=lambda kv: kv[1])[0] if rt else tok
                    c1 = max(cand_top.items(), key=lambda kv: kv[1])[0] if cand_top else tok
                    ctx_end = first + j
                    item = (s.kld, pos, tok, r1, c1, len(klds), ids[max(len(header.get("prefix_ids") or []), ctx_end - 24):ctx_end])
                    if len(worst) < params.worst:
                        heapq.heappush(worst, item)
                    elif item[0] > worst[0][0]:
                        heapq.heapreplace(worst, item)
            if actual_c:
                per_window.append((math.exp(-sum(lp for _, lp in actual_c) / len(actual_c)),
                                   math.exp(-sum(float(x) for x in win["actual"]) / len(actual_c))))
            if progress is not None:
                progress(w_i + 1, n_windows, f"window {w_i + 1}/{n_windows} compared ({len(klds)} positions)")
        if not klds:
            raise BadInput(f"{params.reference}: no windows in the file; record it again")
        arr = np.asarray(klds, dtype=np.float64)
        n = len(klds)
        worst_out = [WorstPosition(position=pos, kld=k, token=tok, reference_top1=r1, candidate_top1=c1,
                                   context=srv.detokenize(ctx) if ctx else None)
                     for k, pos, tok, r1, c1, _, ctx in sorted(worst, key=lambda x: -x[0])]
    finally:
        srv.close()
    ppl_r, ppl_c = math.exp(nll_ref / n), math.exp(nll_cand / n)
    spread = paired_ratio(per_window)
    interval = [spread.low, spread.high] if spread.low is not None and spread.high is not None else None
    return CheckLogprobsResult(
        reference=str(params.reference), reference_model=str(header.get("model")), candidate_model=srv.model,
        base_url=srv.base, tokens=n, windows=w_i + 1, top_k=top_k, mean_kld=float(arr.mean()),
        median_kld=float(np.median(arr)), p99_kld=float(np.percentile(arr, 99)), max_kld=float(arr.max()),
        mean_kld_lower_bound=lower_sum / n, top1_agreement=same / n,
        matched_mass=matched / listed if listed else 1.0, ppl_reference=ppl_r, ppl_candidate=ppl_c,
        ppl_ratio=ppl_c / ppl_r, ppl_ratio_interval=interval,
        ppl_verdict=None if interval is None else _PPL_VERDICT[spread.verdict], worst_positions=worst_out, wall_s=round(time.monotonic() - t0, 3))


# The ratio's verdict, said of a perplexity: above 1 the candidate is less sure of the corpus than the reference.
_PPL_VERDICT = {FASTER: "higher", SLOWER: "lower", WITHIN_NOISE: "within noise"}


def compare_logprobs(params: CompareLogprobsParams, progress: Progress | None = None
                     ) -> RecordLogprobsResult | CheckLogprobsResult:
    """Both modes behind one argument set: record writes params.reference, check reads it."""
    if params.mode == "record":
        try:
            return record_logprobs(RecordLogprobsParams(
                out=params.reference, corpus=params.corpus, max_corpus_tokens=params.max_corpus_tokens,
                window=params.window, top_k=params.top_k, force=params.force, **_endpoint_of(params)), progress)
        except ToolFailure as exc:  # record's `out` is this argument set's `reference`: name what the caller gave
            if exc.field != "out" and param("out") not in exc.message:
                raise
            raise type(exc)(exc.message.replace(param("out"), param("reference")), exc.detail,
                            field="reference" if exc.field == "out" else exc.field) from None
    return check_logprobs(CheckLogprobsParams(reference=params.reference, **_endpoint_of(params),
                                              worst=params.worst), progress)
