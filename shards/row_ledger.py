"""Each dataset row stored once: what `Cache` checks for readers that plan over the whole cache (training,
evaluation, convert), so a row in two shards is refused instead of being read twice.

`RowLedger` notes which shard holds each row as each shard's index is first read (`Cache.shard`): one numpy
pass over row ids the index parse already produced, no extra read. That alone catches a repeat only when
the planner reaches the second shard, so `suspect_repeated_rows` also looks at the manifest, which costs
nothing: two shards with one index checksum (a copy listed under a second name), or more rows stored than
the dataset has. Then `Cache.open` reads every index up front and refuses before any work (the
healthy case never pays for it: training does not scan the cache before its first batch).
"""

from __future__ import annotations

import os
import threading
from collections import Counter

import numpy as np

from .errors import DuplicateRows
from .manifest import Manifest
from .paths import committed_shard_names

_SHOW = 5  # rows named in a message; the count is exact
_SLACK = 1 << 20  # row ids this far past the rows seen still go in the owner array (healthy ids are dense)


def suspect_repeated_rows(m: Manifest) -> bool:
    """Whether the manifest alone suggests a row stored twice: two listed shards with one index checksum, or
    more rows stored (plus skipped) than the dataset's row count."""
    if any(n > 1 for n in Counter(s.index_checksum for s in m.shards if s.rows).values()):
        return True
    rows = m.dataset.get("rows")
    return type(rows) is int and m.rows + len(m.skipped) > rows


def unaccounted_rows(m: Manifest, cache_dir: str | os.PathLike) -> str | None:
    """Why a complete cache's manifest accounts for fewer rows (stored plus skipped) than its dataset has, or
    None: a shard's entry removed from it hides that shard's rows from every reader that plans by it."""
    rows = m.dataset.get("rows")
    listed = m.rows + len(m.skipped)
    if not m.complete or type(rows) is not int or listed >= rows:
        return None
    unlisted = sorted(set(committed_shard_names(cache_dir)) - {s.name for s in m.shards})
    return (
        f"its manifest accounts for {listed:,} of the dataset's {rows:,} rows ({m.rows:,} stored, "
        f"{len(m.skipped):,} skipped)"
        + (f"; shard files it does not list: {', '.join(unlisted[:3])}" if unlisted else "")
    )


class RowLedger:
    """Which shard holds each row seen so far; `add` refuses a shard holding a row already seen (or one row
    twice). Healthy row ids are 0..n-1: they go in an owner array grown as they come; far-off ids (a damaged
    index) in a dict, so memory stays proportional to the rows read. Thread-safe."""

    def __init__(self, cache: str):
        self.cache = cache
        self._names: list[str] = []  # shard k is _names[k - 1]
        self._number: dict[str, int] = {}
        self._owner = np.zeros(0, np.int32)  # row id -> shard number, 0: not seen
        self._far: dict[int, int] = {}
        self._seen = 0
        self._lock = threading.Lock()

    def add(self, shard: str, rows: np.ndarray) -> None:
        """Note that `shard` holds `rows` (a shard already noted is skipped: readers re-open evicted shards)."""
        with self._lock:
            if shard in self._number:
                return
            self._refuse_repeats(shard, rows)
            number = len(self._names) + 1
            self._grow(rows)
            near = rows < len(self._owner)
            self._owner[rows[near]] = number
            self._far.update(dict.fromkeys(rows[~near].tolist(), number))
            self._names.append(shard)
            self._number[shard] = number
            self._seen += len(rows)

    def _owners(self, rows: np.ndarray) -> np.ndarray:
        near = rows < len(self._owner)
        out = np.zeros(len(rows), np.int32)
        out[near] = self._owner[rows[near]]
        out[~near] = [self._far.get(r, 0) for r in rows[~near].tolist()]
        return out

    def _refuse_repeats(self, shard: str, rows: np.ndarray) -> None:
        unique, counts = np.unique(rows, return_counts=True)
        if (counts > 1).any():
            raise DuplicateRows(self._message(unique[counts > 1], f"twice in {shard}", shard))
        owners = self._owners(unique)  # sorted rows: the first one named is the smallest
        if owners.any():
            taken = owners > 0
            first = self._names[int(owners[taken][0]) - 1]
            raise DuplicateRows(self._message(unique[taken], f"in both {first} and {shard}", shard))

    def _message(self, rows: np.ndarray, where: str, shard: str) -> str:
        shown = ", ".join(map(str, rows[:_SHOW].tolist())) + (", ..." if len(rows) > _SHOW else "")
        more = f" ({len(rows)} rows of {shard} are stored twice: {shown})" if len(rows) > 1 else ""
        return (
            f"{self.cache}: row {int(rows[0])} is stored {where}{more}: a reader would use it twice (a shard "
            f"copied under a second name, or a damaged manifest); run `dflash-shards verify {self.cache}` to "
            "list every such row, then remove the extra shard from the manifest or re-extract"
        )

    def _grow(self, rows: np.ndarray) -> None:
        """Extend the owner array over `rows` when they are dense enough (doubling, so growth is amortized)."""
        limit = 2 * (self._seen + len(rows)) + _SLACK
        near = rows[rows < limit]  # a far-off id among them does not send the dense rest to the dict
        top = int(near.max()) + 1 if len(near) else 0
        if top <= len(self._owner):
            return
        grown = np.zeros(min(max(top, 2 * len(self._owner)), limit), np.int32)
        grown[: len(self._owner)] = self._owner
        moved = [r for r in self._far if r < len(grown)]
        for r in moved:
            grown[r] = self._far.pop(r)
        self._owner = grown
