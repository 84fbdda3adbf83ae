"""The drafter's acceptance split by what prompt lookup accepts on the same anchor (`train/lookup_split.py`)."""

from __future__ import annotations

import numpy as np
import pytest
from dflash.train.lookup_split import CLASSES, SplitSums, split_sums

# B = 4: a whole block is 3 drafted tokens. Positions 0 and 7 hold no anchor (-1 in both).
LOOKUP = np.array([-1, 3, 3, 2, 1, 2, 0, -1])
DRAFTER = np.array([-1, 3, 1, 3, 1, 0, 2, -1])


def test_anchors_fall_in_the_class_of_lookups_accepted_length() -> None:
    metrics = split_sums(DRAFTER, LOOKUP, block_size=4).metrics()
    assert metrics == pytest.approx(
        {
            "walk_split_anchors": 6,
            # full: lookup accepts all B - 1 = 3 (positions 1, 2)
            "walk_split_full_share": 2 / 6,
            "walk_split_full_drafter": (3 + 1) / 2,
            "walk_split_full_lookup": 3.0,
            "walk_split_full_drafter_full": 1 / 2,
            # part: B - 2 = 2 is not the whole block (positions 3, 4, 5)
            "walk_split_part_share": 3 / 6,
            "walk_split_part_drafter": (3 + 1 + 0) / 3,
            "walk_split_part_lookup": (2 + 1 + 2) / 3,
            "walk_split_part_drafter_full": 1 / 3,
            # none: lookup accepts nothing (position 6); the drafter's 2 of 3 is not a whole block
            "walk_split_none_share": 1 / 6,
            "walk_split_none_drafter": 2.0,
            "walk_split_none_lookup": 0.0,
            "walk_split_none_drafter_full": 0.0,
        }
    )


def test_sums_over_pieces_add_up_to_the_whole() -> None:
    whole = split_sums(DRAFTER, LOOKUP, 4)
    pieces = split_sums(DRAFTER[:4], LOOKUP[:4], 4) + split_sums(DRAFTER[4:], LOOKUP[4:], 4)
    assert pieces.metrics() == whole.metrics()
    assert (SplitSums() + whole).metrics() == whole.metrics()


def test_an_empty_class_has_a_zero_share_and_no_means() -> None:
    metrics = split_sums(np.array([0, 1, -1]), np.array([1, 2, -1]), block_size=4).metrics()
    assert metrics["walk_split_part_share"] == 1.0
    for name in ("full", "none"):
        assert metrics[f"walk_split_{name}_share"] == 0.0
        assert f"walk_split_{name}_drafter" not in metrics
    assert SplitSums().metrics() == {"walk_split_anchors": 0}
    assert set(CLASSES) == {"full", "part", "none"}


@pytest.mark.parametrize(
    ("drafter", "lookup", "block_size", "message"),
    [
        ([0, -1], [0, 0], 4, "different anchors"),
        ([0, 4], [0, 0], 4, "exceeds the block's 3"),
        ([0, 0], [0, 4], 4, "exceeds the block's 3"),
        ([0, 0], [0, 0, 0], 4, "one flat shape"),
        ([0], [0], 1, "block_size must be >= 2"),
    ],
)
def test_inconsistent_inputs_are_named(drafter, lookup, block_size, message) -> None:
    with pytest.raises(ValueError, match=message):
        split_sums(np.array(drafter), np.array(lookup), block_size)


def test_an_anchor_near_its_spans_end_is_full_when_lookup_copies_to_the_end() -> None:
    # B = 4; the response is positions 2..6, then prompt again at 7. The anchor at 5 has one slot left (6),
    # the anchor at 4 two (5, 6): lookup accepting all of them is a whole copy, not `part`.
    mask = np.array([0, 0, 1, 1, 1, 1, 1, 0])
    lookup = np.array([-1, 3, 3, 2, 2, 1, -1, -1])
    drafter = np.array([-1, 1, 3, 1, 2, 0, -1, -1])
    metrics = split_sums(drafter, lookup, 4, mask).metrics()
    assert metrics["walk_split_full_share"] == pytest.approx(4 / 5)  # anchors 1, 2, 4, 5
    assert metrics["walk_split_full_drafter_full"] == pytest.approx(2 / 4)  # 2 (3 of 3), 4 (2 of 2)
    assert metrics["walk_split_part_share"] == pytest.approx(1 / 5)  # anchor 3: 2 of 3
    assert split_sums(drafter, lookup, 4).metrics()["walk_split_full_share"] == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="slots its anchor's span leaves"):
        split_sums(drafter, np.array([-1, 3, 3, 2, 3, 1, -1, -1]), 4, mask)


def test_span_room_counts_consecutive_response_slots() -> None:
    from dflash.train.lookup_split import span_room

    mask = np.array([0, 1, 1, 0, 1, 1, 1, 1, 1])
    assert span_room(mask, 4).tolist() == [2, 1, 0, 3, 3, 3, 2, 1, 0]
