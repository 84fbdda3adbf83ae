"""Masks read off the pack layout equal the rule: the BlockMask tile for tile, the dense mask pair for pair."""

from __future__ import annotations

import warnings

import pytest
import torch
from dflash.train.block_mask import KeyIntervals, _ordered
from dflash.train.mask import DenseMask, FlexMask, dense_mask
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.common.packs import random_pack as _pack

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _tiles(num: torch.Tensor, indices: torch.Tensor) -> list[list[int]]:
    """The chosen tiles of each query-tile row, in stored order."""
    return [indices[0, 0, r, : int(num[0, 0, r])].tolist() for r in range(num.shape[-1])]


@given(
    lengths=st.lists(st.integers(2, 60), min_size=1, max_size=4),
    anchors=st.integers(1, 12),
    block_size=st.sampled_from([2, 4, 8, 10, 16]),
    pad=st.integers(1, 5),
    tile=st.sampled_from([8, 16, 32, 128, (16, 32), (32, 8)]),  # (query tile, key tile) too
    seed=st.integers(0, 10_000),
)
@settings(max_examples=40, deadline=None)
def test_layout_block_mask_equals_create_block_mask_over_the_rule(
    lengths, anchors, block_size, pad, tile, seed
) -> None:
    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    batch = _pack(lengths, anchors, block_size, pad, seed)
    mine = FlexMask.from_batch(batch, tile).block_mask
    rule = FlexMask.from_rule(batch, tile).block_mask
    assert mine.seq_lengths == rule.seq_lengths and tuple(mine.BLOCK_SIZE) == tuple(rule.BLOCK_SIZE)
    for prefix in ("kv", "q"):  # forward (per query tile) and backward (per key tile) orderings
        for kind in ("", "full_"):
            num, idx = f"{kind}{prefix}_num_blocks", f"{kind}{prefix}_indices"
            assert torch.equal(getattr(mine, num), getattr(rule, num)), num
            assert _tiles(getattr(mine, num), getattr(mine, idx)) == _tiles(
                getattr(rule, num), getattr(rule, idx)
            ), idx
    # The kernel evaluates the interval mask_mod on partial tiles: it must be the rule, pair for pair.
    m = batch.num_blocks * block_size
    q = torch.arange(m)[:, None]
    kv = torch.arange(batch.num_context_tokens + m)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    rule = dense_mask(batch)
    assert torch.equal(KeyIntervals.of(batch).mask_mod()(zero, zero, q, kv), rule)
    # The dense path uses the intervals too; rows that see nothing (padding) attend to their own slot.
    empty = ~rule.any(dim=1)
    rule[q[empty, 0], batch.num_context_tokens + q[empty, 0]] = True
    dense = DenseMask.from_batch(batch)
    assert torch.equal(dense.allowed, rule) and torch.equal(dense.empty_rows, empty)


def test_padding_blocks_have_empty_intervals_and_real_ones_end_at_their_anchor() -> None:
    batch = _pack([30, 20], 3, 4, 8, 3)  # 6 blocks + 2 padding
    iv = KeyIntervals.of(batch)
    real = batch.block_seq >= 0
    assert (~real).any()
    assert torch.equal(iv.lo[~real], iv.hi[~real]) and (iv.own[~real] + 4 <= 0).all()
    starts = torch.tensor([0, 30])[batch.block_seq[real]]
    assert torch.equal(iv.lo[real], starts) and torch.equal(iv.hi[real], starts + batch.anchor_pos[real])


def test_a_batch_carries_its_tiles_through_moves_and_its_mask_uses_them() -> None:
    batch = _pack([50, 37, 9], 6, 4, 3, 11)
    carried = batch.with_tile_layout(16).to("cpu", non_blocking=True)  # the loader's copy, on the CPU
    layout = carried.tile_layout
    # the layout's tensors travel with the batch (the loader's record_stream covers them)
    held = {id(t) for t in carried.tensors()}
    assert all(id(t) in held for t in layout.tensors())
    mine, fresh = FlexMask.from_batch(carried, 16).block_mask, FlexMask.from_batch(batch, 16).block_mask
    assert mine.kv_indices is layout.kv[1] and mine.full_q_num_blocks is layout.full_q[0]  # not rebuilt
    assert mine.seq_lengths == fresh.seq_lengths
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks",
                 "q_indices", "full_q_num_blocks", "full_q_indices"):  # fmt: skip
        assert torch.equal(getattr(mine, name), getattr(fresh, name)), name
    # another tile size is built on the spot, not read off the carried one
    other = FlexMask.from_batch(carried, 8).block_mask
    assert other.BLOCK_SIZE == (8, 8) and torch.equal(
        other.kv_indices, FlexMask.from_batch(batch, 8).block_mask.kv_indices
    )
    # dequantized() and the dense path keep working on a carrying batch
    assert carried.dequantized().tile_layout is layout
    assert torch.equal(DenseMask.from_batch(carried).allowed, DenseMask.from_batch(batch).allowed)


@given(rows=st.integers(1, 30), cols=st.integers(1, 30), density=st.floats(0, 1), seed=st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_tile_lists_are_a_stable_partition_chosen_first(rows, cols, density, seed) -> None:
    """`_ordered` partitions instead of sorting: the same lists as a stable descending argsort, whole rows."""
    tiles = torch.rand(rows, cols, generator=torch.Generator().manual_seed(seed)) < density
    num, indices = _ordered(tiles)
    expected = torch.argsort(tiles.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
    assert torch.equal(indices[0, 0], expected) and indices.dtype == torch.int32
    assert torch.equal(num[0, 0], tiles.sum(-1, dtype=torch.int32))
