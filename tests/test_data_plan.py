"""Pure planning: hold-out split, shard order, window shuffle, packing, rank groups (no I/O)."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from dflash.train.data_plan import (
    ORDERS,
    SPAN_SAMPLES,
    SampleRef,
    ShardEntries,
    epoch_batches,
    eval_batches,
    group_for_ranks,
    heldout_mask,
    pack_by_budget,
    shard_order,
    stored_spans,
    window_shuffle,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _shards(lengths_per_shard: list[list[int]], supervised: int = 5) -> dict[str, ShardEntries]:
    out, row = {}, 0
    for k, lengths in enumerate(lengths_per_shard):
        n = len(lengths)
        out[f"shard-{k:06d}.dfs"] = ShardEntries(
            rows=np.arange(row, row + n, dtype=np.int64),
            lengths=np.array(lengths, dtype=np.int64),
            supervised=np.full(n, supervised, dtype=np.int64),
        )
        row += n
    return out


def _listing(shards: dict[str, ShardEntries]) -> list[tuple[str, int]]:
    """What the loader passes the plan: (name, stored samples) per shard, from the manifest."""
    return [(name, len(e.rows)) for name, e in shards.items()]


def _cut(lengths: list[int], cuts: list[int]) -> dict[str, ShardEntries]:
    """One stored order (row i has lengths[i]) cut into shards at `cuts`, as two codecs' caches are."""
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(lengths))), len(lengths)]
    return _shards([lengths[a:b] for a, b in itertools.pairwise(bounds)])


def test_heldout_is_a_fixed_function_of_the_row() -> None:
    rows = np.arange(200_000)
    mask = heldout_mask(rows, 0.05)
    assert 0.045 < mask.mean() < 0.055
    np.testing.assert_array_equal(mask, heldout_mask(rows[::-1], 0.05)[::-1])  # order-independent
    assert not heldout_mask(rows, 0.0).any()
    explicit = heldout_mask(np.array([3, 4, 5]), 0.0, frozenset({4}))
    assert explicit.tolist() == [False, True, False]
    # Nested: a larger fraction holds out a superset (rows never move from eval back to train).
    assert (heldout_mask(rows, 0.01) <= heldout_mask(rows, 0.05)).all()


def test_shard_order_is_a_seeded_permutation() -> None:
    names = [f"shard-{i:06d}.dfs" for i in range(50)]
    a = shard_order(names, seed=1, epoch=0)
    assert sorted(a) == names
    assert a == shard_order(list(reversed(names)), seed=1, epoch=0)
    assert a != shard_order(names, seed=1, epoch=1)
    assert a != shard_order(names, seed=2, epoch=0)


@given(st.lists(st.integers(0, 1000), max_size=300), st.integers(1, 64), st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_window_shuffle_is_a_permutation(values: list[int], window: int, seed: int) -> None:
    items = [SampleRef("s", i, v, 1) for i, v in enumerate(values)]
    out = list(window_shuffle(items, window, np.random.default_rng(seed)))
    assert sorted(out, key=lambda r: r.index) == items
    # Bounded: the item yielded at position p was read at most `window` items earlier... or later.
    for pos, item in enumerate(out):
        assert item.index <= pos + window


@given(st.lists(st.integers(1, 50), max_size=200), st.integers(50, 200))
@settings(max_examples=60, deadline=None)
def test_pack_by_budget_keeps_order_and_budget(lengths: list[int], budget: int) -> None:
    items = [SampleRef("s", i, i, n) for i, n in enumerate(lengths)]
    batches = list(pack_by_budget(items, budget))
    assert [x for b in batches for x in b] == items
    assert all(sum(x.length for x in b) <= budget for b in batches)
    # Greedy: a batch closed only because the next sample did not fit.
    for b, nxt in itertools.pairwise(batches):
        assert sum(x.length for x in b) + nxt[0].length > budget


@given(
    st.lists(st.lists(st.integers(1, 40), min_size=0, max_size=30), min_size=1, max_size=8),
    st.integers(1, 4),
    st.integers(0, 5),
    st.sampled_from([0.0, 0.2]),
)
@settings(max_examples=60, deadline=None)
def test_ranks_together_see_every_sample_once(shard_lengths, world, seed, fraction) -> None:
    shards = _shards(shard_lengths)
    budget = 64
    order = ORDERS[seed % 2]
    stream = epoch_batches(
        _listing(shards),
        shards.__getitem__,
        order=order,
        seed=seed,
        epoch=0,
        window=7,
        token_budget=budget,
        max_length=40,
        heldout_fraction=fraction,
    )
    groups = list(group_for_ranks(stream, world))
    assert all(len(g) == world for g in groups)  # equal step counts on every rank (DDP needs it)
    seen = Counter(ref.row for g in groups for batch in g for ref in batch)
    all_rows = np.concatenate([e.rows for e in shards.values()])
    expected = set(all_rows[~heldout_mask(all_rows, fraction)].tolist())
    assert set(seen) == expected and all(c == 1 for c in seen.values())
    assert all(sum(r.length for r in batch) <= budget for g in groups for batch in g)
    assert all(batch for g in groups[:-1] for batch in g)  # only the epoch's last group may hold fillers


def test_epoch_plan_is_deterministic_and_lazy() -> None:
    shards = _shards([[10] * 20 for _ in range(30)])
    opened: list[str] = []

    def entries_of(name: str) -> ShardEntries:
        opened.append(name)
        return shards[name]

    kwargs = dict(seed=3, window=8, token_budget=40, max_length=40, heldout_fraction=0.1)
    listing = _listing(shards)
    first = next(epoch_batches(listing, entries_of, epoch=0, **kwargs))
    # the first batch needs its span's shard indexes (64 samples: 4-5 shards of 20), not the whole cache
    assert 1 <= len(opened) <= SPAN_SAMPLES // 20 + 2
    opened.clear()
    next(epoch_batches(listing, entries_of, epoch=0, order="shards", **kwargs))
    assert len(opened) == 1  # the shard order reads one
    a = [[r.row for r in b] for b in epoch_batches(listing, shards.__getitem__, epoch=0, **kwargs)]
    b = [[r.row for r in b] for b in epoch_batches(listing, shards.__getitem__, epoch=0, **kwargs)]
    c = [[r.row for r in b] for b in epoch_batches(listing, shards.__getitem__, epoch=1, **kwargs)]
    assert a == b and a != c and a[0] == [r.row for r in first]


@given(st.lists(st.integers(0, 300), max_size=12), st.integers(1, 100))
@settings(max_examples=100, deadline=None)
def test_stored_spans_cut_the_stored_order(counts: list[int], span: int) -> None:
    listing = [(f"shard-{k:06d}.dfs", n) for k, n in enumerate(counts)]
    spans = stored_spans(listing[::-1], span)  # the manifest's order does not matter: names do
    flat = [(name, i) for sp in spans for name, start, stop in sp for i in range(start, stop)]
    assert flat == [(name, i) for name, n in listing for i in range(n)]
    sizes = [sum(stop - start for _, start, stop in sp) for sp in spans]
    assert all(size == span for size in sizes[:-1]) and (not sizes or 0 < sizes[-1] <= span)
    assert all(stop > start for sp in spans for _, start, stop in sp)


@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=400),
    st.lists(st.integers(0, 400), max_size=10),
    st.lists(st.integers(0, 400), max_size=10),
    st.integers(0, 3),
    st.integers(0, 2),
)
@settings(max_examples=60, deadline=None)
def test_caches_cut_differently_train_on_the_same_batches(lengths, cuts_a, cuts_b, seed, epoch) -> None:
    """Lossless, fp8 and q4 caches of one dataset hold one stored order under different shard cuts."""
    kwargs = dict(seed=seed, epoch=epoch, window=16, token_budget=64, max_length=40, heldout_fraction=0.1)
    rows = []
    for cuts in (cuts_a, cuts_b):
        shards = _cut(lengths, cuts)
        rows.append(
            [[r.row for r in b] for b in epoch_batches(_listing(shards), shards.__getitem__, **kwargs)]
        )
    assert rows[0] == rows[1]


