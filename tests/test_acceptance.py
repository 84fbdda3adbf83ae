"""Acceptance-length estimates, the simulated decode walk, and a small learning check on a tiny target."""

from __future__ import annotations

import pytest
import torch
from dflash.train.acceptance import accepted_lengths, decode_walk, per_position_acceptance, tau, walk_tau
from dflash.train.blocks import SequenceInput, eligible_anchors, make_packed_batch
from dflash.train.drafter_config import DrafterConfig
from dflash.train.frozen import FrozenTarget
from dflash.train.loss import drafter_loss
from dflash.train.mask import build_attention_mask
from dflash.train.model import DFlashDrafter

from tests.common.tiny_shapes import tiny_target

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_accepted_prefix_lengths() -> None:
    labels = torch.tensor([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 7]])
    preds = torch.tensor([[5, 6, 7], [5, 0, 7], [0, 6, 7], [5, 6, 7]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    accepted = accepted_lengths(preds, labels, valid)
    assert accepted.tolist() == [3, 1, 0, 1]  # a mismatch or an invalid slot ends the prefix
    assert tau(accepted) == pytest.approx((4 + 2 + 1 + 2) / 4)
    assert per_position_acceptance(accepted, 4).tolist() == pytest.approx([0.75, 0.25, 0.25])
    with pytest.raises(ValueError, match="same shape"):
        accepted_lengths(preds, labels[:2], valid)


def test_decode_walk_follows_accepted_lengths_per_response_span() -> None:
    # positions 0-2 prompt, 3-11 response, 12-13 prompt, 14-17 response
    loss_mask = torch.tensor([0] * 3 + [1] * 9 + [0] * 2 + [1] * 4, dtype=torch.bool)
    accepted_at = torch.full((18,), -1)
    accepted_at[3], accepted_at[5], accepted_at[9], accepted_at[10] = 1, 3, 3, 0
    accepted_at[14], accepted_at[15] = 0, 2
    # span 1: a=3 (A=1) -> 5 (A=3) -> 9 (A=3, capped to 2 by the span end 12) -> 12 stop
    # span 2: a=14 (A=0) -> 15 (A=2) -> 18 stop
    steps = decode_walk(accepted_at, loss_mask)
    assert steps == [1, 3, 2, 0, 2]
    assert walk_tau(steps) == pytest.approx(sum(s + 1 for s in steps) / 5)
    accepted_at[5] = -1
    with pytest.raises(ValueError, match="anchor position 5"):
        decode_walk(accepted_at, loss_mask)


def _tiny_target_data(num_seqs: int, prompt: int, new: int, seed: int):
    """Greedy completions of a tiny random Qwen3 target and its layer outputs (what the cache would hold)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(
        **tiny_target(
            vocab_size=48,
            intermediate_size=64,
            num_hidden_layers=4,
            rope_theta=1e4,
            tie_word_embeddings=False,
        )
    )
    target = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(40)  # sharper logits: less degenerate greedy text
        prompts = torch.randint(0, 46, (num_seqs, prompt))
        ids = prompts
        for _ in range(new):  # plain greedy loop: cheaper than generate() for a model this small
            next_ids = target(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids], dim=1)
        hidden = target(ids, output_hidden_states=True).hidden_states
    frozen = FrozenTarget(
        target.model.embed_tokens.weight.detach().clone(),
        target.lm_head.weight.detach().clone(),
        cfg.to_dict(),
        47,
    )
    return ids, hidden, frozen


def _estimate(model, frozen, seqs):
    """tau over every eligible anchor and along the simulated decode walk."""
    taus, steps = [], []
    for seq in seqs:
        anchors = eligible_anchors(seq.loss_mask)
        batch = make_packed_batch([seq], block_size=4, mask_token_id=47, num_anchors=10**6, anchors=[anchors])
        with torch.no_grad():
            hidden = model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, "dense"))
        preds = frozen.logits(hidden[:, 1:]).argmax(-1)
        accepted = accepted_lengths(preds, batch.labels[:, 1:], batch.weights[:, 1:] > 0)
        taus.append(accepted)
        table = torch.full((len(seq.input_ids),), -1)
        table[anchors] = accepted
        steps += decode_walk(table, seq.loss_mask)
    return tau(torch.cat(taus)), walk_tau(steps)


def test_training_lifts_acceptance_on_tiny_target_greedy_data() -> None:
    prompt, new = 6, 42
    ids, hidden, frozen = _tiny_target_data(24, prompt, new, seed=0)
    layer_ids = [0, 2]
    seqs = [
        SequenceInput(
            ids[i],
            torch.arange(ids.shape[1]) >= prompt,
            torch.cat([hidden[j + 1][i] for j in layer_ids], dim=-1),
        )
        for i in range(ids.shape[0])
    ]
    train, held_out = seqs[:20], seqs[20:]
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(
        frozen.config, mask_token_id=47, num_hidden_layers=2, block_size=4, target_layer_ids=layer_ids
    )
    model = DFlashDrafter(cfg)
    before = _estimate(model, frozen, held_out)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for step in range(100):
        pick = [train[(step * 4 + j) % len(train)] for j in range(4)]
        batch = make_packed_batch(pick, block_size=4, mask_token_id=47, num_anchors=16, generator=gen)
        loss, _ = drafter_loss(model, frozen, batch, attn_mask=build_attention_mask(batch, "dense"))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _estimate(model, frozen, held_out)
    print(
        f"tau (all anchors, decode walk): untrained {before[0]:.2f} {before[1]:.2f} -> trained {after[0]:.2f} "
        f"{after[1]:.2f}"
    )
    assert after[0] > before[0] + 0.5 and after[1] > before[1] + 0.5
