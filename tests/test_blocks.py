"""Anchors, block inputs, labels, loss weights and packing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from common.dispatch import dispatched_ops
from dflash.shards import get_codec
from dflash.shards.qcodec import dequantize_q
from dflash.train.blocks import (
    SequenceInput,
    build_blocks,
    copy_preference,
    default_gamma,
    eligible_anchors,
    make_packed_batch,
    sample_anchors,
    slot_weights,
)
from dflash.train.lookup import lookup_accepted
from hypothesis import given, settings
from hypothesis import strategies as st

MASK = 99


@given(
    mask=st.lists(st.booleans(), min_size=1, max_size=60),
    num=st.integers(1, 70),
    seed=st.integers(0, 2**31),
    odds=st.none() | st.lists(st.floats(1.0, 50.0), min_size=60, max_size=60),
)
@settings(max_examples=150, deadline=None)
def test_sample_anchors_properties(mask: list[bool], num: int, seed: int, odds: list[float] | None) -> None:
    # uniform (odds None) or by preference (--copy-anchor-weight): the same guarantees either way
    loss_mask = torch.tensor(mask)
    prefer = None if odds is None else torch.tensor(odds[: len(mask)], dtype=torch.float64)
    anchors = sample_anchors(loss_mask, num, torch.Generator().manual_seed(seed), prefer)
    eligible = {a for a in range(len(mask) - 1) if mask[a] and mask[a + 1]}
    assert set(anchors.tolist()) <= eligible
    assert len(anchors) == min(num, len(eligible)) == len(set(anchors.tolist()))
    assert anchors.tolist() == sorted(anchors.tolist())
    again = sample_anchors(loss_mask, num, torch.Generator().manual_seed(seed), prefer)
    assert torch.equal(anchors, again)


def test_sample_anchors_is_uniform_and_redrawn() -> None:
    loss_mask = torch.ones(41, dtype=torch.bool)  # 40 eligible positions
    gen = torch.Generator().manual_seed(0)
    draws = [sample_anchors(loss_mask, 10, gen) for _ in range(400)]
    assert len({tuple(d.tolist()) for d in draws}) == 400  # a fresh draw every call
    counts = torch.bincount(torch.cat(draws), minlength=40).float()
    assert counts.sum() == 4000 and counts.min() > 60 and counts.max() < 140  # each expected 100
    assert eligible_anchors(loss_mask).tolist() == list(range(40))


def test_copy_preference_draws_anchors_lookup_copies_more_often() -> None:
    # a response that repeats a 12-token phrase: from its second occurrence on, lookup copies whole blocks
    phrase = list(range(10, 22))
    ids = torch.tensor([1, 2, 3, *phrase, 4, 5, 6, 7, *phrase, 8, 9])
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[3:] = True
    prefer = copy_preference(ids, mask, block_size=4, weight=9.0)
    copied = lookup_accepted(ids.numpy(), mask.numpy(), 3)
    assert prefer.tolist() == [1.0 + 8.0 * max(0, int(c)) / 3 for c in copied]
    assert prefer.max() == 9.0 and prefer[3] == 1.0  # the first occurrence cannot be copied
    whole = torch.from_numpy(copied == 3)
    gen = torch.Generator().manual_seed(0)
    uniform = torch.cat([sample_anchors(mask, 4, gen) for _ in range(300)])
    weighted = torch.cat([sample_anchors(mask, 4, gen, prefer) for _ in range(300)])
    share = [float(whole[a].float().mean()) for a in (uniform, weighted)]
    assert share[1] > 1.5 * share[0]  # ~9x the odds, without replacement from a handful of positions
    # weight 1: every anchor at odds 1, the uniform draw
    one = copy_preference(ids, mask, block_size=4, weight=1.0)
    assert torch.equal(one, torch.ones_like(one))


def test_packed_batch_with_copy_weight_draws_its_anchors_by_lookup() -> None:
    phrase = list(range(10, 30))
    ids = torch.tensor([1, *phrase, *range(40, 60), *phrase, 2])
    seq = SequenceInput(
        input_ids=ids,
        loss_mask=torch.ones(ids.numel(), dtype=torch.bool),
        features=torch.zeros(ids.numel(), 4),
    )
    copied = torch.from_numpy(lookup_accepted(ids.numpy(), seq.loss_mask.numpy(), 3) == 3)
    shares = []
    for weight in (1.0, 50.0):
        gen = torch.Generator().manual_seed(1)
        picks = [
            make_packed_batch(
                [seq],
                block_size=4,
                mask_token_id=MASK,
                num_anchors=5,
                generator=gen,
                copy_anchor_weight=weight,
            ).anchor_pos
            for _ in range(100)
        ]
        shares.append(float(copied[torch.cat(picks)].float().mean()))
    assert shares[0] < 0.4 < 0.8 < shares[1]


def test_copy_slot_weight_raises_the_slots_lookup_copies_and_no_others() -> None:
    phrase = list(range(10, 30))
    ids = torch.tensor([1, *phrase, *range(40, 60), *phrase, 2, 3, 4])
    mask = torch.ones(ids.numel(), dtype=torch.bool)
    mask[:5] = False  # a prompt: its slots stay at weight 0
    seq = SequenceInput(input_ids=ids, loss_mask=mask, features=torch.zeros(ids.numel(), 4))
    copied = lookup_accepted(ids.numpy(), mask.numpy(), 7)
    anchors = torch.arange(3, ids.numel())
    kwargs = dict(block_size=8, mask_token_id=MASK, num_anchors=1, gamma=1.0, anchors=[anchors])
    plain = make_packed_batch([seq], **kwargs).weights
    raised = make_packed_batch([seq], **kwargs, copy_slot_weight=0.5).weights
    for i, a in enumerate(anchors.tolist()):
        for k in range(8):
            copy = 1 <= k <= max(0, int(copied[a]))
            want = max(float(plain[i, k]), 0.5) if copy and plain[i, k] > 0 else float(plain[i, k])
            assert float(raised[i, k]) == pytest.approx(want), (a, k)
    # the second phrase's anchors copy whole blocks: their far slots, e^-6 under gamma 1, now weigh 0.5
    whole = [i for i, a in enumerate(anchors.tolist()) if copied[a] == 7]
    assert whole and all(float(raised[i, 7]) == 0.5 for i in whole)
    assert float(raised[:, 0].abs().sum()) == 0.0  # the anchor slot is given, never trained


def test_labels_are_the_tokens_at_block_positions() -> None:
    ids = torch.arange(100, 120)
    blocks, labels, weights = build_blocks(
        ids, torch.ones(20, dtype=torch.bool), torch.tensor([3, 17]), 4, MASK, 7.0
    )
    assert blocks.tolist() == [[103, MASK, MASK, MASK], [117, MASK, MASK, MASK]]
    # slot k is trained toward x[a + k] (NOT x[a + k + 1]); past the end: weight 0
    assert labels[0].tolist() == [103, 104, 105, 106]
    assert labels[1, :3].tolist() == [117, 118, 119] and weights[1, 3] == 0


def test_loss_weights() -> None:
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1
    for k in range(1, 16):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / 7.0), rel_tol=1e-6)
    assert [default_gamma(b) for b in (16, 10, 8)] == [7.0, 5.0, 4.0]
    loss_mask = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool)
    _, _, weights = build_blocks(torch.arange(6), loss_mask, torch.tensor([1, 4]), 4, MASK, 5.0)
    base = slot_weights(4, 5.0)
    # anchor 1: positions 1..4, position 3 has loss_mask 0
    assert weights[0].tolist() == pytest.approx([0.0, float(base[1]), 0.0, float(base[3])])
    # anchor 4: positions 4..7, 6 and 7 are past the end
    assert weights[1].tolist() == pytest.approx([0.0, float(base[1]), 0.0, 0.0])
    with pytest.raises(ValueError, match="gamma"):
        slot_weights(4, 0.0)


def test_packing_several_sequences() -> None:
    seqs = [
        SequenceInput(torch.arange(10), torch.ones(10, dtype=torch.bool), torch.full((10, 6), 1.0)),
        SequenceInput(
            torch.arange(50, 57),
            torch.tensor([0, 0, 1, 1, 1, 1, 1], dtype=torch.bool),
            torch.full((7, 6), 2.0),
        ),
    ]
    batch = make_packed_batch(
        seqs,
        block_size=4,
        mask_token_id=MASK,
        num_anchors=3,
        generator=torch.Generator().manual_seed(1),
        pad_blocks_to_multiple=4,
    )
    assert batch.features.shape == (17, 6) and batch.features[10:].eq(2.0).all()
    assert batch.context_pos.tolist() == [*range(10), *range(7)]
    assert batch.context_seq.tolist() == [0] * 10 + [1] * 7
    assert batch.block_seq.tolist() == [0, 0, 0, 1, 1, 1, -1, -1]
    assert batch.num_blocks == 8 and batch.weights[6:].eq(0).all() and batch.block_ids[6:].eq(MASK).all()
    for n in range(6):
        a, s = int(batch.anchor_pos[n]), int(batch.block_seq[n])
        assert int(batch.block_ids[n, 0]) == int(seqs[s].input_ids[a])
        assert seqs[s].loss_mask[a] and seqs[s].loss_mask[a + 1]


def test_packing_from_per_layer_hidden_states_keeps_layer_order() -> None:
    hidden = {3: torch.full((5, 2), 3.0), 7: torch.full((5, 2), 7.0), 9: torch.full((5, 2), 9.0)}
    sample = SimpleNamespace(
        input_ids=torch.arange(5), loss_mask=torch.ones(5, dtype=torch.bool), hidden=hidden
    )
    batch = make_packed_batch(
        [sample],
        block_size=2,
        mask_token_id=MASK,
        num_anchors=8,
        layer_ids=[9, 3],
        feature_dtype=torch.bfloat16,
    )
    assert batch.features.dtype == torch.bfloat16 and batch.features[0].tolist() == [9, 9, 3, 3]
    assert batch.anchor_pos.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"lacks target layers \[4\]"):
        make_packed_batch([sample], block_size=2, mask_token_id=MASK, num_anchors=8, layer_ids=[4])
    with pytest.raises(ValueError, match="pass layer_ids"):
        make_packed_batch([sample], block_size=2, mask_token_id=MASK, num_anchors=8)


def test_q_packed_features_decode_to_the_codecs_bits_in_launches_that_do_not_grow_with_the_layers() -> None:
    """q4 batches decode on the GPU in the training process's copy thread, each operation a launch that hands
    the GIL to the training thread: one `dequantize_q` over every layer, bit for bit the codec's own decode."""
    codec = get_codec("q4")
    gen = torch.Generator().manual_seed(0)

    def sample(n: int, layers: int) -> SimpleNamespace:
        states = [
            torch.randn(n, 96, generator=gen) * torch.rand(96, generator=gen) * 4 for _ in range(layers)
        ]
        hidden = {i: codec.decode_block(codec.encode(x), (n, 96)) for i, x in enumerate(states)}
        return SimpleNamespace(
            input_ids=torch.arange(n), loss_mask=torch.ones(n, dtype=torch.bool), hidden=hidden
        )

    def packed(layers: int) -> tuple[object, list[SimpleNamespace]]:
        samples = [sample(n, layers) for n in (9, 30, 4)]
        batch = make_packed_batch(samples, block_size=4, mask_token_id=MASK, num_anchors=3,
                                  layer_ids=list(range(layers)), generator=gen)  # fmt: skip
        return batch, samples

    batch, samples = packed(4)
    want = torch.cat([torch.cat([dequantize_q(s.hidden[i]) for i in range(4)], 1) for s in samples])
    got = batch.dequantized().features
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    one, four = (dispatched_ops(packed(k)[0].dequantized) for k in (1, 4))
    assert one == four


def test_explicit_anchors_and_empty_sequences() -> None:
    seq = SequenceInput(torch.arange(6), torch.zeros(6, dtype=torch.bool), torch.zeros(6, 4))
    batch = make_packed_batch([seq], block_size=4, mask_token_id=MASK, num_anchors=4)
    assert batch.num_blocks == 1 and batch.block_seq.tolist() == [-1]  # nothing to train: one padding block
    batch = make_packed_batch(
        [seq], block_size=4, mask_token_id=MASK, num_anchors=4, anchors=[torch.tensor([0, 2])]
    )
    assert batch.anchor_pos.tolist() == [0, 2]
    with pytest.raises(ValueError, match="disagree on length"):
        make_packed_batch(
            [SequenceInput(torch.arange(6), torch.ones(5, dtype=torch.bool), torch.zeros(6, 4))],
            block_size=4,
            mask_token_id=MASK,
            num_anchors=4,
        )
