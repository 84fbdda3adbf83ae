"""Length-bucketed batch plans, work units and cache-size estimates: pure numpy, no I/O.

Batches are right-padded rows of similar length, never several sequences packed into one row:
hybrid Qwen targets (Gated DeltaNet) leak state across packed sequences; right padding is exact for
every target (all layers are causal, so no real token sees the padding after it; see `extract.target`).

Determinism: the plan depends only on (row ids, lengths, options): stable sorts, ties broken by row
id. Work units depend only on the plan and the byte options, never on the number of GPUs, so a
resume or a different world size agrees on which rows make up unit i (= shard i).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
from dflash.shards.codec_costs import CODEC_COSTS

# Compression ratios measured by bench/bench_codecs.py on bf16 hidden states (shards/codec_costs.py):
# byte-plane shuffle + zstd-1 gives 1.41-1.45x; fp8 e4m3 + zstd 2.28-2.34x (plus one fp32 scale per token/layer).
LOSSLESS_RATIO = CODEC_COSTS["lossless"].ratio
FP8_RATIO = CODEC_COSTS["fp8"].ratio
FP8_SCALE_BYTES = CODEC_COSTS["fp8"].scale_bytes
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


class BatchPlan(Sequence[Batch]):
    """A batch plan held as arrays; `Batch` objects are built on access.

    Materializing ~100k `Batch` objects for a 900k-row dataset costs most of a second, so the plan
    keeps rows/lengths in plan order plus the cut points and hands out batches lazily. Indexing with
    an int gives a `Batch`, with a slice a list of `Batch`.
    """

    def __init__(
        self, rows: np.ndarray, lengths: np.ndarray, cuts: np.ndarray, padded_len: np.ndarray
    ) -> None:
        self.rows = rows  # int64, plan order (longest first, ties by row id)
        self.lengths = lengths  # int64, same order
        self.cuts = cuts  # int64 [num_batches + 1]: batch j is rows[cuts[j]:cuts[j + 1]]
        self.padded_len = padded_len  # int64 [num_batches]

    def __len__(self) -> int:
        return len(self.padded_len)

    @overload
    def __getitem__(self, index: int) -> Batch: ...
    @overload
    def __getitem__(self, index: slice) -> list[Batch]: ...
    def __getitem__(self, index: int | slice) -> Batch | list[Batch]:
        if isinstance(index, slice):
            return [self._batch(j) for j in range(*index.indices(len(self)))]
        j = index + len(self) if index < 0 else index
        if not 0 <= j < len(self):
            raise IndexError(f"batch {index} out of range for a plan of {len(self)} batches")
        return self._batch(j)

    def __iter__(self) -> Iterator[Batch]:
        return (self._batch(j) for j in range(len(self)))

    def _batch(self, j: int) -> Batch:
        a, b = int(self.cuts[j]), int(self.cuts[j + 1])
        return Batch(rows=self.rows[a:b], lengths=self.lengths[a:b], padded_len=int(self.padded_len[j]))

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.cuts)

    @property
    def tokens(self) -> np.ndarray:
        """Real (unpadded) tokens per batch."""
        if len(self) == 0:
            return np.zeros(0, np.int64)
        return np.add.reduceat(self.lengths, self.cuts[:-1])

    @property
    def padded_tokens(self) -> np.ndarray:
        return self.sizes * self.padded_len


def plan_batches(
    rows: np.ndarray,
    lengths: np.ndarray,
    *,
    token_budget: int,
    pad_multiple: int = 1,
    max_rows: int | None = None,
) -> BatchPlan:
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
    cuts = _greedy_cuts(capacity)
    return BatchPlan(rows, lengths, cuts, padded[cuts[:-1]])


def _greedy_cuts(capacity: np.ndarray) -> np.ndarray:
    """Start i, next start i + capacity[i], ...: computed per run of equal capacity, not per batch.

    Capacity is non-decreasing along the plan (rows get shorter), so inside a run of equal capacity c
    the starts are an arithmetic progression; only ~one Python step per distinct capacity remains.
    """
    n = len(capacity)
    if n == 0:
        return np.zeros(1, np.int64)
    run_ends = np.append(np.flatnonzero(np.diff(capacity)) + 1, n)  # exclusive end of each run
    pieces = []
    i = 0
    while i < n:
        run_end = int(run_ends[np.searchsorted(run_ends, i, side="right")])
        c = int(capacity[i])
        starts = np.arange(i, run_end, c, dtype=np.int64)
        pieces.append(starts)
        i = int(starts[-1]) + c
    return np.append(np.concatenate(pieces), n)


def plan_units(
    batches: Sequence[Batch], *, bytes_per_token: float, unit_bytes: int = 1 << 30
) -> list[WorkUnit]:
    """Group consecutive batches into units of about `unit_bytes` of stored output.

    Batch j goes to unit floor(bytes stored before j / unit_bytes) (renumbered densely), so units are
    within one batch of `unit_bytes` and depend only on the plan and these two numbers.
    """
    if bytes_per_token <= 0 or unit_bytes < 1:
        raise ValueError(f"bytes_per_token and unit_bytes must be > 0, got {bytes_per_token}, {unit_bytes}")
    if not batches:
        return []
    tokens, sizes, _ = _batch_arrays(batches)
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


def plan_stats(batches: Sequence[Batch]) -> dict:
    """Totals of a plan: batches, rows, tokens, padded tokens, padding overhead, largest batch."""
    tokens, sizes, padded = _batch_arrays(batches)
    total, total_padded = int(tokens.sum()), int(padded.sum())
    return {
        "batches": len(batches),
        "planned_rows": int(sizes.sum()),
        "padded_tokens": total_padded,
        "padding_overhead": (total_padded - total) / total if total else 0.0,
        "max_batch_tokens": int(padded.max(initial=0)),
        "max_batch_rows": int(sizes.max(initial=0)),
    }


def _batch_arrays(batches: Sequence[Batch]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, rows, padded tokens) per batch; vectorized for a BatchPlan."""
    if isinstance(batches, BatchPlan):
        return batches.tokens, batches.sizes, batches.padded_tokens
    tokens = np.array([b.tokens for b in batches], dtype=np.int64)
    sizes = np.array([b.size for b in batches], dtype=np.int64)
    padded = np.array([b.padded_tokens for b in batches], dtype=np.int64)
    return tokens, sizes, padded


