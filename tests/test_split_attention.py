"""The split attention (context through FlexAttention, own slots densely, merged by log-sum-exp) is the one
softmax over both key intervals: outputs and gradients equal dense SDPA over the rule."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
from dflash.train.block_mask import TileLayout
from dflash.train.cli import build_config
from dflash.train.mask import DenseMask, FlexMask
from dflash.train.split_attention import merge_softmaxes, split_attention
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.common.packs import random_pack

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SCALE = 8**-0.5  # head dim 8


def _qkv(batch, heads, kv_heads, seed, grad):
    gen = torch.Generator().manual_seed(seed)
    m = batch.num_blocks * batch.block_size
    keys = batch.num_context_tokens + m
    q = torch.randn(1, heads, m, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, kv_heads, keys, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _grads(out, inputs, seed):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * weights).sum(), inputs)


def _dense_flex(q, k, v, block_mask, scale, enable_gqa, return_aux, kernel_options=None):
    """FlexAttention's contract evaluated densely (CPU FlexAttention has no backward): the output and the
    natural-log lse over the keys `block_mask.mask_mod` allows; a row that sees nothing gives 0 and -inf.
    `kernel_options` (tiles, warps) choose how a GPU computes it, not what."""
    zero = torch.zeros((), dtype=torch.long)
    allowed = block_mask.mask_mod(zero, zero, torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2]))
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])
    return probs @ v, SimpleNamespace(lse=lse)


PACKS = dict(
    lengths=st.lists(st.integers(2, 40), min_size=1, max_size=3),
    anchors=st.integers(1, 8),
    block_size=st.sampled_from([2, 4, 8]),
    pad=st.integers(1, 4),
    heads=st.sampled_from([(2, 1), (4, 2), (2, 2)]),
    seed=st.integers(0, 10_000),
)


@given(**PACKS)
@settings(max_examples=25, deadline=None)
def test_split_attention_equals_one_softmax_over_both_intervals(
    lengths, anchors, block_size, pad, heads, seed
):
    """Through the real FlexAttention (forward only on a CPU): its lse's convention, the merge, padding."""
    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    batch = random_pack(lengths, anchors, block_size, pad, seed)
    q, k, v = _qkv(batch, *heads, seed, grad=False)
    out = FlexMask.from_batch(batch, 16, split=True).attend(q, k, v, scale=SCALE)
    ref = DenseMask.from_batch(batch).attend(q, k, v, scale=SCALE)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)  # CPU FlexAttention computes in fp32
    padding = (batch.block_seq < 0).repeat_interleave(block_size)
    assert not out[..., padding, :].any()  # padding blocks see nothing and output 0


@given(**PACKS)
@settings(max_examples=25, deadline=None)
def test_split_attention_gradients_equal_dense_sdpa(lengths, anchors, block_size, pad, heads, seed):
    batch = random_pack(lengths, anchors, block_size, pad, seed)
    q, k, v = _qkv(batch, *heads, seed, grad=True)
    mask = FlexMask.from_batch(batch, 16, split=True)
    t = batch.num_context_tokens
    out = split_attention(
        _dense_flex, q, k[:, :, :t], v[:, :, :t], k[:, :, t:], v[:, :, t:], mask.block_mask, SCALE,
        block_size, mask.own_slots.real_rows,
    )  # fmt: skip
    ref = DenseMask.from_batch(batch).attend(q, k, v, scale=SCALE)
    torch.testing.assert_close(out, ref)
    for name, got, want in zip(
        "qkv", _grads(out, (q, k, v), seed), _grads(ref, (q, k, v), seed), strict=True
    ):
        torch.testing.assert_close(got, want, msg=f"grad {name}")


def test_context_only_layout_covers_the_context_keys_alone() -> None:
    batch = random_pack([30, 20], 6, 4, 3, seed=1)
    layout = TileLayout.of(batch, 8, context_only=True)
    assert layout.block_mask().seq_lengths == (batch.num_blocks * 4, batch.num_context_tokens)
    assert layout.context_only and not TileLayout.of(batch, 8).context_only


def test_merge_gives_zero_and_finite_gradients_where_no_key_is_seen() -> None:
    out_a = torch.randn(1, 1, 3, 2, requires_grad=True)
    out_b = torch.randn(1, 1, 3, 2, requires_grad=True)
    inf = float("-inf")
    lse_a = torch.tensor([[[inf, 0.5, inf]]], requires_grad=True)
    lse_b = torch.tensor([[[inf, inf, 1.0]]], requires_grad=True)
    merged = merge_softmaxes(out_a, lse_a, out_b, lse_b)
    assert torch.equal(merged[0, 0, 0], torch.zeros(2))
    torch.testing.assert_close(merged[0, 0, 1], out_a[0, 0, 1].detach())
    torch.testing.assert_close(merged[0, 0, 2], out_b[0, 0, 2].detach())
    merged.sum().backward()
    for t in (out_a, out_b, lse_a, lse_b):
        assert torch.isfinite(t.grad).all()


def test_a_carried_layout_serves_only_the_split_it_was_built_for() -> None:
    """The loader builds context-only tiles for `--split-own-slots` runs; a mask reuses carried tiles only
    when their key range matches (else it builds its own, as tall as its keys)."""
    batch = random_pack([30, 20], 6, 4, 3, seed=2).with_tile_layout(16, context_only=True)
    carried = batch.tile_layout.kv[1]
    assert FlexMask.from_batch(batch, 16, split=True).block_mask.kv_indices is carried
    whole = FlexMask.from_batch(batch, 16).block_mask
    assert whole.kv_indices is not carried
    assert whole.seq_lengths[1] == batch.num_context_tokens + batch.num_blocks * 4


def test_the_flag_reaches_the_run_config(tmp_path) -> None:
    base = ["--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run")]
    assert build_config([*base, "--split-own-slots"]).split_own_slots
    assert not build_config(base).split_own_slots
