"""Evaluation on held-out rows: loss, per-position accuracy, tau (sampled anchors and a decode walk).

The held-out set is fixed for the whole run (`data_plan.eval_batches`: shards in name order) and so
are its anchors (a generator seeded from the run seed), so numbers at different steps compare the
same blocks. The decode walk evaluates EVERY eligible anchor of each sequence, then replays a greedy
decode (start at the first response token, advance by A + 1): tau as serving would see it.

Prompt lookup (`lookup.py`) is measured on the same anchors: `tau_walk_lookup` is its walk, the
`walk_split_*` keys split the drafter's per-anchor acceptance by what lookup accepts there (`lookup_split.py`:
per class full / part / none, the share of anchors, the drafter's and lookup's mean accepted length and how
often the drafter accepts the whole block), and `tau_walk_max` walks max(drafter, lookup) per anchor: the
longer of the two drafts at every step, what a server verifying both at once (a two-branch tree) would get: how
complementary the two are, roughly the most that combining them can give. Not a strict upper bound of switching
between them: a longer step can land on a worse anchor, so it can even fall below one of the two walks. Lookup's
per-anchor lengths depend on the rows alone: computed once per eval set.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from dflash.shards import Cache, Sample
from dflash.shards.errors import ShardError
from dflash.shards.threads import keep_own_threads, one_torch_thread, torch_threads

from .acceptance import accepted_lengths, decode_walk, walk_tau
from .blocks import eligible_anchors
from .data_plan import SampleRef, eval_batches
from .data_spec import DataSpec, read_sample, shard_entries
from .frozen import FrozenTarget
from .lookup import lookup_accepted
from .lookup_split import SplitSums, split_sums
from .loss import LossStats, drafter_loss
from .mask import build_attention_mask, flex_scope
from .model import DFlashDrafter
from .parallelize import mixed_precision
from .walk_stats import RowWalks, row_walk, walk_se

log = logging.getLogger(__name__)
_EVAL_ANCHOR_TAG = 0x4556
_WALK_ANCHORS_PER_PASS = 1024


@dataclass(kw_only=True, slots=True)
class EvalSet:
    """The held-out batches (sample references; data is re-read at each evaluation to bound memory) and
    the shards left out because they could not be read (`--on-corrupt skip`)."""

    batches: list[list[SampleRef]]
    bad_shards: dict[str, str] = field(default_factory=dict)
    # Prompt lookup's decode-walk steps per block size: they depend on the rows alone, so the first
    # evaluation computes them and later ones report the same reference without redoing the work.
    lookup_steps: dict[int, list[int]] = field(default_factory=dict)
    # Prompt lookup's accepted length at every position of each row (-1: no anchor), per block size and
    # sample (shard, index), int16: every evaluation compares the drafter's with them, anchor by anchor.
    lookup_at: dict[int, dict[tuple[str, int], np.ndarray]] = field(default_factory=dict)

    @property
    def num_samples(self) -> int:
        return sum(len(b) for b in self.batches)


def build_eval_set(cache: Cache, spec: DataSpec) -> EvalSet:
    """Up to `spec.eval_samples` held-out rows, reading shard indexes in name order until enough are found."""
    if spec.heldout_fraction <= 0 and not spec.heldout_rows:
        return EvalSet(batches=[])
    bad: dict[str, str] = {}
    batches = eval_batches(
        cache.shard_names,
        lambda name: shard_entries(cache, name, spec.on_corrupt, bad),
        max_samples=spec.eval_samples,
        token_budget=spec.token_budget,
        max_length=spec.max_length,
        heldout_fraction=spec.heldout_fraction,
        heldout_rows=spec.heldout_rows,
    )
    return EvalSet(batches=batches, bad_shards=bad)


def _read_samples(
    cache: Cache, refs: Sequence[SampleRef], spec: DataSpec, pool: ThreadPoolExecutor
) -> tuple[list[SampleRef], list[Sample], int]:
    """The readable samples of `refs` (with their refs) and how many were corrupt (skipped under
    `--on-corrupt skip`)."""
    read, samples, skipped = [], [], 0
    for ref, result in zip(refs, pool.map(lambda r: read_sample(cache, r, spec), refs), strict=True):
        if isinstance(result, ShardError):
            skipped += 1
            log.warning("evaluation skips corrupt sample (row %d): %s", ref.row, result)
        else:
            read.append(ref)
            samples.append(result)
    return read, samples, skipped


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
    spec: DataSpec,
    *,
    device: torch.device,
    walk: bool = True,
    per_row: bool = False,
) -> dict[str, Any]:
    """Metrics over the held-out set: loss, accuracy, tau, the decode walk's tau, and how many samples were
    evaluated and skipped (`eval_samples`, `eval_skipped_samples`, `eval_skipped_shards`; only these when
    nothing could be evaluated), and its wall time (`eval_seconds`, of which `eval_walk_seconds` the drafter's
    decode walk); with the walk, prompt lookup's walk, the split by lookup's class and the max walk (see the
    module docstring). `tau_walk_se` is the walk's standard error over the held-out rows (`walk_stats`); with
    `per_row`, `walk_rows` holds each row's (tokens, steps), by dataset row id. An empty held-out set gives {}."""
    if not eval_set.batches:
        return {}
    # held-out anchors are drawn uniformly and weighed by the decay alone whatever training did, so runs with
    # other anchor odds or copy weights compare
    spec = replace(spec, copy_anchor_weight=1.0, copy_slot_weight=0.0)
    started = time.perf_counter()
    was_training = model.training
    model.eval()
    autocast = mixed_precision(device)
    total: LossStats | None = None
    walk_steps: list[int] = []
    walk_rows: RowWalks = {}
    max_steps: list[int] = []
    split = SplitSums()
    walk_seconds = 0.0
    # Prompt lookup's walk over the same rows: the free baseline to beat (once per eval set, see EvalSet).
    lookup_steps = None if spec.block_size in eval_set.lookup_steps else []
    evaluated = skipped = 0
    keep_own_threads()
    try:
        # Reading, decoding and packing are the only CPU work here. Left at the machine's width, every torch op
        # of the readers and of this thread fanned out over an OpenMP team: with six runs side by side on an
        # H200 box one evaluation took ~3.7 minutes while their training steps stayed fast (BENCHMARKS.md).
        # On CUDA this thread only packs and launches, so it runs torch on itself too; on the CPU it computes.
        with (
            ThreadPoolExecutor(
                spec.loader_threads, thread_name_prefix="dflash-eval", initializer=one_torch_thread
            ) as pool,
            torch_threads(1) if device.type == "cuda" else contextlib.nullcontext(),
            autocast,
        ):
            for index, batch_refs in enumerate(eval_set.batches):
                refs, samples, dropped = _read_samples(cache, batch_refs, spec, pool)
                skipped += dropped
                if not samples:
                    continue
                generator = torch.Generator().manual_seed(
                    spec.seed * 1_000_003 + index * 7919 + _EVAL_ANCHOR_TAG
                )
                batch = spec.pack(samples, generator=generator)
                if not bool((batch.weights > 0).any()):  # on the host, before the copy: no device sync
                    continue
                batch = batch.to(device)
                _, stats = drafter_loss(
                    model, frozen, batch, attn_mask=build_attention_mask(batch, spec.attention)
                )
                total = stats if total is None else total.merge(stats)
                evaluated += len(samples)
                if walk:
                    walk_started = time.perf_counter()  # the drafter's walk alone: comparable at every step
                    drafter_at = _accepted_on_host(model, frozen, samples, spec, device=device)
                    for sample, steps in zip(samples, _walks(samples, drafter_at), strict=True):
                        walk_steps.extend(steps)
                        walk_rows[sample.row] = row_walk(steps)
                    walk_seconds += time.perf_counter() - walk_started
                    for ref, sample, accepted_at in zip(refs, samples, drafter_at, strict=True):
                        lookup_at = _lookup_at(eval_set, ref, sample, spec.block_size)
                        loss_mask = sample.loss_mask.numpy()
                        if lookup_steps is not None:
                            lookup_steps.extend(decode_walk(lookup_at, sample.loss_mask))
                        split += split_sums(
                            accepted_at.numpy(), lookup_at.numpy(), spec.block_size, loss_mask
                        )
                        max_steps.extend(decode_walk(torch.maximum(accepted_at, lookup_at), sample.loss_mask))
    finally:
        model.train(was_training)
    counts = {
        "eval_samples": evaluated,
        "eval_skipped_samples": skipped,
        "eval_skipped_shards": len(eval_set.bad_shards),
    }
    if total is None:
        return counts
    if lookup_steps is not None and walk:
        eval_set.lookup_steps[spec.block_size] = lookup_steps
    lookup = eval_set.lookup_steps.get(spec.block_size, [])
    timing = {"eval_seconds": round(time.perf_counter() - started, 3)}
    if walk:
        timing["eval_walk_seconds"] = round(walk_seconds, 3)
    comparison = ({"tau_walk_max": walk_tau(max_steps)} | split.metrics()) if walk_steps else {}
    if walk_steps:
        se = walk_se(walk_rows)
        if not math.isnan(se):  # one held-out row has no spread to measure
            comparison["tau_walk_se"] = se
        if per_row:
            comparison["walk_rows"] = walk_rows
    return _summary(total, walk_steps, lookup, spec.block_size) | comparison | counts | timing