def bytes_per_token(codec: str, num_layers: int, hidden_size: int, dtype: str = "bfloat16") -> float:
    """Estimated stored bytes per token for `codec` ('raw' = uncompressed) on states computed in `dtype`,
    token frames included. fp8/q6/q4 store bf16-derived codes whatever the dtype; lossless keeps it, and
    float32 adds two low mantissa bytes per value that hardly compress (the demo's float32 cache: 34.7 MiB
    stored against 34.8 estimated this way)."""
    raw = num_layers * hidden_size * 2
    if codec == "raw":
        features = float(raw * (2 if dtype == "float32" else 1))
    elif codec in CODEC_COSTS:
        cost = CODEC_COSTS[codec]
        features = raw / cost.ratio + num_layers * cost.scale_bytes
        if codec == "lossless" and dtype == "float32":
            features += raw
    else:
        raise ValueError(f"unknown codec {codec!r}; choose raw or one of {list(CODEC_COSTS)}")
    return features + TOKEN_FRAME_BYTES


def estimate_cache_bytes(
    tokens: int, num_rows: int, num_layers: int, hidden_size: int, dtype: str = "bfloat16"
) -> dict[str, int]:
    """Estimated cache size for each codec (raw states in `dtype`, then every codec) of `tokens` tokens in
    `num_rows` rows."""
    return {
        codec: int(
            tokens * bytes_per_token(codec, num_layers, hidden_size, dtype) + num_rows * SAMPLE_OVERHEAD_BYTES
        )
        for codec in ("raw", *CODEC_COSTS)
    }
