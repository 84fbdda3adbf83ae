"""Which target layers a drafter reads: the DFlash default rule, and the one resolver and validator that
extraction, the dry run, training and export all call.

Target layer ids are 0-based decoder-layer outputs. Two lists use them:
- a drafter's `target_layer_ids`, in feature order (the fused input is their concatenation);
- a cache's captured `layers`, sorted and distinct (what extraction stores).

The shallow-target rule, decided once: a drafter's ids MAY repeat. The default rule repeats ids when
the target has fewer than K + 3 layers (L=6, K=5 -> [1, 2, 2, 2, 3]); the drafter then reads that
layer more than once (the authors' reference does the same) and extraction stores it once. Every
released Qwen target (28 layers or more) gets distinct ids for K <= 25. (Serving engines that
capture each layer once need distinct ids: pass them explicitly for such shallow targets.)
The exported `dflash.py` keeps its own copy of `default_layer_ids` (it must load without dflash);
`tests/test_layers.py` pins the two to the same outputs.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

DEFAULT_NUM_DRAFT_LAYERS = 5


def default_layer_ids(num_target_layers: int, k: int) -> list[int]:
    """K ids evenly spaced from 1 to L-3, `round(1 + i*(L-4)/(K-1))` (Python round); K = 1 -> [L // 2].

    L=36, K=5 -> [1, 9, 17, 25, 33]; L=6, K=5 -> [1, 2, 2, 2, 3] (repeats: see the module docstring).
    """
    if num_target_layers < 1 or k < 1:
        raise ValueError(f"need num_target_layers >= 1 and k >= 1, got L={num_target_layers}, k={k}")
    if k == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"the default layer rule needs a target of >= 4 layers (got {num_target_layers}); "
            "pass the layer ids explicitly"
        )
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


def check_layer_ids(
    ids: Sequence[int], num_target_layers: int | None = None, *, what: str = "target_layer_ids"
) -> tuple[int, ...]:
    """`ids` as a tuple of ints, refused in one line naming `what` unless non-empty, integer, >= 0 and (when
    the target's depth is known) below `num_target_layers`. Repeats are allowed (module docstring)."""
    values = list(ids)
    if not values:
        raise ValueError(f"{what} is empty: name at least one target layer")
    if any(isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0 for i in values):
        raise ValueError(f"{what} must be layer ids >= 0, got {values!r}")
    values = [int(i) for i in values]
    if num_target_layers is not None:
        bad = [i for i in values if i >= num_target_layers]
        if bad:
            raise ValueError(
                f"{what} {bad} are outside [0, {num_target_layers}): the target has {num_target_layers} "
                f"layers; pick ids 0..{num_target_layers - 1}"
            )
    return tuple(values)


def resolve_layer_ids(
    num_target_layers: int,
    num_draft_layers: int,
    ids: Sequence[int] | None = None,
    *,
    cached: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """A drafter's target layer ids: `ids` when given, else the default rule for K = `num_draft_layers`;
    checked against the target's depth and, given `cached`, the layers a cache holds."""
    explicit = ids is not None
    resolved = (
        check_layer_ids(ids, num_target_layers)
        if explicit
        else check_layer_ids(default_layer_ids(num_target_layers, num_draft_layers), num_target_layers)
    )
    if cached is not None:
        if explicit:
            check_cached(resolved, cached)
        else:
            note = f" (the rule for a {num_target_layers}-layer target and {num_draft_layers} draft layers)"
            check_cached(resolved, cached, what="the default target_layer_ids", note=note)
    return resolved


def layer_ids_reason(
    num_target_layers: int, num_draft_layers: int, explicit: bool, cached: Sequence[int] | None = None
) -> str:
    """Why a drafter reads the layers `resolve_layer_ids` gave it, in words for a plan: given, or the
    default rule (with what it does on a shallow target and the cached layers it leaves unread)."""
    if explicit:
        return "as given (--target-layer-ids)"
    ids = default_layer_ids(num_target_layers, num_draft_layers)
    text = (
        f"the DFlash default rule for {num_draft_layers} draft layers on a {num_target_layers}-layer target"
    )
    if len(set(ids)) < len(ids):
        text += f" (fewer than {num_draft_layers} + 3 layers: ids repeat)"
    unread = sorted(set(cached or ()) - set(ids))
    if unread:
        every = ",".join(map(str, cached or ()))
        text += (
            f"; the cache also holds {unread}, unread: pass --target-layer-ids {every} to feed every cached "
            "layer"
        )
    return text


def check_cached(
    ids: Sequence[int], cached: Sequence[int], *, what: str = "target_layer_ids", note: str = ""
) -> None:
    """Refuse, in one line, layer ids a cache does not hold."""
    missing = sorted({i for i in ids if i not in set(cached)})
    if missing:
        raise ValueError(
            f"{what} {list(ids)}{note} are not all cached: layers {missing} missing, the cache holds "
            f"{list(cached)}; pass --target-layer-ids chosen from those or re-extract with them"
        )


def capture_layer_ids(
    num_target_layers: int,
    layers: Sequence[int] | str | None = None,
    num_draft_layers: int | None = None,
) -> list[int]:
    """The layers an extraction stores (sorted, distinct): `layers` ('all' = every layer) or the default
    rule's ids for K = `num_draft_layers` (5 when not given), each stored once."""
    if num_target_layers < 1:
        raise ValueError(f"num_hidden_layers must be >= 1, got {num_target_layers}")
    if layers is not None and num_draft_layers is not None:
        raise ValueError("give either layers or num_draft_layers, not both")
    if isinstance(layers, str):
        if layers != "all":
            raise ValueError(f"layers must be a list of ints or 'all', got {layers!r}")
        return list(range(num_target_layers))
    if layers is not None:
        return sorted(set(check_layer_ids(layers, num_target_layers, what="layer ids")))
    k = DEFAULT_NUM_DRAFT_LAYERS if num_draft_layers is None else num_draft_layers
    return sorted(set(resolve_layer_ids(num_target_layers, k)))
