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
    layout_block_mask(batch, tile=128) -> BlockMask
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .blocks import PackedBatch
    from .mask import MaskMod


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


def layout_block_mask(batch: PackedBatch, tile: int = 128) -> object:
    """The BlockMask of `batch` (queries: its N*B block slots; keys: T context tokens then the slots)."""
    from torch.nn.attention.flex_attention import BlockMask

    intervals = KeyIntervals.of(batch)
    counts = intervals.tile_counts(tile, tile)
    full = counts == tile * tile
    partial = (counts > 0) & ~full
    # The backward walks the same tiles per key tile: the transposed matrices, ordered the same way
    # (what BlockMask.from_kv_blocks derives through a dense round trip).
    kv_num, kv_indices = _ordered(partial)
    full_kv_num, full_kv_indices = _ordered(full)
    q_num, q_indices = _ordered(partial.t())
    full_q_num, full_q_indices = _ordered(full.t())
    return BlockMask(
        (batch.num_blocks * batch.block_size, intervals.num_keys),
        kv_num,
        kv_indices,
        full_kv_num,
        full_kv_indices,
        q_num,
        q_indices,
        full_q_num,
        full_q_indices,
        (tile, tile),
        intervals.mask_mod(),
    )
