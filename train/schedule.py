"""The learning-rate schedule and the run's length in optimizer steps (pure: no torch, no I/O)."""

from __future__ import annotations

import math
from typing import Any

from .config import TrainConfig


def lr_at(step: int, *, base_lr: float, warmup_steps: int, total_steps: int, min_lr_frac: float) -> float:
    """Linear warmup over `warmup_steps`, then cosine from `base_lr` down to `min_lr_frac * base_lr`."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return base_lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def estimate_total_steps(manifest: Any, cfg: TrainConfig, world_size: int) -> int:
    """Optimizer steps of the whole run from the manifest's totals (no shard is read).

    Greedy packing fills a batch to about budget - mean_length/2; the estimate only shapes the
    cosine tail, and is stored in the checkpoint so a resume keeps the same schedule.
    """
    rows = max(1, manifest.rows)
    mean_len = min(manifest.tokens / rows, cfg.data.max_length)
    tokens = rows * mean_len * (1 - cfg.data.eval_fraction)
    per_batch = max(mean_len, cfg.data.token_budget - mean_len / 2)
    batches = math.ceil(tokens / per_batch)
    steps = math.ceil(batches / (world_size * cfg.optim.grad_accum)) * cfg.optim.epochs
    return max(1, min(steps, cfg.optim.max_steps) if cfg.optim.max_steps else steps)
