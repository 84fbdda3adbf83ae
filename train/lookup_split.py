"""Where the drafter loses to prompt lookup: its acceptance split by what lookup does on the same anchor.

Every eligible anchor (the decode walk's) falls in one class by lookup's accepted length L out of the block's
B - 1 drafted slots: `full` (L = B - 1: the continuation repeats the context), `part` (1 <= L <= B - 2) or
`none` (L = 0: nothing to copy). Near the end of its response span an anchor has fewer than B - 1 slots to
accept (its room): there `full` means lookup accepts every slot the span leaves (it copies to the end).
Per class: the share of anchors in it, the drafter's and lookup's mean accepted length there (drafted tokens
accepted, without the target's bonus token) and the share of its anchors where the drafter accepts the whole
block. Low drafter means under `full` say the drafter has not learned to copy; high ones under `none` are what
it adds over copying.

Public API (pure numpy):
    CLASSES = ("full", "part", "none")
    split_sums(drafter_at, lookup_at, block_size, loss_mask=None) -> SplitSums
        per-position accepted lengths of one sequence, -1 where no block was computed; the two must mark the
        same anchors. With the sequence's loss mask, each anchor's room is the slots left in its span.
    span_room(loss_mask, block_size) -> [S]: the drafted slots of a block at each position that lie in the
        response (consecutive loss-mask ones after it, at most B - 1).
    SplitSums: per-class sums; `a + b` merges, `.metrics()` gives the flat `walk_split_*` keys
        (walk_split_anchors, walk_split_<class>_share, _drafter, _lookup, _drafter_full).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

CLASSES = ("full", "part", "none")
_FULL, _PART, _NONE = range(3)


@dataclass(frozen=True, slots=True)
class SplitSums:
    """Per class (CLASSES order): anchors, summed drafter and lookup accepted lengths, drafter whole blocks."""

    anchors: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))
    drafter: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))
    lookup: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))
    drafter_full: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))

    def __add__(self, other: SplitSums) -> SplitSums:
        return SplitSums(
            anchors=self.anchors + other.anchors,
            drafter=self.drafter + other.drafter,
            lookup=self.lookup + other.lookup,
            drafter_full=self.drafter_full + other.drafter_full,
        )

    def metrics(self) -> dict[str, float | int]:
        """Flat `walk_split_*` keys; a class with no anchor has share 0 and no means (they would be nan)."""
        total = int(self.anchors.sum())
        result: dict[str, float | int] = {"walk_split_anchors": total}
        if total == 0:
            return result
        for index, name in enumerate(CLASSES):
            n = int(self.anchors[index])
            result[f"walk_split_{name}_share"] = n / total
            if n:
                result[f"walk_split_{name}_drafter"] = float(self.drafter[index]) / n
                result[f"walk_split_{name}_lookup"] = float(self.lookup[index]) / n
                result[f"walk_split_{name}_drafter_full"] = float(self.drafter_full[index]) / n
        return result


def span_room(loss_mask: np.ndarray, block_size: int) -> np.ndarray:
    """[S] int64: per position a, how many of slots a+1 .. a+B-1 are consecutive loss-mask ones."""
    mask = np.asarray(loss_mask).astype(bool)
    index = np.arange(mask.size + 1)
    # the first zero at or after each position (a zero past the end): ones from i on = that zero's index - i
    next_zero = np.minimum.accumulate(np.where(np.append(mask, False), index.size, index)[::-1])[::-1]
    return np.minimum(next_zero[1:] - index[1:], block_size - 1)


def split_sums(
    drafter_at: np.ndarray, lookup_at: np.ndarray, block_size: int, loss_mask: np.ndarray | None = None
) -> SplitSums:
    """The per-class sums over the anchors of one sequence (see the module docstring)."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (one drafted slot at least), got {block_size}")
    drafter, lookup = np.asarray(drafter_at), np.asarray(lookup_at)
    if drafter.shape != lookup.shape or drafter.ndim != 1:
        raise ValueError(
            f"drafter {drafter.shape} and lookup {lookup.shape} accepted lengths must be one flat shape"
        )
    anchors = drafter >= 0
    if not np.array_equal(anchors, lookup >= 0):
        raise ValueError("the drafter's and prompt lookup's accepted lengths mark different anchors")
    if loss_mask is not None and np.shape(loss_mask) != drafter.shape:
        raise ValueError(
            f"loss mask {np.shape(loss_mask)} and accepted lengths {drafter.shape} differ in shape"
        )
    whole = block_size - 1
    drafter, lookup = drafter[anchors].astype(np.int64), lookup[anchors].astype(np.int64)
    if drafter.size and max(int(drafter.max()), int(lookup.max())) > whole:
        raise ValueError(f"an accepted length exceeds the block's {whole} drafted slots")
    room = np.full(drafter.shape, whole) if loss_mask is None else span_room(loss_mask, block_size)[anchors]
    if drafter.size and (np.maximum(drafter, lookup) > room).any():
        raise ValueError("an accepted length exceeds the slots its anchor's span leaves")
    classes = np.where((lookup == room) & (room > 0), _FULL, np.where(lookup == 0, _NONE, _PART))
    return SplitSums(
        anchors=np.bincount(classes, minlength=3),
        drafter=np.bincount(classes, weights=drafter, minlength=3).astype(np.int64),
        lookup=np.bincount(classes, weights=lookup, minlength=3).astype(np.int64),
        drafter_full=np.bincount(classes, weights=drafter == room, minlength=3).astype(np.int64),
    )