def _summary(
    total: LossStats, walk_steps: list[int], lookup_steps: list[int], block_size: int
) -> dict[str, Any]:
    summary = total.summary()
    result: dict[str, Any] = {
        "eval_loss": summary["loss"],
        "eval_acc": summary["acc"],
        "tau": summary["tau"],
        "eval_blocks": int(summary["blocks"]),
        "acc_per_position": [summary[f"acc_{k}"] for k in range(1, block_size)],
        "acceptance_per_position": [summary[f"accept_{k}"] for k in range(1, block_size)],
    }
    if walk_steps:
        result["tau_walk"] = walk_tau(walk_steps)
        result["walk_steps"] = len(walk_steps)
        result["tau_walk_lookup"] = walk_tau(lookup_steps)
    return {k: v for k, v in result.items() if not (isinstance(v, float) and math.isnan(v))}


def _walks(samples: Sequence[Sample], accepted: Sequence[torch.Tensor]) -> list[list[int]]:
    """The decode walk of each sample over its per-position accepted lengths (A per step). Anchors with no
    drafted slot in the response (a+1 outside it) never occur in a walk."""
    return [decode_walk(at, sample.loss_mask) for sample, at in zip(samples, accepted, strict=True)]


def _accepted_on_host(
    model: DFlashDrafter,
    frozen: FrozenTarget,
    samples: Sequence[Sample],
    spec: DataSpec,
    *,
    device: torch.device,
) -> list[torch.Tensor]:
    """Per sample, [S] long on the host: the drafter's A at every eligible anchor, -1 elsewhere. The lengths stay
    on the device until every sample's passes are queued (one sync, not one per sample: the host keeps launching
    while the GPU works)."""
    accepted = [_accepted_at(model, frozen, sample, spec, device=device) for sample in samples]
    lengths = [a.numel() for a in accepted]
    return list(torch.cat(accepted).cpu().split(lengths))


