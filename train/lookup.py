"""Prompt lookup (n-gram copying from the context): the free baseline a trained drafter must beat.

vLLM's `ngram` speculator (and "prompt lookup decoding") drafts without a model: it finds the longest
n-gram (min_n <= n <= max_n) that ends the context and occurred earlier in it, and proposes the k tokens
that followed its EARLIEST earlier occurrence (never past the end of the context). On repetitive greedy
output it accepts many tokens for free, so any learned drafter is only worth its cost above this line.

Public API (pure numpy/Python, no torch):
    lookup_accepted(ids, loss_mask, k, *, min_n=1, max_n=4) -> np.ndarray[S] int64
        A for a draft at every anchor a (context ids[:a+1], checked against ids[a+1:a+1+k] inside the
        response span), -1 where a + 1 is not in the response; feed it to `acceptance.decode_walk`.
"""

from __future__ import annotations

import numpy as np


def lookup_accepted(
    ids: np.ndarray, loss_mask: np.ndarray, k: int, *, min_n: int = 1, max_n: int = 4
) -> np.ndarray:
    """Accepted prefix length of the prompt-lookup draft at every eligible anchor (see the module docstring).

    One left-to-right sweep: for each n, a dict maps an n-gram to the end of its earliest occurrence, queried
    before the n-gram ending at the anchor is inserted, so the match always lies strictly before it.
    """
    if k < 1 or not 1 <= min_n <= max_n:
        raise ValueError(f"need k >= 1 and 1 <= min_n <= max_n, got k={k}, min_n={min_n}, max_n={max_n}")
    tokens = np.asarray(ids).tolist()
    mask = np.asarray(loss_mask).astype(bool)
    s = len(tokens)
    if mask.shape[0] != s:
        raise ValueError(f"ids ({s}) and loss_mask ({mask.shape[0]}) differ in length")
    first_end: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
    accepted = np.full(s, -1, dtype=np.int64)
    for a in range(s):
        match_end = -1
        for n in range(1, min(max_n, a + 1) + 1):
            gram = tuple(tokens[a - n + 1 : a + 1])
            end = first_end[n].get(gram)
            if end is None:
                first_end[n][gram] = a
            elif n >= min_n:
                match_end = end  # a longer n overwrites: the longest matching n-gram wins
        if a + 1 >= s or not (mask[a] and mask[a + 1]):
            continue
        count = 0
        if match_end >= 0:
            # Draft tokens[match_end + 1 : match_end + 1 + k], cut at the context end (index a).
            stop = min(match_end + 1 + k, a + 1)
            for j in range(match_end + 1, stop):
                target = a + 1 + count
                if target >= s or not mask[target] or tokens[j] != tokens[target]:
                    break
                count += 1
        accepted[a] = count
    return accepted
