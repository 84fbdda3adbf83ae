"""Loss weights over a block's slots that follow how far the drafter's drafts get accepted (`--slot-weights reach`).

A block's acceptance length is tau = 1 + sum_m P(A >= m), A the accepted prefix of its B - 1 drafted slots, and
P(A >= m) = a_1 ... a_m with a_k the chance slot k is right once slots 1..k-1 were. So

    d tau / d log a_k = sum_{m >= k} P(A >= m) = E[max(A - k + 1, 0)]  =: R_k,

the accepted tokens expected at slot k or later. Weighting slot k's cross-entropy by R_k / R_1 spends the
gradient where it buys tau. The paper's fixed decay exp(-(k-1)/gamma) is this rule for one drafter: with a
constant a_k = a, R_k / R_1 = a^(k-1), gamma = -1 / ln a, and its gamma 7 for B = 16 fits a drafter that accepts
~6-7 tokens. A drafter that accepts 2-4 does better with gamma 1-2 (BENCHMARKS.md, "The loss decay gamma"),
and the best gamma grows as it learns: this rule tracks it. The rule alone starves slots no draft reaches
yet (R_k ~ 0, so they never learn and never get reached); a floor, the fixed decay with a small gamma, keeps
them learning:

    w_k = max(exp(-(k-1)/gamma), R_k / R_1),   w_0 = 0 (the anchor is given).

The loader builds each batch's weights with the floor; the trainer multiplies slot k by
`scale_k = w_k / floor_k` (`ReachWeights`), updated at each log step from the acceptance tallied on the
training batches since the last one, summed over ranks, so every rank weighs alike. The logged training loss
is weighed the same way, so it moves with the weights; `eval_loss` keeps the floor's decay.

Public API:
    reach_weights(accept_at_least, floor) -> list[float]    w over slots 0..B-1 from P(A >= k) tallies
    ReachWeights(block_size, floor_gamma, device)           the trainer's state: `.scale` [B] on the device,
        `.add(accept_at_least)`, `.update(reduce_sum)`, `.weight_sum(slot_sums)`, `.state_dict()` / `.load_state_dict`
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .blocks import slot_weights


def reach_weights(accept_at_least: Sequence[float], floor: Sequence[float]) -> list[float]:
    """Slot weights [B] from `accept_at_least[k]` = blocks whose accepted prefix is >= k (k = 0: all blocks)
    and the floor weights [B]. With no block tallied, or none accepting a single slot, the floor."""
    b = len(floor)
    if len(accept_at_least) != b:
        raise ValueError(f"{len(accept_at_least)} acceptance tallies for {b} slots")
    blocks = float(accept_at_least[0])
    if not blocks > 0:
        return [float(w) for w in floor]
    reach = [0.0] * (b + 1)  # reach[k] = R_k = sum_{m >= k} P(A >= m)
    for k in range(b - 1, 0, -1):
        reach[k] = reach[k + 1] + float(accept_at_least[k]) / blocks
    if not reach[1] > 0:
        return [float(w) for w in floor]
    return [0.0] + [max(float(floor[k]), reach[k] / reach[1]) for k in range(1, b)]


class ReachWeights:
    """Per-slot factors over the loader's floor weights; all-ones until the first update."""

    def __init__(self, block_size: int, floor_gamma: float, device: torch.device) -> None:
        self.floor = slot_weights(block_size, floor_gamma).tolist()
        self.device = device
        self.factors = [1.0] * block_size
        self.scale = torch.ones(block_size, device=device)
        self.tally = torch.zeros(block_size, dtype=torch.float64, device=device)  # since the last update

    def add(self, accept_at_least: torch.Tensor) -> None:
        """Count one batch's blocks by accepted prefix (a device add: no sync)."""
        self.tally += accept_at_least.double()

    def weight_sum(self, slot_sums: Sequence[float]) -> float:
        """The loss-weight sum of a batch whose floor weights add up to `slot_sums` per slot (host floats)."""
        return sum(f * s for f, s in zip(self.factors, slot_sums, strict=True))

    def update(self, reduce_sum: Callable[[list[float]], list[float]]) -> list[float]:
        """New factors from the tallies of every rank (`reduce_sum`, a collective); returns the weights."""
        tallies = reduce_sum(self.tally.tolist())
        self.tally.zero_()
        weights = reach_weights(tallies, self.floor)
        self._set([w / f if f > 0 else 0.0 for w, f in zip(weights, self.floor, strict=True)])
        return weights

    def state_dict(self, reduce_sum: Callable[[list[float]], list[float]]) -> dict[str, Any]:
        """JSON state: the factors and the tallies of every rank since the last update (a collective)."""
        return {"factors": list(self.factors), "tally": reduce_sum(self.tally.tolist())}

    def load_state_dict(self, state: dict[str, Any], *, is_main: bool) -> None:
        """The saved tallies are every rank's sum: rank 0 takes them, the others start from zero."""
        factors, tally = state["factors"], state["tally"]
        if len(factors) != len(self.factors) or len(tally) != len(self.factors):
            raise ValueError(
                f"slot weight state for {len(factors)} slots, the drafter has {len(self.factors)}"
            )
        self._set([float(f) for f in factors])
        self.tally = torch.tensor(
            tally if is_main else [0.0] * len(tally), dtype=torch.float64, device=self.device
        )

    def _set(self, factors: list[float]) -> None:
        self.factors = factors
        self.scale = torch.tensor(factors, dtype=torch.float32, device=self.device)