def _accepted_at(
    model: DFlashDrafter, frozen: FrozenTarget, sample: Sample, spec: DataSpec, *, device: torch.device
) -> torch.Tensor:
    """[S] on `device`: A for the block anchored at each position of one sequence, -1 where none is computed."""
    # Walk batches change shape with every sample, and inductor has failed to lower FlexAttention for some
    # of them (H200, torch 2.11): under "flex" the walk uses "auto" (dense when small, a fallback when not),
    # in a scope of its own so that a fallback here leaves training on FlexAttention.
    attention = "dense" if spec.attention == "dense" else "auto"
    anchors = eligible_anchors(sample.loss_mask)
    accepted_at = torch.full((sample.length,), -1, dtype=torch.long, device=device)
    for start in range(0, anchors.numel(), _WALK_ANCHORS_PER_PASS):
        chunk = anchors[start : start + _WALK_ANCHORS_PER_PASS]
        batch = spec.pack([sample], anchors=[chunk], num_anchors=max(1, chunk.numel())).to(device)
        with flex_scope("decode walk"):
            preds = _block_predictions(model, frozen, batch, attention=attention)
        n = chunk.numel()
        labels, valid = batch.labels[:n, 1:], batch.weights[:n, 1:] > 0
        accepted_at[chunk.to(device)] = accepted_lengths(preds[:n], labels, valid)
    return accepted_at


def _lookup_at(eval_set: EvalSet, ref: SampleRef, sample: Sample, block_size: int) -> torch.Tensor:
    """[S] long: prompt lookup's (vLLM's `ngram`, n <= 4) A drafting B - 1 tokens at every anchor of one row,
    -1 elsewhere; computed on the row's first evaluation, then read from `eval_set.lookup_at`."""
    cached = eval_set.lookup_at.setdefault(block_size, {})
    key = (ref.shard, ref.index)
    if key not in cached:
        accepted = lookup_accepted(sample.input_ids.numpy(), sample.loss_mask.numpy(), block_size - 1)
        cached[key] = accepted.astype(np.int16)
    return torch.from_numpy(cached[key].astype(np.int64))
