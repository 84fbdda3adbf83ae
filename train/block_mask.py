"""FlexAttention's BlockMask for a packed batch, read off the pack's layout instead of evaluated pair by pair.

`create_block_mask` evaluates the mask rule on every (query, key) pair, ~10^8 for one Qwen3-8B step and
~10^9 for a small drafter's 8k-token pack, in a kernel it compiles first (seconds at start-up, again for new
shapes). The pack needs none of that: `make_packed_batch` stores each sequence's context tokens contiguously,
in position order from 0, so the keys a query of block n may see are two intervals of key indices:

    context  [lo_n, hi_n)           lo_n = first context index of the block's sequence, hi_n = lo_n + anchor
    own      [own_n, own_n + B)     own_n = T + n * B (the block's own slots)

(both empty for padding blocks). Per-tile visible-pair counts follow from interval overlaps in
O(N x key tiles), on the batch's device and without a host sync; a tile is "full" when every pair is
visible (no mask_mod call in the kernel) and "partial" when some are. `tests/test_block_mask.py` checks the
result equals `create_block_mask` over `mask.mask_mod_for` (the rule) tile for tile.

Public API:
    KeyIntervals.of(batch) -> KeyIntervals(lo, hi, own)      [N] long tensors
    KeyIntervals.mask_mod() -> mask_mod(b, h, q_idx, kv_idx)  the same rule as `mask.mask_mod_for`, as intervals
    TileLayout.of(batch, tile=None) -> TileLayout             the BlockMask's tensors, wherever the batch is
        .map(fn) / .tensors() / .block_mask() -> BlockMask   moved with its batch (`PackedBatch.tile_layout`)
    layout_block_mask(batch, tile=None) -> BlockMask         the batch's own TileLayout when it has one
    tile_shape(tile) -> (query tile, key tile)               None: DEFAULT_TILE; an int: a square tile
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .blocks import PackedBatch
    from .mask import MaskMod


TensorFn = Callable[[torch.Tensor], torch.Tensor]
Tile = tuple[int, int]  # (query rows, keys) of one BlockMask tile
DEFAULT_TILE: Tile = (128, 128)


def tile_shape(tile: int | Tile | None = None) -> Tile:
    """(query tile, key tile): `DEFAULT_TILE` for None (read at call time), (t, t) for an int t."""
    tile = DEFAULT_TILE if tile is None else tile
    return (tile, tile) if isinstance(tile, int) else (int(tile[0]), int(tile[1]))


@dataclass(frozen=True, slots=True)
class KeyIntervals:
    lo: torch.Tensor  # [N] first visible context key of each block
    hi: torch.Tensor  # [N] one past the last visible context key (lo = hi: none)
    own: torch.Tensor  # [N] first key of the block's own slots (padding blocks: -B, an empty interval)
    block_size: int
    num_keys: int  # T + N * B (T alone for `context_only`)
    num_context: int  # T

    @classmethod
    def of(cls, batch: PackedBatch) -> KeyIntervals:
        n, b, t = batch.num_blocks, batch.block_size, batch.num_context_tokens
        real = batch.block_seq >= 0
        # context_seq is sorted (sequences in pack order), so the insertion point is the sequence's start.
        start = torch.searchsorted(batch.context_seq, batch.block_seq.clamp_min(0))
        zero = torch.zeros_like(start)
        own = t + torch.arange(n, device=start.device) * b
        return cls(
            lo=torch.where(real, start, zero),
            hi=torch.where(real, start + batch.anchor_pos, zero),
            own=torch.where(real, own, zero - b),
            block_size=b,
            num_keys=t + n * b,
            num_context=t,
        )

    def map(self, fn: TensorFn) -> KeyIntervals:
        return KeyIntervals(
            fn(self.lo), fn(self.hi), fn(self.own), self.block_size, self.num_keys, self.num_context
        )

    def context_only(self) -> KeyIntervals:
        """The context intervals alone, over the T context keys (`split_attention.py` attends the slots)."""
        empty = torch.full_like(self.own, -self.block_size)
        return KeyIntervals(self.lo, self.hi, empty, self.block_size, self.num_context, self.num_context)

    def mask_mod(self) -> MaskMod:
        lo, hi, own, b = self.lo, self.hi, self.own, self.block_size

        def mask_mod(
            _b: torch.Tensor, _h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
        ) -> torch.Tensor:
            n = q_idx // b
            sees_context = (kv_idx >= lo[n]) & (kv_idx < hi[n])
            sees_slot = (kv_idx >= own[n]) & (kv_idx < own[n] + b)
            return sees_context | sees_slot

        return mask_mod

    def tile_counts(self, q_tile: int, kv_tile: int) -> torch.Tensor:
        """[query tiles, key tiles] number of visible (query, key) pairs in each tile.

        Context intervals lie in the first T keys, so only those key tiles are swept block by block; a block's
        own B slots fall in a few key tiles (one or two when B <= kv_tile), added where they land. (Sweeping
        every key tile for both intervals took 22-45 ms of a CPU core for a full-size pack, N = 4,775 blocks
        over 660 key tiles: `bench/bench_tiles.py`.)"""
        n, b, device = self.lo.shape[0], self.block_size, self.lo.device
        kv_tiles = -(-self.num_keys // kv_tile)
        q_tiles = -(-n * b // q_tile)
        by_block = q_tile % b == 0  # whole blocks per query tile: sum blocks (weighed by B), not rows
        group, weight = (q_tile // b, b) if by_block else (q_tile, 1)
        lo, hi, own = (x.to(torch.int32) for x in (self.lo, self.hi, self.own))

        def rows(per_block: torch.Tensor) -> torch.Tensor:  # [N, ...] -> [query rows, ...] as grouped
            return per_block if by_block else per_block.repeat_interleave(b, dim=0)

        def overlap(
            lo: torch.Tensor, hi: torch.Tensor, start: torch.Tensor, end: torch.Tensor
        ) -> torch.Tensor:
            return (torch.minimum(hi, end) - torch.maximum(lo, start)).clamp_min(0)

        counts = torch.zeros(q_tiles, kv_tiles, dtype=torch.int32, device=device)
        context_tiles = -(-self.num_context // kv_tile)
        if context_tiles:
            starts = torch.arange(context_tiles, device=device, dtype=torch.int32) * kv_tile
            seen = rows(overlap(lo[:, None], hi[:, None], starts, starts + kv_tile))
            seen = F.pad(seen, (0, 0, 0, q_tiles * group - seen.shape[0]))
            counts[:, :context_tiles] = seen.view(q_tiles, group, context_tiles).sum(dim=1, dtype=torch.int32)
        # own slots [own, own + B): in at most 1 + ceil((B - 1) / kv_tile) key tiles from the first; padding
        # blocks' (own = -B) are empty and add nothing
        first = own.clamp_min(0) // kv_tile
        query_tile = (torch.arange(n * b // weight, device=device) // group).to(torch.int64)
        for step in range(1 + -(-(b - 1) // kv_tile)):
            tile = first + step
            length = overlap(own, own + b, tile * kv_tile, (tile + 1) * kv_tile)
            tile = rows(tile.clamp_max(kv_tiles - 1)).to(torch.int64)  # an empty part may point past the end
            counts.index_put_((query_tile, tile), rows(length), accumulate=True)
        return counts * weight


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (num_blocks [1, 1, Q], indices [1, 1, Q, KV]) of a boolean tile matrix: the chosen tiles
    first, in increasing order (what create_block_mask produces)."""
    # A stable partition, not a sort: each column's slot is its rank among the chosen (or, after them, among
    # the others), and the columns are scattered to their slots (a third of argsort's time on a CPU core).
    chosen = tiles.to(torch.int32)
    before = chosen.cumsum(dim=-1, dtype=torch.int32)
    num = before[..., -1]
    column = torch.arange(1, tiles.shape[-1] + 1, dtype=torch.int32, device=tiles.device)
    slot = torch.where(tiles, before, num[..., None] + column - before) - 1
    indices = torch.empty_like(chosen).scatter_(-1, slot.long(), column.expand_as(chosen) - 1)
    return num[None, None].contiguous(), indices[None, None].contiguous()


