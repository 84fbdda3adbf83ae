"""Prompt lookup: the vLLM `ngram` rule (longest suffix n-gram, earliest earlier occurrence, no draft past
the context) against a brute-force reading of that rule, and its decode walk on hand-made rows."""

from __future__ import annotations

import numpy as np
import torch
from dflash.train.acceptance import decode_walk
from dflash.train.lookup import lookup_accepted
from hypothesis import given, settings
from hypothesis import strategies as st


def brute_force(tokens: list[int], mask: list[bool], k: int, min_n: int, max_n: int) -> list[int]:
    s = len(tokens)
    out = [-1] * s
    for a in range(s - 1):
        if not (mask[a] and mask[a + 1]):
            continue
        draft: list[int] = []
        for n in range(min(max_n, a + 1), min_n - 1, -1):
            gram = tokens[a - n + 1 : a + 1]
            ends = [e for e in range(n - 1, a) if tokens[e - n + 1 : e + 1] == gram]
            if ends:
                draft = tokens[ends[0] + 1 : min(ends[0] + 1 + k, a + 1)]
                break
        count = 0
        for j, tok in enumerate(draft):
            t = a + 1 + j
            if t >= s or not mask[t] or tok != tokens[t]:
                break
            count += 1
        out[a] = count
    return out


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    data=st.data(),
    k=st.integers(1, 6),
    max_n=st.integers(1, 4),
)
def test_matches_brute_force(tokens: list[int], data: st.DataObject, k: int, max_n: int) -> None:
    mask = data.draw(st.lists(st.booleans(), min_size=len(tokens), max_size=len(tokens)))
    min_n = data.draw(st.integers(1, max_n))
    got = lookup_accepted(np.array(tokens), np.array(mask), k, min_n=min_n, max_n=max_n)
    assert got.tolist() == brute_force(tokens, mask, k, min_n, max_n)


def test_repetition_is_copied_and_the_walk_advances_by_whole_drafts() -> None:
    # prompt "1 2 3 4", response repeats it: from the second token on every draft is right.
    ids = np.array([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4])
    mask = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=bool)
    accepted = lookup_accepted(ids, mask, k=3)
    # anchor 4 (token 1): earliest "1" ends at 0 -> draft 2 3 4, all right
    assert accepted[4] == 3
    # anchor 10: the suffix "4 1 2" first ends at 5 -> draft "3 4", cut at the context end
    assert accepted[10] == 1  # only one response token is left after it
    steps = decode_walk(torch.from_numpy(accepted), torch.from_numpy(mask))
    assert steps == [3, 3]  # anchors 4 -> 8 -> past the end: tau = 4


def test_no_earlier_occurrence_drafts_nothing() -> None:
    ids = np.arange(8)
    mask = np.ones(8, dtype=bool)
    assert lookup_accepted(ids, mask, k=4)[:-1].tolist() == [0] * 7
