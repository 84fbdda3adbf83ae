"""Offline acceptance-length (tau) estimates on target-regenerated greedy data.

For a block at anchor a the drafter proposes d_1..d_{B-1}; on greedy data the target's tokens are
x_{a+1..a+B-1}, so A = cumprod(d_k == x_{a+k}).sum() over valid slots and tau = A + 1 (the target's
bonus token always counts). Slots past the end of the response (invalid) stop the prefix.

Public API (stable):
    accepted_lengths(preds[N, B-1], labels[N, B-1], valid[N, B-1]) -> LongTensor[N]       A per block
    tau(accepted) -> float                                                                 mean of A + 1
    per_position_acceptance(accepted, block_size) -> Tensor[B-1]    fraction of blocks with A >= k, k = 1..B-1
    decode_walk(accepted_at, loss_mask) -> list[int]
        Simulated greedy decode over each contiguous response span of one sequence: start at the span's
        first token, advance by A + 1; `accepted_at[p]` = A for a block anchored at p (from a pass over
        every eligible anchor: a block depends only on context < a and its anchor token, so precomputing
        all anchors at once gives exactly what a sequential decode would see). Returns A per decode step.
    walk_tau(steps) -> float
"""

from __future__ import annotations

import torch


def accepted_lengths(preds: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Length of the longest prefix of drafted slots that match the labels (invalid slots end the prefix)."""
    if preds.shape != labels.shape or preds.shape != valid.shape:
        raise ValueError(
            f"preds {tuple(preds.shape)}, labels {tuple(labels.shape)} and valid "
            f"{tuple(valid.shape)} must have the same shape"
        )
    match = (preds == labels) & valid.bool()
    return match.long().cumprod(dim=-1).sum(dim=-1)


def tau(accepted: torch.Tensor) -> float:
    """Mean accepted length including the bonus token (nan for no blocks)."""
    if accepted.numel() == 0:
        return float("nan")
    return float((accepted.float() + 1).mean())


def per_position_acceptance(accepted: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B-1]: P(A >= k) for k = 1..B-1, i.e. the chance that drafted slot k is accepted."""
    ks = torch.arange(1, block_size, device=accepted.device)
    if accepted.numel() == 0:
        return torch.full((block_size - 1,), float("nan"))
    return (accepted[:, None] >= ks).float().mean(0)


def decode_walk(accepted_at: torch.Tensor, loss_mask: torch.Tensor) -> list[int]:
    """A per step of a greedy decode walked over every response span (see the module docstring).

    `accepted_at` [S] long: A for the block anchored at each position, -1 where no block was computed.
    A step at anchor a needs a + 1 inside the span; otherwise the span is finished.
    """
    mask = loss_mask.bool().tolist()
    table = accepted_at.tolist()
    s = len(mask)
    steps: list[int] = []
    p = 0
    while p < s:
        if not mask[p]:
            p += 1
            continue
        end = p
        while end < s and mask[end]:
            end += 1
        a = p  # the first response token came from the target's prefill: it is the first anchor
        while a + 1 < end:
            accepted = table[a]
            if accepted < 0:
                raise ValueError(
                    f"no drafter block was computed for anchor position {a}; "
                    "evaluate every eligible anchor before walking"
                )
            accepted = min(accepted, end - a - 1)
            steps.append(accepted)
            a += accepted + 1
        p = end
    return steps


def walk_tau(steps: list[int]) -> float:
    return float("nan") if not steps else sum(a + 1 for a in steps) / len(steps)
