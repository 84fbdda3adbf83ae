"""Check a whole tokenized dataset, vectorized, before any GPU work.

Fatal (raises `DatasetError`, a `ValueError`, with one line naming the column and the first rows):
null rows or elements, `seq_len` disagreeing with the list lengths, `loss_mask` length differing from
`input_ids`, loss_mask values other than 0/1, token ids outside [0, vocab_size). Missing columns and
wrong types are already refused by `open_dataset`.

Handled and counted (the skip list goes into the cache manifest): empty rows, rows longer than
`max_len` (truncated or skipped per policy), rows with no supervised token (after truncation).
Precedence when several apply: empty, then overlong (skip policy), then no_supervised_tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .dataset import DatasetError, ListChunk, TokenDataset

REASONS = ("empty", "no_supervised_tokens", "overlong")
EMPTY, NO_SUPERVISED, OVERLONG = 0, 1, 2


@dataclass(frozen=True, slots=True)
class DatasetReport:
    """What `validate` found: the rows to extract (dataset order) and the rows skipped, with reasons."""

    num_rows: int
    rows: np.ndarray  # int64 kept row ids, ascending
    lengths: np.ndarray  # int64 kept lengths after truncation to max_len
    supervised: np.ndarray  # int64 supervised tokens of each kept row (after truncation)
    skipped_rows: np.ndarray  # int64 row ids, ascending
    skipped_reasons: np.ndarray  # uint8 codes into REASONS
    truncated: int  # kept rows that were cut to max_len
    max_len: int
    overlong: str

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def supervised_tokens(self) -> int:
        return int(self.supervised.sum())

    @property
    def counts(self) -> dict[str, int]:
        codes = np.bincount(self.skipped_reasons, minlength=len(REASONS))
        return {name: int(codes[i]) for i, name in enumerate(REASONS)}

    def skipped_records(self) -> list[dict]:
        """[{"row": r, "reason": "empty" | "no_supervised_tokens" | "overlong"}] for the cache manifest."""
        return [
            {"row": row, "reason": REASONS[code]}
            for row, code in zip(self.skipped_rows.tolist(), self.skipped_reasons.tolist(), strict=True)
        ]

    def summary(self) -> dict:
        return {
            "rows_total": self.num_rows,
            "rows": len(self.rows),
            "rows_skipped": len(self.skipped_rows),
            "skipped": self.counts,
            "rows_truncated": self.truncated,
            "tokens": self.tokens,
            "supervised_tokens": self.supervised_tokens,
            "max_len": self.max_len,
            "overlong": self.overlong,
        }


def validate(
    ds: TokenDataset, *, vocab_size: int | None, max_len: int, overlong: str = "truncate"
) -> DatasetReport:
    """Check every row of `ds` and decide which rows are extracted (see the module docstring)."""
    if overlong not in ("truncate", "skip"):
        raise ValueError(f"overlong must be 'truncate' or 'skip', got {overlong!r}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    names = ds.columns
    starts = ds.chunk_row_starts
    _check_nulls(ds.input_ids, starts, names.input_ids)
    _check_nulls(ds.loss_mask, starts, names.loss_mask)
    lengths = ds.list_lengths

    if ds.seq_len_column is not None:
        _check_counts(
            names.seq_len,
            ds.seq_len_column,
            lengths,
            lambda says, tokens: f"says {says} but {names.input_ids} has {tokens} tokens",
        )
    mask_lengths = np.concatenate([c.lengths() for c in ds.loss_mask]) if ds.loss_mask else lengths
    _check_counts(
        names.loss_mask,
        mask_lengths,
        lengths,
        lambda values, tokens: f"has {values} values but {names.input_ids} has {tokens}",
    )

    _check_token_ids(ds, vocab_size)

    effective = np.minimum(lengths, max_len)
    supervised = np.zeros(ds.num_rows, np.int64)
    for k, chunk in enumerate(ds.loss_mask):
        lo, hi = int(starts[k]), int(starts[k + 1])
        supervised[lo:hi] = _supervised_per_row(chunk, effective[lo:hi], names.loss_mask, lo)

    reasons = np.full(ds.num_rows, -1, np.int8)
    reasons[supervised == 0] = NO_SUPERVISED
    if overlong == "skip":
        reasons[lengths > max_len] = OVERLONG
    reasons[lengths == 0] = EMPTY
    kept = reasons < 0
    rows = np.flatnonzero(kept).astype(np.int64)
    skipped = np.flatnonzero(~kept).astype(np.int64)
    return DatasetReport(
        num_rows=ds.num_rows,
        rows=rows,
        lengths=effective[kept].astype(np.int64),
        supervised=supervised[kept],
        skipped_rows=skipped,
        skipped_reasons=reasons[skipped].astype(np.uint8),
        truncated=int(np.count_nonzero(lengths[kept] > max_len)),
        max_len=max_len,
        overlong=overlong,
    )


# --- checks ---------------------------------------------------------------------------------------


def _fail(column: str, row: int, problem: str, rows: np.ndarray, hint: str = "") -> None:
    """Raise one line: `column 'x': row R <problem> (also rows a, b and N more)<hint>`."""
    others = [int(r) for r in np.unique(rows) if int(r) != row]
    also = ""
    if len(others) == 1:
        also = f" (also row {others[0]})"
    elif len(others) == 2:
        also = f" (also rows {others[0]} and {others[1]})"
    elif len(others) > 2:
        also = f" (also rows {others[0]}, {others[1]} and {len(others) - 2} more)"
    raise DatasetError(f"column {column!r}: row {row} {problem}{also}{hint}")


def _check_counts(
    column: str, counts: np.ndarray, lengths: np.ndarray, problem: Callable[[int, int], str]
) -> None:
    """Fail on the rows where `column`'s per-row count disagrees with the token count; `problem` words the
    first one from (its count, its token count)."""
    bad = np.flatnonzero(counts != lengths)
    if len(bad):
        r = int(bad[0])
        _fail(column, r, problem(int(counts[r]), int(lengths[r])), bad)


def _check_nulls(chunks: list[ListChunk], row_starts: np.ndarray, column: str) -> None:
    for attr, what in (("null_rows", "is null"), ("null_value_rows", "holds a null element")):
        rows = [
            getattr(c, attr) + row_starts[k] for k, c in enumerate(chunks) if getattr(c, attr) is not None
        ]
        if rows:
            bad = np.concatenate(rows)
            _fail(column, int(bad.min()), what, bad, "; drop or fill such rows before extraction")


def _check_token_ids(ds: TokenDataset, vocab_size: int | None) -> None:
    """Range-check every token id: per-chunk min/max (memory-bound), locate rows only on failure."""
    high = vocab_size if vocab_size is not None else None
    bad_rows: list[np.ndarray] = []
    first: tuple[int, int] | None = None
    for k, chunk in enumerate(ds.input_ids):
        o0, o1 = int(chunk.offsets[0]), int(chunk.offsets[-1])
        if o1 == o0:
            continue
        region = chunk.values[o0:o1]
        limit = high
        if limit is None:  # without a vocab only negatives are wrong: limit = 2**(bits-1) for signed types
            limit = int(np.iinfo(region.dtype).max) + 1 if region.dtype.kind == "i" else None
        if limit is None or _unsigned_max(region) < limit:
            continue
        out = region < 0
        if high is not None:
            out |= region >= high
        where = np.flatnonzero(out)
        rows = (
            np.unique(np.searchsorted(chunk.offsets, where + o0, side="right") - 1) + ds.chunk_row_starts[k]
        )
        bad_rows.append(rows)
        if first is None:
            first = (int(rows[0]), int(region[where[0]]))
    if first is not None:
        bound = f"[0, {vocab_size}) (the target's vocab_size)" if vocab_size is not None else "[0, inf)"
        _fail(
            ds.columns.input_ids,
            first[0],
            f"has token id {first[1]} outside {bound}",
            np.concatenate(bad_rows),
            "; was it tokenized for another model?",
        )


def _unsigned_max(values: np.ndarray) -> int:
    """max over the values viewed as unsigned: one memory-bound pass that also catches negatives
    (a negative signed value reads as >= 2**(bits-1), above any vocab size or 0/1 bound)."""
    if values.dtype.kind == "i":
        values = values.view(values.dtype.str.replace("i", "u"))
    return int(values.max())


def _supervised_per_row(chunk: ListChunk, effective: np.ndarray, column: str, row0: int) -> np.ndarray:
    """Supervised tokens among the first `effective[i]` tokens of each row of one chunk."""
    o0, o1 = int(chunk.offsets[0]), int(chunk.offsets[-1])
    region = chunk.dense(o0, o1)
    if len(region) and not chunk.is_bits and _unsigned_max(region) > 1:
        where = np.flatnonzero((region < 0) | (region > 1))
        rows = np.unique(np.searchsorted(chunk.offsets, where + o0, side="right") - 1) + row0
        _fail(
            column, int(rows[0]), f"has value {region[where[0]]}", rows, "; loss_mask values must be 0 or 1"
        )
    seg_starts = chunk.offsets[:-1].astype(np.int64) - o0
    return _segment_sums(region, seg_starts, seg_starts + effective)


def _segment_sums(values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """sum(values[starts[i]:ends[i]]) for every i in one `reduceat` pass (every element read once)."""
    n, size = len(starts), len(values)
    out = np.zeros(n, np.int64)
    if n == 0 or size == 0:
        return out
    bounds = np.empty(2 * n, np.int64)
    bounds[0::2], bounds[1::2] = starts, ends
    # reduceat needs indices < size: a segment ending at `size` is summed to size-1, its last element added back.
    np.minimum(bounds, size - 1, out=bounds)
    sums = np.add.reduceat(values, bounds, dtype=np.int64)[0::2]
    at_end = (ends == size) & (starts < size - 1)
    sums[at_end] += int(values[size - 1])
    nonempty = ends > starts
    out[nonempty] = sums[nonempty]  # reduceat yields values[start] for an empty segment
    return out
