"""Chunked linear cross-entropy against the naive computation; drafter_loss semantics and statistics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dflash.train.blocks import SequenceInput, make_packed_batch
from dflash.train.config import default_gamma
from dflash.train.drafter_config import DrafterConfig
from dflash.train.frozen import FrozenTarget
from dflash.train.loss import Distill, LossStats, drafter_loss, linear_cross_entropy, teacher_rows
from dflash.train.mask import build_attention_mask
from dflash.train.model import DFlashDrafter

from tests.common.tiny_shapes import tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _naive(hidden, weight, labels, weights, normalizer=None):
    ce = F.cross_entropy((hidden @ weight.t()).float(), labels, reduction="none")
    return (ce * weights).sum() / (weights.sum() if normalizer is None else normalizer)


@pytest.mark.parametrize(("rows", "chunk"), [(37, 8), (37, 37), (37, 100), (64, 16)])
def test_chunked_loss_and_gradient_equal_naive(rows: int, chunk: int) -> None:
    gen = torch.Generator().manual_seed(rows + chunk)
    weight = torch.randn(300, 24, generator=gen)
    labels = torch.randint(0, 300, (rows,), generator=gen)
    weights = torch.rand(rows, generator=gen) * (torch.rand(rows, generator=gen) > 0.3)
    h1 = torch.randn(rows, 24, generator=gen, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    loss, preds = linear_cross_entropy(h1, weight, labels, weights, chunk_rows=chunk)
    ref = _naive(h2, weight, labels, weights)
    (loss * 3.0).backward()  # a non-unit upstream gradient must be applied
    (ref * 3.0).backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-5)
    assert torch.equal(preds, (h2 @ weight.t()).argmax(-1))


def test_chunked_loss_bf16_and_external_normalizer() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(500, 32, generator=gen).to(torch.bfloat16)
    hidden = torch.randn(50, 32, generator=gen).to(torch.bfloat16).requires_grad_(True)
    labels, weights = torch.randint(0, 500, (50,), generator=gen), torch.rand(50, generator=gen)
    loss, _ = linear_cross_entropy(hidden, weight, labels, weights, chunk_rows=7, normalizer=100.0)
    ref_h = hidden.detach().float().requires_grad_(True)
    ref = _naive(ref_h, weight.float(), labels, weights, normalizer=100.0)
    loss.backward()
    ref.backward()
    assert hidden.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(hidden.grad.float(), ref_h.grad, atol=1e-3, rtol=5e-2)


def test_zero_weights_give_zero_loss_and_gradient() -> None:
    hidden = torch.randn(6, 8, requires_grad=True)
    loss, _ = linear_cross_entropy(
        hidden, torch.randn(10, 8), torch.zeros(6, dtype=torch.long), torch.zeros(6)
    )
    loss.backward()
    assert loss.item() == 0 and hidden.grad.eq(0).all()
    with torch.no_grad():  # no gradient requested: none computed, no error
        linear_cross_entropy(hidden, torch.randn(10, 8), torch.zeros(6, dtype=torch.long), torch.ones(6))


TARGET = tiny_target(vocab_size=80)


def test_drafter_loss_trains_slot_k_toward_the_token_at_anchor_plus_k() -> None:
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(TARGET, mask_token_id=79, num_hidden_layers=1, block_size=5)
    model = DFlashDrafter(cfg)
    frozen = FrozenTarget(torch.randn(80, 32), torch.randn(80, 32), TARGET, 79)
    seqs = [
        SequenceInput(torch.randint(0, 79, (s,)), torch.arange(s) >= 3, torch.randn(s, 32 * cfg.num_features))
        for s in (21, 12)
    ]
    batch = make_packed_batch(
        seqs,
        block_size=5,
        mask_token_id=79,
        num_anchors=5,
        generator=torch.Generator().manual_seed(0),
        pad_blocks_to_multiple=4,
    )
    loss, stats = drafter_loss(model, frozen, batch, chunk_rows=6)
    # Independent reference: logits of every block slot vs the token at anchor + k, weights exp(-(k-1)/gamma)
    logits = frozen.logits(model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, "dense")))
    num, den = 0.0, 0.0
    gamma = default_gamma(5)  # the one rule (train/config.py): (B - 2) / 2 outside the paper's sizes
    for n in range(batch.num_blocks):
        s, a = int(batch.block_seq[n]), int(batch.anchor_pos[n])
        if s < 0:
            continue
        ids, mask = seqs[s].input_ids, seqs[s].loss_mask
        for k in range(1, 5):
            if a + k < len(ids) and mask[a + k]:
                w = torch.exp(torch.tensor(-(k - 1) / gamma))
                num = num + w * F.cross_entropy(logits[n, k], ids[a + k])
                den = den + w
    torch.testing.assert_close(loss, num / den, atol=1e-5, rtol=1e-5)
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    summary = stats.summary()
    assert summary["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert summary["blocks"] == int((batch.block_seq >= 0).sum()) and 1.0 <= summary["tau"] <= 5.0
    # Feature noise perturbs the loss, reproducibly for one generator, and leaves the batch untouched.
    before = batch.features.clone()
    noisy = [
        drafter_loss(model, frozen, batch, feature_noise_std=0.5, generator=torch.Generator().manual_seed(7))[
            0
        ].item()
        for _ in range(2)
    ]
    assert noisy[0] == noisy[1] != pytest.approx(loss.item(), rel=1e-4)
    assert torch.equal(batch.features, before)


def test_stats_merge_and_summary() -> None:
    def make(c, v, acc):
        return LossStats(
            loss_sum=torch.tensor(2.0),
            weight_sum=torch.tensor(4.0),
            slot_correct=torch.tensor(c),
            slot_valid=torch.tensor(v),
            accept_at_least=torch.tensor(acc),
            accept_len_sum=torch.tensor(float(sum(acc))),
        )

    merged = make([0.0, 2, 1], [0.0, 4, 4], [4.0, 2, 1]).merge(make([0.0, 2, 1], [0.0, 4, 4], [4.0, 2, 0]))
    out = merged.summary()
    assert out["loss"] == 0.5 and out["acc_1"] == 0.5 and out["acc_2"] == 0.25
    assert out["blocks"] == 8 and out["accept_1"] == 0.5 and out["accept_2"] == 1 / 8
    assert out["tau"] == pytest.approx((7 + 6) / 8)


def test_autograd_never_keeps_full_logits() -> None:
    # Memory bound: nothing of size rows x vocab may be saved for backward (only [rows, hidden] survives).
    rows, vocab, width = 512, 4000, 16
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    hidden = torch.randn(rows, width, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = linear_cross_entropy(
            hidden * 1.0,
            torch.randn(vocab, width),
            torch.randint(0, vocab, (rows,)),
            torch.ones(rows),
            chunk_rows=64,
        )
    loss.backward()
    assert saved and max(saved) <= rows * width


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loss_memory_stays_bounded_on_gpu() -> None:
    # 512 anchors x 15 drafted slots x a Qwen3 vocabulary: full fp32 logits would be 4.7 GB.
    rows, vocab, width, chunk = 512 * 15, 151936, 4096, 1024
    weight = (torch.randn(vocab, width, device="cuda") * 0.02).to(torch.bfloat16)
    hidden = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (rows,), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss, _ = linear_cross_entropy(hidden, weight, labels, torch.ones(rows, device="cuda"), chunk_rows=chunk)
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 3 * chunk * vocab * 4 + 4 * rows * width * 4, f"{extra / 1e9:.2f} GB"
    assert torch.isfinite(hidden.grad).all()


def _reference_distill_loss(model, frozen, batch, seqs, alpha: float, gain: torch.Tensor) -> torch.Tensor:
    """Block by block, slot by slot: the soft label from the last feature at a + k - 1, decayed weights."""
    logits = frozen.logits(model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, "dense")))
    num, den, gamma = 0.0, 0.0, default_gamma(batch.block_size)
    for n in range(batch.num_blocks):
        s, a = int(batch.block_seq[n]), int(batch.anchor_pos[n])
        if s < 0:
            continue
        ids, mask, feats = seqs[s].input_ids, seqs[s].loss_mask, seqs[s].features
        for k in range(1, batch.block_size):
            if a + k < len(ids) and mask[a + k]:
                h = feats[a + k - 1, 32:]  # the last layer's raw output at a + k - 1
                h = h * torch.rsqrt(h.pow(2).mean() + 1e-6) * gain
                q = alpha * torch.softmax(frozen.logits(h), -1) + (1 - alpha) * F.one_hot(ids[a + k], 80)
                w = torch.exp(torch.tensor(-(k - 1) / gamma))
                num = num - w * (q * torch.log_softmax(logits[n, k], -1)).sum()
                den = den + w
    return num / den


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_distill_mixes_the_targets_distribution_at_the_state_before_each_slot(alpha: float) -> None:
    """Slot k of the block at anchor a learns softmax(lm_head(norm(h_last[a + k - 1]))): the state whose own
    output token is x[a + k], read from the batch's last feature (packed sequences, padding blocks)."""
    torch.manual_seed(1)
    cfg = DrafterConfig.from_target_config(
        TARGET, mask_token_id=79, num_hidden_layers=1, block_size=5, target_layer_ids=[0, 3]
    )
    model = DFlashDrafter(cfg)
    gain = torch.rand(32) + 0.5
    frozen = FrozenTarget(torch.randn(80, 32), torch.randn(80, 32), TARGET, 79, gain)
    seqs = [
        SequenceInput(torch.randint(0, 79, (s,)), torch.arange(s) >= 3, torch.randn(s, 32 * cfg.num_features))
        for s in (17, 11)
    ]
    batch = make_packed_batch(
        seqs, block_size=5, mask_token_id=79, num_anchors=4, generator=torch.Generator().manual_seed(2),
        pad_blocks_to_multiple=4,
    )  # fmt: skip
    loss, _ = drafter_loss(model, frozen, batch, chunk_rows=5, distill=Distill(alpha, feature_index=1))
    loss.backward()
    fused = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    reference = _reference_distill_loss(model, frozen, batch, seqs, alpha, gain)
    torch.testing.assert_close(loss, reference.detach(), atol=1e-5, rtol=1e-5)
    reference.backward()  # the fused backward is the soft label's gradient, softmax - q
    for got, want in zip(fused, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_distill_zero_is_the_hard_label_loss() -> None:
    torch.manual_seed(3)
    hidden, weight = torch.randn(7, 8), torch.randn(12, 8)
    labels, w = torch.randint(0, 12, (7,)), torch.rand(7)
    hard, preds = linear_cross_entropy(hidden, weight, labels, w)
    soft, soft_preds = linear_cross_entropy(hidden, weight, labels, w, teacher=torch.randn(7, 8), alpha=0.0)
    torch.testing.assert_close(soft, hard)
    assert torch.equal(preds, soft_preds)


def test_teacher_rows_point_at_the_state_before_each_slot() -> None:
    seqs = [
        SequenceInput(torch.arange(s), torch.ones(s, dtype=torch.bool), torch.randn(s, 4)) for s in (9, 6)
    ]
    batch = make_packed_batch(seqs, block_size=4, mask_token_id=99, num_anchors=3,
                              generator=torch.Generator().manual_seed(0), pad_blocks_to_multiple=8)  # fmt: skip
    rows = teacher_rows(batch)
    for n in range(batch.num_blocks):
        s = int(batch.block_seq[n])
        if s < 0:
            continue
        start = 0 if s == 0 else 9
        for k in range(1, 4):
            pos = int(batch.anchor_pos[n]) + k - 1
            want = start + min(pos, len(seqs[s].input_ids) - 1)
            assert int(rows[n, k - 1]) == want
            assert int(batch.context_pos[rows[n, k - 1]]) == min(pos, len(seqs[s].input_ids) - 1)
