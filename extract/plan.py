"""Length-bucketed batch plans, work units and cache-size estimates: pure numpy, no I/O.

Batches are right-padded rows of similar length, never several sequences packed into one row:
hybrid Qwen targets (Gated DeltaNet) leak state across packed sequences, right padding with an
attention mask is exact for every target.

Determinism: the plan depends only on (row ids, lengths, options): stable sorts, ties broken by row
id. Work units depend only on the plan and the byte options, never on the number of GPUs, so a
resume or a different world size agrees on which rows make up unit i (= shard i).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

# Compression ratios measured by bench/bench_codecs.py on bf16 hidden states (see DESIGN.md):
# byte-plane shuffle + zstd-1 gives 1.41-1.45x; fp8 e4m3 + zstd 2.28-2.34x (plus one fp32 scale per token/layer).
LOSSLESS_RATIO = 1.42
FP8_RATIO = 2.3
FP8_SCALE_BYTES = 4  # one fp32 scale per (token, layer)
# Token frames stored beside the features: int32 ids + one byte of loss mask per token, and a small
# per-sample index entry (offsets, lengths, checksums).
TOKEN_FRAME_BYTES = 5
SAMPLE_OVERHEAD_BYTES = 128


@dataclass(frozen=True, slots=True)
class Batch:
    """Rows of one forward pass: longest first, all padded on the right to `padded_len`."""

    rows: np.ndarray  # int64 row ids
    lengths: np.ndarray  # int64 true (truncated) lengths, same order
    padded_len: int

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def padded_tokens(self) -> int:
        return self.size * self.padded_len


@dataclass(frozen=True, slots=True)
class WorkUnit:
    """Consecutive batches [batch_start, batch_stop) of the plan; one unit becomes one committed shard."""

    index: int
    batch_start: int
    batch_stop: int
    num_rows: int
    tokens: int
    est_bytes: int

    @property
    def num_batches(self) -> int:
        return self.batch_stop - self.batch_start


def plan_batches(
    rows: np.ndarray,
    lengths: np.ndarray,
    *,
    token_budget: int,
    pad_multiple: int = 1,
    max_rows: int | None = None,
) -> list[Batch]:
    """Group rows into right-padded batches of similar length under a padded-token budget.

    Rows are sorted longest first (ties by row id) and cut greedily: each batch takes the longest
    remaining row, pads to its length rounded up to `pad_multiple`, and adds as many following rows as
    keep rows x padded_len <= token_budget (and <= max_rows). A single row longer than the budget
    gets a batch of its own, which then exceeds the budget: pick token_budget >= max_len to avoid it.
    """
    if token_budget < 1 or pad_multiple < 1 or (max_rows is not None and max_rows < 1):
        raise ValueError(
            f"token_budget, pad_multiple, max_rows must be >= 1 (got {token_budget}, {pad_multiple}, {max_rows})"
        )
    rows = np.asarray(rows, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if rows.shape != lengths.shape or rows.ndim != 1:
        raise ValueError(f"rows and lengths must be 1-D of equal size, got {rows.shape} and {lengths.shape}")
    if len(rows) and lengths.min() < 1:
        raise ValueError("every planned row needs length >= 1 (validate() skips empty rows)")
    order = np.lexsort((rows, -lengths))
    rows, lengths = rows[order], lengths[order]
    padded = -(-lengths // pad_multiple) * pad_multiple
    capacity = np.maximum(token_budget // padded, 1)
    if max_rows is not None:
        capacity = np.minimum(capacity, max_rows)
    # Greedy cut points: one Python step per batch, every array op stays vectorized.
    cap_list = capacity.tolist()
    cuts = [0]
    i, n = 0, len(rows)
    while i < n:
        i += cap_list[i]
        cuts.append(min(i, n))
    return [
        Batch(rows=rows[a:b], lengths=lengths[a:b], padded_len=int(padded[a]))
        for a, b in itertools.pairwise(cuts)
    ]


def plan_units(batches: list[Batch], *, bytes_per_token: float, unit_bytes: int = 1 << 30) -> list[WorkUnit]:
    """Group consecutive batches into units of about `unit_bytes` of stored output.

    Batch j goes to unit floor(bytes stored before j / unit_bytes) (renumbered densely), so units are
    within one batch of `unit_bytes` and depend only on the plan and these two numbers.
    """
    if bytes_per_token <= 0 or unit_bytes < 1:
        raise ValueError(f"bytes_per_token and unit_bytes must be > 0, got {bytes_per_token}, {unit_bytes}")
    if not batches:
        return []
    tokens = np.array([b.tokens for b in batches], dtype=np.int64)
    sizes = np.array([b.size for b in batches], dtype=np.int64)
    stored = tokens * bytes_per_token + sizes * SAMPLE_OVERHEAD_BYTES
    before = np.concatenate([[0.0], np.cumsum(stored)[:-1]])
    _, unit_of_batch = np.unique(np.floor(before / unit_bytes).astype(np.int64), return_inverse=True)
    bounds = np.flatnonzero(np.diff(unit_of_batch)) + 1
    starts = np.concatenate([[0], bounds]).tolist()
    stops = [*bounds.tolist(), len(batches)]
    return [
        WorkUnit(
            index=u,
            batch_start=a,
            batch_stop=b,
            num_rows=int(sizes[a:b].sum()),
            tokens=int(tokens[a:b].sum()),
            est_bytes=int(stored[a:b].sum()),
        )
        for u, (a, b) in enumerate(zip(starts, stops, strict=True))
    ]


def plan_stats(batches: list[Batch]) -> dict:
    """Totals of a plan: batches, rows, tokens, padded tokens, padding overhead, largest batch."""
    tokens = sum(b.tokens for b in batches)
    padded = sum(b.padded_tokens for b in batches)
    return {
        "batches": len(batches),
        "planned_rows": sum(b.size for b in batches),
        "padded_tokens": padded,
        "padding_overhead": (padded - tokens) / tokens if tokens else 0.0,
        "max_batch_tokens": max((b.padded_tokens for b in batches), default=0),
        "max_batch_rows": max((b.size for b in batches), default=0),
    }


def bytes_per_token(codec: str, num_layers: int, hidden_size: int) -> float:
    """Estimated stored bytes per token for `codec` ('raw' = uncompressed bf16), token frames included."""
    raw = num_layers * hidden_size * 2
    if codec == "raw":
        features = float(raw)
    elif codec == "lossless":
        features = raw / LOSSLESS_RATIO
    elif codec == "fp8":
        features = raw / FP8_RATIO + num_layers * FP8_SCALE_BYTES
    else:
        raise ValueError(f"unknown codec {codec!r}; choose raw, lossless or fp8")
    return features + TOKEN_FRAME_BYTES


def estimate_cache_bytes(tokens: int, num_rows: int, num_layers: int, hidden_size: int) -> dict[str, int]:
    """Estimated cache size for each codec (raw bf16, lossless, fp8) of `tokens` tokens in `num_rows` rows."""
    return {
        codec: int(
            tokens * bytes_per_token(codec, num_layers, hidden_size) + num_rows * SAMPLE_OVERHEAD_BYTES
        )
        for codec in ("raw", "lossless", "fp8")
    }
