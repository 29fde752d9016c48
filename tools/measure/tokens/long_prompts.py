"""Long-context prompts for greedy token identity: a needle in a haystack of about 2k, 8k and 14k tokens.

Each prompt states a fact near its start (after about 3% of the text), fills the rest with plain, varied
sentences, and asks for the fact at the end, so the answer depends on attention over the whole context. The
text is deterministic (a seeded generator per target) and sized with the served model's own tokenizer through
the server's /tokenize, counting the chat template, so "2k" means 2k prompt tokens on the model under test.
Targets that do not fit the server's max_model_len together with the generated tokens are left out.
"""

from __future__ import annotations

import random
from typing import Callable

from tools.measure.server_client import ServerClient

DEFAULT_TARGETS: tuple[int, ...] = (2048, 8192, 14336)
NEEDLE_AT = 0.03  # share of the filler sentences before the fact

_SUBJECTS = ("The harbour master", "A young engineer", "The night nurse", "Our neighbour", "The old librarian",
             "A travelling musician", "The school cook", "The ferry captain", "A retired pilot", "The baker")
_VERBS = ("repaired", "painted", "counted", "described", "measured", "carried", "sorted", "cleaned", "sketched",
          "wrapped")
_OBJECTS = ("the wooden chairs", "a box of letters", "the garden fence", "twelve glass jars", "the station clock",
            "a pile of maps", "the blue boat", "three loaves of bread", "the kitchen window", "a set of keys")
_PLACES = ("before breakfast", "in the rain", "near the market", "after the storm", "by the river",
           "on the top floor", "during the holiday", "at the end of the pier", "in the quiet afternoon",
           "behind the church")
_ENDINGS = ("and then went home.", "while humming a song.", "without saying a word.", "as the bells rang.",
            "and wrote it all down.", "with great care.", "for the second time that week.",
            "because nobody else would.", "and smiled at the result.", "before the light faded.")
_CODE_WORDS = ("amber-falcon-seventeen", "copper-willow-forty", "silver-otter-ninety", "granite-heron-twelve")


def _sentences(rng: random.Random, n: int) -> list[str]:
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)} "
            f"{rng.choice(_ENDINGS)}" for _ in range(n)]


def needle_prompt(target: int, n_words: int) -> tuple[str, str]:
    """(prompt, expected answer) with n_words of filler; deterministic in (target, n_words)."""
    rng = random.Random(target)
    answer = _CODE_WORDS[target % len(_CODE_WORDS)]
    words: list[str] = []
    while len(words) < n_words:
        words += " ".join(_sentences(rng, 64)).split()
    words = words[:n_words]
    at = max(1, int(n_words * NEEDLE_AT))
    fact = f"Remember this: the code word for the lighthouse is {answer}."
    body = " ".join(words[:at] + [fact] + words[at:])
    question = "What is the code word for the lighthouse? Answer with the code word only."
    return f"Read the following notes.\n\n{body}\n\n{question}", answer


def build_long_prompts(count_tokens: Callable[[str], int], max_model_len: int, *, max_tokens: int,
                       targets: tuple[int, ...] = DEFAULT_TARGETS) -> list[tuple[str, int]]:
    """(prompt, prompt tokens) per target that fits max_model_len with max_tokens generated, in target order.

    count_tokens(prompt) is the prompt's token count through the chat template. The filler is fitted a word
    at a time to the largest length whose count does not exceed the target (proportional steps, then bisection).
    """
    out: list[tuple[str, int]] = []
    for target in targets:
        if target + max_tokens > max_model_len:
            continue
        cache: dict[int, tuple[str, int]] = {}

        def size(n: int) -> int:
            if n not in cache:
                prompt, _ = needle_prompt(target, n)
                cache[n] = (prompt, count_tokens(prompt))
            return cache[n][1]

        lo, hi = 0, None  # size(lo) <= target < size(hi)
        n = max(1, target // 8)
        for _ in range(6):  # proportional steps land within a few words
            c = size(n)
            if c <= target:
                lo = max(lo, n)
            else:
                hi = n if hi is None else min(hi, n)
            if c == target:
                break
            n = max(1, n + int((target - c) * n / max(c, 1)))
            if hi is not None and n >= hi:
                n = hi - 1
            if n <= lo:
                n = lo + 1
        if hi is None:
            hi = lo + 1
            while size(hi) <= target:
                lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if size(mid) <= target:
                lo = mid
            else:
                hi = mid
        if lo >= 1:
            out.append(cache[lo] if lo in cache else (needle_prompt(target, lo)[0], size(lo)))
    return out


def long_prompts(base_url: str, *, max_tokens: int, targets: tuple[int, ...] = DEFAULT_TARGETS,
                 timeout_s: float = 600.0) -> list[str]:
    """The needle prompts for the server at base_url, sized with its tokenizer and chat template."""
    srv = ServerClient(base_url, timeout_s)
    try:
        def count(prompt: str) -> int:
            return len(srv.tokenize(messages=[{"role": "user", "content": prompt}], add_special_tokens=False))

        limit = srv.max_model_len or max(targets) + max_tokens
        return [p for p, _ in build_long_prompts(count, limit, max_tokens=max_tokens, targets=targets)]
    finally:
        srv.close()