def test_the_shard_order_gave_each_cut_its_own_batches() -> None:
    """Why spans: under the shard order the same stored samples cut in 2 and in 3 shards trained apart."""
    lengths = [10] * 300
    kwargs = dict(seed=0, epoch=0, window=16, token_budget=40, max_length=40, heldout_fraction=0.0)
    a, b = _cut(lengths, [150]), _cut(lengths, [100, 200])
    for order, same in (("shards", False), ("spans", True)):
        batches = [
            [
                [r.row for r in batch]
                for batch in epoch_batches(_listing(s), s.__getitem__, order=order, **kwargs)
            ]
            for s in (a, b)
        ]
        assert (batches[0] == batches[1]) is same


def test_each_shard_index_is_read_once_an_epoch() -> None:
    shards = _shards([[10] * 37 for _ in range(9)])  # spans of 64 straddle every shard boundary
    opened: Counter[str] = Counter()

    def entries_of(name: str) -> ShardEntries:
        opened[name] += 1
        return shards[name]

    kwargs = dict(seed=1, window=8, token_budget=40, max_length=40, heldout_fraction=0.0)
    refs = [r for b in epoch_batches(_listing(shards), entries_of, epoch=0, **kwargs) for r in b]
    assert opened == Counter(dict.fromkeys(shards, 1))
    assert sorted((r.shard, r.index) for r in refs) == [(n, i) for n in shards for i in range(37)]
    with pytest.raises(ValueError, match="order='rows'"):
        next(epoch_batches(_listing(shards), entries_of, epoch=0, order="rows", **kwargs))


def test_samples_without_anchor_and_long_samples() -> None:
    shards = _shards([[5, 100, 7]])
    shards["shard-000000.dfs"].supervised[0] = 1  # one supervised token: no anchor pair, never trained on
    batches = list(
        epoch_batches(
            _listing(shards),
            shards.__getitem__,
            seed=0,
            epoch=0,
            window=1,
            token_budget=64,
            max_length=64,
            heldout_fraction=0.0,
        )
    )
    refs = [r for b in batches for r in b]
    assert sorted(r.row for r in refs) == [1, 2]
    assert {r.row: r.length for r in refs}[1] == 64  # truncated to max_length


def test_eval_batches_are_only_heldout_rows() -> None:
    shards = _shards([[10] * 50 for _ in range(4)])
    batches = eval_batches(
        list(shards), shards.__getitem__, max_samples=12, token_budget=30, max_length=40, heldout_fraction=0.2
    )
    rows = np.array([r.row for b in batches for r in b])
    assert 0 < len(rows) <= 12 and heldout_mask(rows, 0.2).all()
    assert batches == eval_batches(
        list(shards), shards.__getitem__, max_samples=12, token_budget=30, max_length=40, heldout_fraction=0.2
    )


@pytest.mark.parametrize("world", [2, 3])
def test_epoch_tail_is_split_not_dropped(world: int) -> None:
    items = [SampleRef("s", i, i, 10) for i in range(5)]
    groups = list(group_for_ranks([items], world))  # one batch, several ranks
    assert len(groups) == 1 and len(groups[0]) == world
    assert sorted(r.row for b in groups[0] for r in b) == list(range(5))
    assert all(groups[0])