@dataclass(frozen=True, slots=True)
class TileLayout:
    """A batch's BlockMask as tensors: its key intervals and, per direction, the (count, indices) pairs of
    its partial and full tiles. A GPU run's loader builds it on the CPU beside the batch and copies it with
    the batch (`PackedBatch.tile_layout`), so the training thread launches none of its ~25 small kernels:
    they took 12% of that thread's time at the full size's 5-layer drafter (BENCHMARKS.md)."""

    intervals: KeyIntervals
    kv: tuple[torch.Tensor, torch.Tensor]  # partial tiles by query tile: ([1, 1, Q], [1, 1, Q, KV])
    full_kv: tuple[torch.Tensor, torch.Tensor]
    q: tuple[torch.Tensor, torch.Tensor]  # the same by key tile, for the backward
    full_q: tuple[torch.Tensor, torch.Tensor]
    num_queries: int
    tile: Tile
    context_only: bool = False  # keys: the T context tokens alone (own slots attended apart)

    @classmethod
    def of(cls, batch: PackedBatch, tile: int | Tile | None = None, context_only: bool = False) -> TileLayout:
        tile = tile_shape(tile)
        intervals = KeyIntervals.of(batch)
        intervals = intervals.context_only() if context_only else intervals
        counts = intervals.tile_counts(*tile)
        full = counts == tile[0] * tile[1]
        partial = (counts > 0) & ~full
        # The backward walks the same tiles per key tile: the transposed matrices, ordered the same way
        # (what BlockMask.from_kv_blocks derives through a dense round trip).
        return cls(
            intervals=intervals,
            kv=_ordered(partial),
            full_kv=_ordered(full),
            q=_ordered(partial.t()),
            full_q=_ordered(full.t()),
            num_queries=batch.num_blocks * batch.block_size,
            tile=tile,
            context_only=context_only,
        )

    def map(self, fn: TensorFn) -> TileLayout:
        """The same layout with `fn` applied to every tensor (`.to(device)`, `.pin_memory()`)."""
        pairs = {name: tuple(fn(t) for t in getattr(self, name)) for name in ("kv", "full_kv", "q", "full_q")}
        return TileLayout(
            intervals=self.intervals.map(fn),
            num_queries=self.num_queries,
            tile=self.tile,
            context_only=self.context_only,
            **pairs,
        )

    def tensors(self) -> list[torch.Tensor]:
        i = self.intervals
        return [i.lo, i.hi, i.own, *self.kv, *self.full_kv, *self.q, *self.full_q]

    def block_mask(self) -> object:
        """FlexAttention's BlockMask (queries: the N*B block slots; keys: T context tokens then the slots, or
        the context tokens alone when `context_only`)."""
        from torch.nn.attention.flex_attention import BlockMask

        return BlockMask(
            (self.num_queries, self.intervals.num_keys),
            *self.kv,
            *self.full_kv,
            *self.q,
            *self.full_q,
            self.tile,
            self.intervals.mask_mod(),
        )


def layout_block_mask(
    batch: PackedBatch, tile: int | Tile | None = None, context_only: bool = False
) -> object:
    """The BlockMask of `batch`: from the layout it carries when that has this tile shape and key range,
    else built here (on the batch's device)."""
    tile = tile_shape(tile)
    layout = batch.tile_layout
    if layout is None or layout.tile != tile or layout.context_only != context_only:
        layout = TileLayout.of(batch, tile, context_only)
    return layout.block_mask()
