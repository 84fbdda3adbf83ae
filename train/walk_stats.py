"""The decode walk's sampling error over the held-out rows (numpy only: the benchmark's report reads it too).

A walk's tau is a ratio, tokens over steps summed over rows, and its steps are not independent: a row that
repeats itself walks far at every step. So the row is the sampled unit. Row r (t_r tokens in n_r steps) moves
log tau by u_r = (t_r - tau * n_r) / T, T = sum of t_r, and the delta method over n rows gives

    SE(tau) = tau * sqrt(n / (n - 1) * sum_r u_r^2)

Two drafters walked over the same rows differ by gap = tau_a / tau_b - 1 with

    SE(gap) = (1 + gap) * sqrt(n / (n - 1) * sum_r (u_a,r - u_b,r)^2)

where the rows' shared difficulty cancels: a paired gap is measured far more tightly than either walk. These
are the held-out rows' part of a comparison's error only; two training runs differ by more (their seeds).

Public API:
    RowWalks = dict[int, tuple[int, int]]      dataset row id -> (tokens, steps) of its walk, tokens = sum(A + 1)
    row_walk(steps) -> (tokens, steps)         one row's totals from its decode-walk steps (A per step)
    walk_se(rows) -> float                     SE of the walk's tau (nan under two rows)
    paired_gap(a, b) -> (gap, se) | None       on the same rows (None when the row sets differ)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

RowWalks = dict[int, tuple[int, int]]


def row_walk(steps: Sequence[int]) -> tuple[int, int]:
    return sum(a + 1 for a in steps), len(steps)


def _influence(rows: Mapping[int, tuple[int, int]], order: Sequence[int]) -> tuple[float, np.ndarray]:
    """(tau, u_r in `order`): each row's first-order effect on log tau."""
    tokens = np.array([rows[r][0] for r in order], dtype=np.float64)
    steps = np.array([rows[r][1] for r in order], dtype=np.float64)
    total = tokens.sum()
    tau = total / steps.sum()
    return tau, (tokens - tau * steps) / total


def walk_se(rows: Mapping[int, tuple[int, int]]) -> float:
    walked = [r for r, (_, steps) in rows.items() if steps > 0]
    if len(walked) < 2:
        return float("nan")
    tau, u = _influence(rows, walked)
    n = len(walked)
    return float(tau * np.sqrt(n / (n - 1) * np.square(u).sum()))


def paired_gap(
    a: Mapping[int, tuple[int, int]], b: Mapping[int, tuple[int, int]]
) -> tuple[float, float] | None:
    # the same rows: the same ids, each walked by both or by neither (a response too short for a step)
    if set(a) != set(b) or any((a[r][1] > 0) != (b[r][1] > 0) for r in a):
        return None
    walked = sorted(r for r in a if a[r][1] > 0)
    if len(walked) < 2:
        return None
    tau_a, u_a = _influence(a, walked)
    tau_b, u_b = _influence(b, walked)
    n = len(walked)
    gap = tau_a / tau_b - 1
    return float(gap), float((1 + gap) * np.sqrt(n / (n - 1) * np.square(u_a - u_b).sum()))
