"""Small random packed batches for mask and attention tests."""

from __future__ import annotations

import torch
from dflash.train.blocks import PackedBatch, SequenceInput, make_packed_batch


def random_pack(lengths: list[int], num_anchors: int, block_size: int, pad: int, seed: int) -> PackedBatch:
    """A packed batch of random sequences (4-wide features), padded to a multiple of `pad` blocks."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [
        SequenceInput(
            torch.randint(0, 60, (s,), generator=gen),
            torch.rand(s, generator=gen) > 0.3,  # gaps in the loss mask: anchors anywhere, some blocks short
            torch.randn(s, 4, generator=gen),
        )
        for s in lengths
    ]
    return make_packed_batch(
        seqs,
        block_size=block_size,
        mask_token_id=63,
        num_anchors=num_anchors,
        generator=gen,
        pad_blocks_to_multiple=pad,
    )
