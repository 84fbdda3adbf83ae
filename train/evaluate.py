"""Evaluation on held-out rows: loss, per-position accuracy, tau (sampled anchors and a decode walk).

The held-out set is fixed for the whole run (`data_plan.eval_batches`: shards in name order) and so
are its anchors (a generator seeded from the run seed), so numbers at different steps compare the
same blocks. The decode walk evaluates EVERY eligible anchor of each sequence, then replays a greedy
decode (start at the first response token, advance by A + 1): tau as serving would see it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from dflash.shards import Cache, ShardReader
from dflash.shards.errors import ShardError

from .acceptance import accepted_lengths, decode_walk, walk_tau
from .blocks import eligible_anchors, make_packed_batch
from .config import TrainConfig
from .data_plan import SampleRef, ShardEntries, eval_batches
from .frozen import FrozenTarget
from .loss import LossStats, drafter_loss
from .mask import build_attention_mask
from .model import DFlashDrafter, DrafterConfig

_EVAL_ANCHOR_TAG = 0x4556
_WALK_ANCHORS_PER_PASS = 1024


@dataclass(kw_only=True, slots=True)
class EvalSet:
    """The held-out batches (sample references; data is re-read at each evaluation to bound memory)."""

    batches: list[list[SampleRef]]

    @property
    def num_samples(self) -> int:
        return sum(len(b) for b in self.batches)


def build_eval_set(
    cache: Cache,
    *,
    max_samples: int,
    token_budget: int,
    max_length: int,
    heldout_fraction: float,
    heldout_rows: frozenset[int],
) -> EvalSet:
    """Pick up to `max_samples` held-out rows, reading shard indexes in name order until enough are found."""

    def entries_of(name: str) -> ShardEntries:
        try:
            entries = cache.shard(name).entries
        except (ShardError, OSError):
            return ShardEntries(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
        return ShardEntries(
            rows=np.array([e.row for e in entries], np.int64),
            lengths=np.array([e.length for e in entries], np.int64),
            supervised=np.array([e.supervised for e in entries], np.int64),
        )

    if heldout_fraction <= 0 and not heldout_rows:
        return EvalSet(batches=[])
    return EvalSet(
        batches=eval_batches(
            cache.shard_names,
            entries_of,
            max_samples=max_samples,
            token_budget=token_budget,
            max_length=max_length,
            heldout_fraction=heldout_fraction,
            heldout_rows=heldout_rows,
        )
    )


def _read_samples(
    cache: Cache,
    refs: Sequence[SampleRef],
    layer_ids: Sequence[int],
    max_length: int,
    pool: ThreadPoolExecutor,
) -> list[Any]:
    def read(ref: SampleRef) -> Any:
        reader: ShardReader = cache.shard(ref.shard)
        try:  # cut while decoding: the tokens past max_length are never decompressed
            return reader.read(ref.index, layer_ids, max_tokens=max_length)
        except ShardError:
            return None  # a corrupt held-out sample is left out of evaluation, never fatal here

    return [s for s in pool.map(read, refs) if s is not None]


def _block_predictions(
    model: DFlashDrafter, frozen: FrozenTarget, batch: Any, chunk_rows: int = 2048, attention: str = "auto"
) -> torch.Tensor:
    """Greedy drafts [N, B-1] for every block of a batch (lm_head in row chunks to bound memory)."""
    hidden = model(batch, frozen.embed(batch.block_ids), build_attention_mask(batch, attention))
    n, b, h = hidden.shape
    drafted = hidden[:, 1:].reshape(-1, h)
    preds = torch.cat(
        [
            frozen.logits(drafted[i : i + chunk_rows]).argmax(-1)
            for i in range(0, drafted.shape[0], chunk_rows)
        ]
    )
    return preds.view(n, b - 1)


@torch.no_grad()
def evaluate(
    model: DFlashDrafter,
    frozen: FrozenTarget,
    cache: Cache,
    eval_set: EvalSet,
    *,
    layer_ids: Sequence[int],
    block_size: int,
    mask_token_id: int,
    num_anchors: int,
    gamma: float,
    max_length: int,
    seed: int,
    device: torch.device,
    walk: bool = True,
    threads: int = 4,
    attention: str = "auto",
) -> dict[str, Any]:
    """Metrics over the held-out set; an empty set returns {}. `attention`: see `mask.choose_backend`."""
    if not eval_set.batches:
        return {}
    was_training = model.training
    model.eval()
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )
    total: LossStats | None = None
    walk_steps: list[int] = []
    try:
        with ThreadPoolExecutor(threads, thread_name_prefix="dflash-eval") as pool, autocast:
            for index, refs in enumerate(eval_set.batches):
                samples = _read_samples(cache, refs, layer_ids, max_length, pool)
                if not samples:
                    continue
                generator = torch.Generator().manual_seed(seed * 1_000_003 + index * 7919 + _EVAL_ANCHOR_TAG)
                batch = make_packed_batch(
                    samples,
                    block_size=block_size,
                    mask_token_id=mask_token_id,
                    num_anchors=num_anchors,
                    gamma=gamma,
                    generator=generator,
                    layer_ids=layer_ids,
                ).to(device)
                if not bool((batch.weights > 0).any()):
                    continue
                _, stats = drafter_loss(
                    model, frozen, batch, attn_mask=build_attention_mask(batch, attention)
                )
                total = stats if total is None else total.merge(stats)
                if walk:
                    for sample in samples:
                        walk_steps.extend(
                            _walk_one(
                                model,
                                frozen,
                                sample,
                                layer_ids=layer_ids,
                                block_size=block_size,
                                mask_token_id=mask_token_id,
                                gamma=gamma,
                                device=device,
                                # Walk batches change shape with every sample, and inductor has failed to
                                # lower FlexAttention for some of them (H200, torch 2.11): under "flex" the
                                # walk uses "auto" (dense when small, a fallback when not).
                                attention="dense" if attention == "dense" else "auto",
                            )
                        )
    finally:
        model.train(was_training)
    if total is None:
        return {}
    summary = total.summary()
    b = block_size
    result: dict[str, Any] = {
        "eval_loss": summary["loss"],
        "eval_acc": summary["acc"],
        "tau": summary["tau"],
        "eval_blocks": int(summary["blocks"]),
        "eval_samples": eval_set.num_samples,
        "acc_per_position": [summary[f"acc_{k}"] for k in range(1, b)],
        "acceptance_per_position": [summary[f"accept_{k}"] for k in range(1, b)],
    }
    if walk and walk_steps:
        result["tau_walk"] = walk_tau(walk_steps)
        result["walk_steps"] = len(walk_steps)
    return {k: v for k, v in result.items() if not (isinstance(v, float) and math.isnan(v))}


def configured_eval_set(
    cache: Cache, cfg: TrainConfig, heldout_rows: frozenset[int] = frozenset()
) -> EvalSet:
    """The held-out set a run with `cfg` evaluates on (the same rows and batches every time)."""
    return build_eval_set(
        cache,
        max_samples=cfg.data.eval_samples,
        token_budget=cfg.data.token_budget,
        max_length=cfg.data.max_length,
        heldout_fraction=cfg.data.eval_fraction,
        heldout_rows=heldout_rows,
    )


def evaluate_configured(
    model: DFlashDrafter,
    frozen: FrozenTarget,
    cache: Cache,
    eval_set: EvalSet,
    cfg: TrainConfig,
    drafter_cfg: DrafterConfig,
    *,
    device: torch.device,
) -> dict[str, Any]:
    """`evaluate` with the drafter's layers and mask token and the run's block, anchor and kernel settings."""
    return evaluate(
        model,
        frozen,
        cache,
        eval_set,
        layer_ids=drafter_cfg.target_layer_ids,
        block_size=drafter_cfg.block_size,
        mask_token_id=drafter_cfg.mask_token_id,
        num_anchors=cfg.drafter.num_anchors,
        gamma=cfg.drafter.loss_gamma,
        max_length=cfg.data.max_length,
        seed=cfg.seed,
        device=device,
        threads=cfg.data.loader_threads,
        attention=cfg.attention,
    )


def _walk_one(
    model: DFlashDrafter,
    frozen: FrozenTarget,
    sample: Any,
    *,
    layer_ids: Sequence[int],
    block_size: int,
    mask_token_id: int,
    gamma: float,
    device: torch.device,
    attention: str = "auto",
) -> list[int]:
    """A per decode step of one sequence: blocks at every eligible anchor, then the greedy walk."""
    anchors = eligible_anchors(sample.loss_mask)
    accepted_at = torch.full((sample.length,), -1, dtype=torch.long)
    for start in range(0, anchors.numel(), _WALK_ANCHORS_PER_PASS):
        chunk = anchors[start : start + _WALK_ANCHORS_PER_PASS]
        batch = make_packed_batch(
            [sample],
            block_size=block_size,
            mask_token_id=mask_token_id,
            num_anchors=max(1, chunk.numel()),
            gamma=gamma,
            anchors=[chunk],
            layer_ids=layer_ids,
        ).to(device)
        preds = _block_predictions(model, frozen, batch, attention=attention)
        n = chunk.numel()
        labels, valid = batch.labels[:n, 1:], batch.weights[:n, 1:] > 0
        accepted_at[chunk] = accepted_lengths(preds[:n], labels, valid).cpu()
    # Anchors with no drafted slot in the response (a+1 outside it) never occur in the walk.
    return decode_walk(accepted_at, sample.loss_mask)
