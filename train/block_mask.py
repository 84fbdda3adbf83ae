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
    TileLayout.of(batch, tile=128) -> TileLayout              the BlockMask's tensors, wherever the batch is
        .map(fn) / .tensors() / .block_mask() -> BlockMask   moved with its batch (`PackedBatch.tile_layout`)
    layout_block_mask(batch, tile=128) -> BlockMask          the batch's own TileLayout when it has one
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


@dataclass(frozen=True, slots=True)
class KeyIntervals:
    lo: torch.Tensor  # [N] first visible context key of each block
    hi: torch.Tensor  # [N] one past the last visible context key (lo = hi: none)
    own: torch.Tensor  # [N] first key of the block's own slots (padding blocks: -B, an empty interval)
    block_size: int
    num_keys: int  # T + N * B

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
        )

    def map(self, fn: TensorFn) -> KeyIntervals:
        return KeyIntervals(fn(self.lo), fn(self.hi), fn(self.own), self.block_size, self.num_keys)

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
        """[query tiles, key tiles] number of visible (query, key) pairs in each tile."""
        n, b = self.lo.shape[0], self.block_size
        kv_tiles = -(-self.num_keys // kv_tile)
        starts = torch.arange(kv_tiles, device=self.lo.device) * kv_tile
        ends = starts + kv_tile

        def overlap(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:  # [N] intervals -> [N, kv_tiles]
            return (torch.minimum(hi[:, None], ends) - torch.maximum(lo[:, None], starts)).clamp_min(0)

        per_block = overlap(self.lo, self.hi) + overlap(self.own, self.own + b)  # every slot row the same
        q_tiles = -(-n * b // q_tile)
        if q_tile % b == 0:  # whole blocks per query tile: sum blocks, not rows
            group = q_tile // b
            rows, weight = per_block, b
        else:
            group = q_tile
            rows, weight = per_block.repeat_interleave(b, dim=0), 1
        rows = F.pad(rows, (0, 0, 0, q_tiles * group - rows.shape[0]))
        return rows.view(q_tiles, group, kv_tiles).sum(dim=1) * weight


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (num_blocks [1, 1, Q], indices [1, 1, Q, KV]) of a boolean tile matrix: the chosen tiles
    first, in increasing order (what create_block_mask produces)."""
    dense = tiles.to(torch.int32)
    num = dense.sum(dim=-1, dtype=torch.int32)
    indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
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
    tile: int

    @classmethod
    def of(cls, batch: PackedBatch, tile: int = 128) -> TileLayout:
        intervals = KeyIntervals.of(batch)
        counts = intervals.tile_counts(tile, tile)
        full = counts == tile * tile
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
        )

    def map(self, fn: TensorFn) -> TileLayout:
        """The same layout with `fn` applied to every tensor (`.to(device)`, `.pin_memory()`)."""
        pairs = {name: tuple(fn(t) for t in getattr(self, name)) for name in ("kv", "full_kv", "q", "full_q")}
        return TileLayout(
            intervals=self.intervals.map(fn), num_queries=self.num_queries, tile=self.tile, **pairs
        )

    def tensors(self) -> list[torch.Tensor]:
        i = self.intervals
        return [i.lo, i.hi, i.own, *self.kv, *self.full_kv, *self.q, *self.full_q]

    def block_mask(self) -> object:
        """FlexAttention's BlockMask (queries: the N*B block slots; keys: T context tokens then the slots)."""
        from torch.nn.attention.flex_attention import BlockMask

        return BlockMask(
            (self.num_queries, self.intervals.num_keys),
            *self.kv,
            *self.full_kv,
            *self.q,
            *self.full_q,
            (self.tile, self.tile),
            self.intervals.mask_mod(),
        )


def layout_block_mask(batch: PackedBatch, tile: int = 128) -> object:
    """The BlockMask of `batch`: from the layout it carries when that has this tile size, else built here
    (on the batch's device)."""
    layout = batch.tile_layout
    if layout is None or layout.tile != tile:
        layout = TileLayout.of(batch, tile)
    return layout.block_mask()
