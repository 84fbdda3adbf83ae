"""Gather a planned batch into right-padded arrays, straight from the per-chunk numpy views.

One slice copy per row and column plus the padding tails (~4 us/row): no per-row Python objects, no
`Table.take` (which concatenates every chunk of a memory-mapped list column first). Output goes into
caller-provided buffers (numpy arrays or CPU torch tensors, pinned or not) so the extraction can reuse
pinned memory. The extraction gathers ids as int32 (a memcpy from the Arrow values), widened on the device
after the H2D copy, and no attention mask at all: right-padded rows need none (see `extract.target`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .dataset import TokenDataset
from .plan import Batch


@dataclass(frozen=True, slots=True)
class GatheredBatch:
    """[B, T] right-padded views into the buffers given to `gather` (same type: numpy or torch)."""

    rows: np.ndarray  # int64 [B]
    input_ids: Any  # [B, T] the buffer's dtype, pad_id past each row's end
    attention_mask: Any  # [B, T] 1 on tokens, 0 on padding; None when the buffers hold none
    loss_mask: Any  # [B, T] 0/1, 0 on padding
    lengths: Any  # [B] int64


@dataclass(slots=True)
class GatherBuffers:
    """Reusable buffers for batches of up to `capacity` padded tokens (B x T <= capacity).

    `attention_mask=None` skips the mask (callers that build it from `lengths` save ~1 us/row). An int32
    `input_ids` buffer makes each row a memcpy from int32 Arrow values; ids are exact in int32 once
    validated (they are < vocab_size).
    """

    input_ids: Any
    attention_mask: Any | None
    loss_mask: Any
    lengths: Any

    @classmethod
    def numpy(cls, capacity: int, max_rows: int) -> GatherBuffers:
        return cls(
            input_ids=np.empty(capacity, np.int64),
            attention_mask=np.empty(capacity, np.int64),
            loss_mask=np.empty(capacity, np.uint8),
            lengths=np.empty(max_rows, np.int64),
        )

    @classmethod
    def compact(cls, capacity: int, max_rows: int, *, pin_memory: bool = False) -> GatherBuffers:
        """What the extraction gathers into: int32 ids, uint8 loss mask, no attention mask (torch).

        `pin_memory` pins the ids, the one buffer copied to the device; the loss mask and lengths are only
        read on the host."""
        return cls(
            input_ids=torch.empty(capacity, dtype=torch.int32, pin_memory=pin_memory),
            attention_mask=None,
            loss_mask=torch.empty(capacity, dtype=torch.uint8),
            lengths=torch.empty(max_rows, dtype=torch.int64),
        )


def gather(
    ds: TokenDataset,
    batch: Batch,
    buffers: GatherBuffers | None = None,
    *,
    pad_id: int = 0,
) -> GatheredBatch:
    """Fill `buffers` (allocated when None) with the rows of `batch`, truncated to their planned lengths.

    Each buffer must be C-contiguous with at least B*T elements (lengths: B); the results are
    [B, T] views of its first B*T elements.
    """
    B, T = batch.size, batch.padded_len
    if buffers is None:
        buffers = GatherBuffers.numpy(B * T, B)
    ids_out, ids_np = _view(buffers.input_ids, B, T, "input_ids")
    am_out, am_np = (
        _view(buffers.attention_mask, B, T, "attention_mask")
        if buffers.attention_mask is not None
        else (None, None)
    )
    lm_out, lm_np = _view(buffers.loss_mask, B, T, "loss_mask")
    len_out, len_np = _view(buffers.lengths, B, None, "lengths")

    lengths = batch.lengths
    len_np[:] = lengths
    chunk_of_row, ids_start, mask_start = ds.row_locations()
    chunks = chunk_of_row[batch.rows].tolist()
    id_starts = ids_start[batch.rows].tolist()
    mask_starts = mask_start[batch.rows].tolist()
    id_values, mask_values = ds.value_views(lm_np.dtype)
    mask_chunks = ds.loss_mask
    # Flat views: a row is ids[o : o + n], its padding tail ids[o + n : o + T]. Filling only the tails
    # measured faster than full-buffer fills (most of a planned batch is tokens, not padding).
    ids_flat, lm_flat = ids_np.reshape(-1), lm_np.reshape(-1)
    am_flat = am_np.reshape(-1) if am_np is not None else None
    o = 0
    for c, s, m, n in zip(chunks, id_starts, mask_starts, lengths.tolist(), strict=True):
        end, nxt = o + n, o + T
        ids_flat[o:end] = id_values[c][s : s + n]
        mv = mask_values[c]
        lm_flat[o:end] = mv[m : m + n] if mv is not None else mask_chunks[c].dense(m, m + n)
        if n < T:
            ids_flat[end:nxt] = pad_id
            lm_flat[end:nxt] = 0
        if am_flat is not None:
            am_flat[o:end] = 1
            am_flat[end:nxt] = 0
        o = nxt
    return GatheredBatch(
        rows=batch.rows, input_ids=ids_out, attention_mask=am_out, loss_mask=lm_out, lengths=len_out
    )


def _view(buffer: Any, rows: int, cols: int | None, name: str) -> tuple[Any, np.ndarray]:
    """(view of the same type as `buffer`, numpy view sharing its memory), shape [rows, cols] or [rows]."""
    count = rows * (cols or 1)
    shape = (rows, cols) if cols is not None else (rows,)
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous or buffer.size < count:
            raise ValueError(
                f"{name} buffer must be C-contiguous with >= {count} elements, got {buffer.shape}"
            )
        out = buffer.reshape(-1)[:count].reshape(shape)
        return out, out
    # A CPU torch tensor (pinned or not): numpy() shares its memory. as_strided is one torch call (~1 us)
    # where slicing + view costs ~10 us per buffer, a few us/row at ~10 rows per batch; it keeps the
    # buffer's storage, so a pinned allocation stays tracked by the caching host allocator.
    full = buffer.numpy() if buffer.is_cpu else None
    if full is None or not full.flags.c_contiguous or full.size < count:
        raise ValueError(f"{name} buffer must be a contiguous CPU tensor with >= {count} elements")
    out = buffer.as_strided(shape, (cols, 1) if cols is not None else (1,))
    return out, full[:count].reshape(shape)
