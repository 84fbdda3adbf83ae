"""`--on-nonfinite`: hidden states holding NaN/inf never reach a cache silently.

A target with an inf weight (or a bf16 overflow) yields NaN/inf states that encode and checksum like any
others. The GPU stage flags them before encoding (`nonfinite_flags`: a [K, tokens] flag from one
reduction); the drain then fails the run naming the row and layers (`NonFiniteStates`), or skips the
row: the writer records it in its shard's index (`meta.skipped`), from which the final manifest lists
it as skipped (`skipped_in_shard`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from dflash.shards.errors import ShardError


class NonFiniteStates(ShardError):
    """The target produced NaN/inf hidden states for a row (with --on-nonfinite fail)."""


def nonfinite_flags(packed: torch.Tensor) -> torch.Tensor:
    """bool [K, N]: token n of layer k holds a NaN/inf, for [K, N, H] states on their device. A NaN/inf
    anywhere in a token's row makes its fp32 sum non-finite: one reduction, no full-size temporary (only
    finite values summing past 3e38 could flag a token wrongly)."""
    return ~torch.isfinite(packed.sum(dim=-1, dtype=torch.float32))


def nonfinite_reasons(
    nonfinite: torch.Tensor | None, lengths: Sequence[int] | np.ndarray, layers: list[int]
) -> dict[int, str]:
    """{index in the batch: why} for the rows whose hidden states hold NaN/inf, from the host copy of
    `nonfinite_flags` of rows of `lengths` back to back."""
    if nonfinite is None:
        return {}
    flags = nonfinite.numpy()
    if not flags.any():
        return {}
    lengths = np.asarray(lengths, dtype=np.int64)
    per_row = np.add.reduceat(flags.astype(np.int64), np.cumsum(lengths) - lengths, axis=1)  # [K, B]
    reasons = {}
    for i in np.flatnonzero(per_row.any(axis=0)).tolist():
        parts = [
            f"layer {layers[k]}: {per_row[k, i]} of {lengths[i]} tokens"
            for k in np.flatnonzero(per_row[:, i])
        ]
        reasons[i] = f"non-finite hidden states ({', '.join(parts)})"
    return reasons


def skipped_in_shard(reader: Any) -> list[dict[str, Any]]:
    """The rows a writer recorded as skipped in a committed shard's index (`meta.skipped`), well-formed only."""
    records = reader.meta.get("skipped", [])
    if not isinstance(records, list):
        return []
    return [
        {"row": r["row"], "reason": r["reason"]}
        for r in records
        if isinstance(r, dict) and type(r.get("row")) is int and isinstance(r.get("reason"), str)
    ]
