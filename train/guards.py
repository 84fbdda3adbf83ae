"""What a training run refuses before step 1, and the non-finite stop during it (each one line, exit 2).

Before step 1 (`check_trainable`): a cache that no longer names its target's config hash (that would
silently disable the cache-matches-target check), an empty cache, and frozen weights that are not a
float [V, H] table covering the cache's vocabulary; then (`check_frozen_finite`, once the weights are on
the training device, in their stored dtype) NaN/inf in them: on a GPU a reduction per tensor and one
host sync, milliseconds for Qwen3-8B's 2 x [151936, 4096] where a numpy scan took seconds before the copy.

During the run (`FiniteGuard`): each optimizer step leaves one device flag (loss or gradient norm not
finite), read back only when the trainer syncs anyway (log, evaluation and checkpoint steps), so the
loop gains no per-step sync. The first flagged step stops the run before anything is written, naming
the step, its rows, and the rows whose hidden states hold NaN/inf when the cache is at fault. A NaN
weight is therefore never checkpointed nor exported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from dflash.shards import Cache
from dflash.shards.codecs import count_nonfinite
from dflash.shards.errors import ShardError

if TYPE_CHECKING:
    from .frozen import FrozenTarget

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_SHOW = 8  # rows named in a message


class NonFiniteTraining(ShardError):
    """A step's loss or gradient norm was NaN/inf: the run stops before saving or exporting anything."""


def check_trainable(cache: Cache, frozen: FrozenTarget) -> None:
    """Refuse a cache a run cannot trust or learn from (see the module docstring)."""
    m = cache.manifest
    source = f"{cache.path}/manifest.json"
    sha = m.target.get("config_sha256")
    if not isinstance(sha, str) or not _SHA256.match(sha):
        raise ShardError(
            f"{source}: target.config_sha256 is missing or malformed ({sha!r:.80}): the cache cannot be "
            "checked against its target; re-extract it"
        )
    if m.rows == 0:
        raise ValueError(
            f"{cache.path} holds no samples ({len(m.skipped)} rows skipped at extraction): nothing to train on"
        )
    vocab = m.target.get("vocab_size")
    if type(vocab) is int and frozen.vocab_size < vocab:
        raise ShardError(
            f"{cache.path}/target/frozen.safetensors: {frozen.vocab_size} embedding rows, fewer than the "
            f"target's vocab_size {vocab} the cache's token ids are checked against"
        )


def check_frozen_finite(cache: Cache, frozen: FrozenTarget) -> None:
    """Refuse NaN/inf in the frozen embed or lm_head (a tied target's one matrix counted once), counted where
    the weights are: call it after the copy to the device and before any cast, so counts are the file's."""
    weights = [("embed_tokens", frozen.embed_weight)]
    if not frozen.tied:  # a tied target's lm_head IS its embedding (stored once)
        weights.append(("lm_head", frozen.lm_head_weight))
    for name, weight in weights:
        bad = count_nonfinite(weight)
        if bad:
            raise ShardError(f"{cache.path}/target/frozen.safetensors: {name} holds {bad} NaN/inf values")


class FiniteGuard:
    """Remembers each step's rows and a device-side finiteness flag; `check()` raises on the first bad step."""

    def __init__(self, cache: Cache, layer_ids: Sequence[int], max_pending: int = 1000):
        self.cache = cache
        self.layer_ids = list(layer_ids)
        self.max_pending = max_pending
        self._pending: list[tuple[int, list[int], torch.Tensor, torch.Tensor]] = []

    def record(
        self,
        step: int,
        rows: Iterable[int],
        loss_sum: torch.Tensor,
        grad_norm: torch.Tensor | None,
        params: Iterable[torch.nn.Parameter] = (),
    ) -> None:
        """Step `step` trained on `rows`; `grad_norm` None (clipping off) computes it from `params`."""
        if grad_norm is None:
            grads = [p.grad for p in params if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        loss = loss_sum.detach().float()
        grad = grad_norm.detach().float().to(loss.device)
        self._pending.append((step, list(rows), loss, grad))
        if len(self._pending) >= self.max_pending:
            self.check()

    def check(self) -> None:
        """One device sync for every step recorded since the last check; raises NonFiniteTraining."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = torch.stack([torch.stack((loss, grad)) for _, _, loss, grad in pending]).cpu()
        finite = torch.isfinite(values).all(dim=1)
        if bool(finite.all()):
            return
        k = int((~finite).nonzero()[0])
        step, rows, _, _ = pending[k]
        loss, grad = (float(v) for v in values[k])
        raise NonFiniteTraining(f"step {step}: loss sum {loss}, gradient norm {grad}: {self._explain(rows)}")

    def _explain(self, rows: list[int]) -> str:
        """Which of the step's rows hold non-finite hidden states (decoded again: this runs once, at the end)."""
        bad: list[str] = []
        for row in rows:
            try:
                sample = self.cache.read(row, self.layer_ids)
            except (KeyError, ShardError):
                continue
            counts = {layer: count_nonfinite(x) for layer, x in sample.hidden.items()}
            counts = {layer: n for layer, n in counts.items() if n}
            if counts:
                bad.append(f"row {row} ({', '.join(f'layer {k}: {n} NaN/inf' for k, n in counts.items())})")
        shown = ", ".join(map(str, rows[:_SHOW])) + (", ..." if len(rows) > _SHOW else "")
        if bad:
            return (
                f"the cache holds non-finite hidden states in {'; '.join(bad[:_SHOW])}; run `dflash-shards "
                "verify` on the cache and re-extract it (nothing was saved or exported from this step on)"
            )
        return (
            f"the step's rows ({shown}) are finite: the run diverged; lower --lr or set --grad-clip "
            "(nothing was saved or exported from this step on)"
        )
