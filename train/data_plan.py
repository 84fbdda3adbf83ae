"""Pure planning for the training loader: which samples, in which order, in which batch, on which rank.

No I/O here: a shard's index is fetched through the `entries_of` callable the loader passes in, and
only when the plan reaches that shard, so nothing scans the cache before the first batch. Everything
is a function of (seed, epoch, the shards' sample counts and indexes), never of time or thread
scheduling, which is what makes the data position resumable exactly and identical on every rank.

Epoch plan: the cache's stored order (shards in name order, samples in stored order) cut into spans of
`SPAN_SAMPLES` -> the spans in a seeded permutation -> held-out rows dropped -> a bounded-window shuffle ->
greedy packing to a token budget (the global batch stream, independent of the world size) -> groups
of `world_size` consecutive batches, rank r taking batch r of each group.

Why spans, not shards: extraction cuts its stored order into shards by stored bytes, so lossless, fp8 and
q4 caches of one dataset (or one extracted with another `--unit-bytes`, or converted) hold the same samples
in the same order under different cuts. Permuting shards gave each cache its own batches: two runs of one
seed on two codecs trained on two data orders, and a codec's gap to lossless carried the data order's
variance. Spans give every such cache the same batches, and the same anchors with them. The stored order is
extraction's, longest rows first, so a shard is a stretch of similar lengths: a cache of two big shards was
trained in near length order, where the window now mixes ~window / SPAN_SAMPLES random stretches whatever the
shard size. `--data-order shards` keeps the old order: a run started before spans resumes with it (its
`--resume` names the flag), and a fresh run can reproduce an older one's batches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

_HOLDOUT_SALT = np.uint64(0x9E3779B97F4A7C15)
_SHARD_ORDER_TAG = 0x5348
_SPAN_ORDER_TAG = 0x5350
_WINDOW_TAG = 0x5749
SPAN_SAMPLES = 64  # stored samples per span: the window (1024 by default) mixes ~16 stretches of the order
ORDERS = ("spans", "shards")  # an epoch's order: spans of the stored order; shards, for runs started before


@dataclass(frozen=True, slots=True)
class SampleRef:
    """One sample to train on: where it lives and how many tokens it contributes (after truncation)."""

    shard: str
    index: int
    row: int
    length: int


@dataclass(frozen=True, slots=True)
class ShardEntries:
    """A shard's index as the plan needs it: per-sample position, row id, length, supervised tokens."""

    rows: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int64 [n]
    supervised: np.ndarray  # int64 [n]; samples with < 2 supervised tokens have no anchor and are skipped


EntriesOf = Callable[[str], ShardEntries]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _HOLDOUT_SALT
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def heldout_mask(rows: np.ndarray, fraction: float, explicit: frozenset[int] = frozenset()) -> np.ndarray:
    """True for rows kept out of training: a fixed hash of the row id below `fraction`, or listed.

    The hash depends only on the row id (not on the seed, shard or world size), so the same rows
    are held out by every run over every cache extracted from the same dataset.
    """
    rows = np.asarray(rows, dtype=np.int64)
    unit = (_splitmix64(rows) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    mask = unit < fraction
    if explicit:
        mask |= np.isin(rows, np.fromiter(explicit, dtype=np.int64, count=len(explicit)))
    return mask


def shard_order(names: Sequence[str], seed: int, epoch: int) -> list[str]:
    """The shards of one epoch in a seeded permutation of their sorted names (the `shards` order)."""
    ordered = sorted(names)
    perm = np.random.default_rng([seed, epoch, _SHARD_ORDER_TAG]).permutation(len(ordered))
    return [ordered[i] for i in perm]


Piece = tuple[str, int, int | None]  # (shard, first stored sample, end; None: the shard's end)


def stored_spans(shards: Sequence[tuple[str, int]], span: int = SPAN_SAMPLES) -> list[list[Piece]]:
    """The stored order of `shards` ((name, stored samples), any order: read in name order) cut into spans
    of `span` samples, each as its pieces per shard. The cuts depend on the sample counts alone."""
    if span < 1:
        raise ValueError(f"span={span}: must be >= 1")
    spans: list[list[Piece]] = []
    filled = span  # samples in the last span: a new one starts at once
    for name, count in sorted(shards):
        start = 0
        while start < count:
            if filled == span:
                spans.append([])
                filled = 0
            stop = min(count, start + span - filled)
            spans[-1].append((name, start, stop))
            filled += stop - start
            start = stop
    return spans


def span_order(shards: Sequence[tuple[str, int]], seed: int, epoch: int) -> list[Piece]:
    """The pieces of one epoch: `stored_spans` in a seeded permutation (the `spans` order)."""
    spans = stored_spans(shards)
    perm = np.random.default_rng([seed, epoch, _SPAN_ORDER_TAG]).permutation(len(spans))
    return [piece for i in perm for piece in spans[i]]


def window_shuffle(items: Iterable[SampleRef], window: int, rng: np.random.Generator) -> Iterator[SampleRef]:
    """Shuffle a stream holding at most `window` items: each new item replaces a random one yielded."""
    buffer: list[SampleRef] = []
    for item in items:
        if len(buffer) < window:
            buffer.append(item)
            continue
        j = int(rng.integers(window))
        yield buffer[j]
        buffer[j] = item
    for j in rng.permutation(len(buffer)):
        yield buffer[int(j)]


def pack_by_budget(items: Iterable[SampleRef], token_budget: int) -> Iterator[list[SampleRef]]:
    """Greedy in-order packing: a batch closes when the next sample would exceed the budget."""
    batch: list[SampleRef] = []
    tokens = 0
    for item in items:
        assert item.length <= token_budget, "samples are truncated to max_length <= token_budget"
        if batch and tokens + item.length > token_budget:
            yield batch
            batch, tokens = [], 0
        batch.append(item)
        tokens += item.length
    if batch:
        yield batch


def trainable_samples(
    shard: str,
    entries: ShardEntries,
    *,
    max_length: int,
    heldout_fraction: float,
    heldout_rows: frozenset[int],
    start: int = 0,
    stop: int | None = None,
) -> list[SampleRef]:
    """A shard's stored samples [start, stop) in stored order, minus held-out rows and samples with no anchor
    (an unreadable shard skipped under `--on-corrupt skip` has no entries: nothing)."""
    rows, supervised = entries.rows[start:stop], entries.supervised[start:stop]
    keep = ~heldout_mask(rows, heldout_fraction, heldout_rows) & (supervised >= 2)
    lengths = np.minimum(entries.lengths[start:stop], max_length)
    return [SampleRef(shard, start + int(i), int(rows[i]), int(lengths[i])) for i in np.flatnonzero(keep)]


def _pieces_once(pieces: list[Piece], entries_of: EntriesOf) -> Iterator[tuple[Piece, ShardEntries]]:
    """Each piece with its shard's entries, fetched when the first piece of the shard comes and dropped
    after its last: one index read per shard and epoch, and only the indexes of shards begun are held."""
    left = Counter(name for name, _, _ in pieces)
    held: dict[str, ShardEntries] = {}
    for piece in pieces:
        name = piece[0]
        entries = held.get(name)
        if entries is None:
            entries = held[name] = entries_of(name)
        left[name] -= 1
        if not left[name]:
            del held[name]
        yield piece, entries


def epoch_batches(
    shards: Sequence[tuple[str, int]],
    entries_of: EntriesOf,
    *,
    seed: int,
    epoch: int,
    window: int,
    token_budget: int,
    max_length: int,
    heldout_fraction: float,
    heldout_rows: frozenset[int] = frozenset(),
    order: str = "spans",
) -> Iterator[list[SampleRef]]:
    """The global batch stream of one epoch (the same for any world size) over `shards`, (name, stored
    samples) each; with the `spans` order the same for any cut of one stored order into shards."""
    if order == "spans":
        pieces = span_order(shards, seed, epoch)
    elif order == "shards":
        pieces = [(name, 0, None) for name in shard_order([n for n, _ in shards], seed, epoch)]
    else:
        raise ValueError(f"order={order!r}: choose one of {', '.join(ORDERS)}")

    def samples() -> Iterator[SampleRef]:
        for (name, start, stop), entries in _pieces_once(pieces, entries_of):
            yield from trainable_samples(
                name,
                entries,
                max_length=max_length,
                heldout_fraction=heldout_fraction,
                heldout_rows=heldout_rows,
                start=start,
                stop=stop,
            )

    rng = np.random.default_rng([seed, epoch, _WINDOW_TAG])
    return pack_by_budget(window_shuffle(samples(), window, rng), token_budget)


def _split_half(batch: list[SampleRef]) -> tuple[list[SampleRef], list[SampleRef]]:
    """Split a batch in two contiguous halves of about equal tokens (each <= the original budget)."""
    total = sum(s.length for s in batch)
    running = 0
    for cut, sample in enumerate(batch[:-1], start=1):
        running += sample.length
        if running * 2 >= total:
            return batch[:cut], batch[cut:]
    return batch[:-1], batch[-1:]


def _complete_group(group: list[list[SampleRef]], world_size: int) -> list[list[SampleRef]]:
    """Give every rank a batch at the end of an epoch by halving the biggest splittable batches.

    A rank still empty afterwards (fewer samples than ranks) gets [] and runs a zero-weight step.
    """
    group = [list(b) for b in group]
    while len(group) < world_size:
        splittable = [i for i, b in enumerate(group) if len(b) > 1]
        if not splittable:
            group.extend([] for _ in range(world_size - len(group)))
            break
        biggest = max(splittable, key=lambda i: (sum(s.length for s in group[i]), -i))
        first, second = _split_half(group[biggest])
        group[biggest : biggest + 1] = [first, second]
    return group


def group_for_ranks(batches: Iterable[list[SampleRef]], world_size: int) -> Iterator[list[list[SampleRef]]]:
    """Consecutive groups of exactly `world_size` batches; rank r trains on element r.

    Every rank gets the same number of steps per epoch (DDP needs it) and together the ranks see
    every planned sample exactly once.
    """
    group: list[list[SampleRef]] = []
    for batch in batches:
        group.append(batch)
        if len(group) == world_size:
            yield group
            group = []
    if group:
        yield _complete_group(group, world_size)


def eval_batches(
    shard_names: Sequence[str],
    entries_of: EntriesOf,
    *,
    max_samples: int,
    token_budget: int,
    max_length: int,
    heldout_fraction: float,
    heldout_rows: frozenset[int] = frozenset(),
) -> list[list[SampleRef]]:
    """Up to `max_samples` held-out samples (shards in name order, so every evaluation uses the same set)."""
    picked: list[SampleRef] = []
    for name in sorted(shard_names):
        entries = entries_of(name)
        held = heldout_mask(entries.rows, heldout_fraction, heldout_rows) & (entries.supervised >= 2)
        for i in np.flatnonzero(held):
            picked.append(
                SampleRef(name, int(i), int(entries.rows[i]), int(min(entries.lengths[i], max_length)))
            )
            if len(picked) >= max_samples:
                return list(pack_by_budget(picked, token_budget))
    return list(pack_by_budget(picked, token_budget))
