"""A cache directory as readers see it: the manifest's shards, opened lazily, checked on first open (layout,
identity, each row stored once), shared by threads (`Cache.open`). One shard file at a time is
`reader.ShardReader`'s business. A cache on object storage (`s3://bucket/prefix`) opens the same way: its
manifest and target/ are copied to a local directory (`remote_cache.stage_remote`) and its shards are read
by range requests."""

from __future__ import annotations

import os
import resource
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .codecs import Codec, codec_from_dict
from .errors import DuplicateRows, ShardError
from .kept_shards import ShardFileCache
from .manifest import Manifest, ShardInfo, load_manifest
from .paths import SHARDS_DIR, unit_of_shard
from .reader import Sample, ShardReader
from .remote_cache import RemoteFile, stage_remote
from .row_ledger import RowLedger, suspect_repeated_rows
from .storage import Storage, open_storage
from .trust import ReadLimits, check_manifest_for_reading, check_shard_identity, check_shard_layout
from .urls import is_url

REMOTE_READ_FANOUT = 4
# Readers kept open (a descriptor and a parsed index, ~100 B a sample, each). A training epoch's shuffle window
# holds samples of many spans, so of many shards at once: with 64 open, an epoch opened each shard 4.8-14 times
# on caches of 200-5000 shards; with 256, 1.0-1.75 (`bench/bench_reopens.py`). A reopen costs an index read and
# its checks, on object storage two requests (the magic; footer and index in a 1 MiB tail read).
MAX_OPEN_SHARDS = 256


def default_open_shards() -> int:
    """`MAX_OPEN_SHARDS`, or a quarter of the process's descriptor limit where that is lower (a soft limit of 1024
    is common): the rest stay for the run's other files, pipes and sockets."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_SHARDS
    return max(16, min(MAX_OPEN_SHARDS, soft // 4))


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """Where a row lives: its shard file name and position in that shard's index."""

    row: int
    length: int
    supervised: int
    shard: str
    index: int


def shard_file_problems(cache_dir: Path, shards: Sequence[ShardInfo]) -> dict[str, str]:
    """name -> one line for each of `shards` that is not on disk as a regular file of its recorded size. Stat
    only, no read: a run checks thousands of shards in a second before its first step, instead of meeting a
    missing one hours in."""
    problems: dict[str, str] = {}
    for info in shards:
        path = Path(cache_dir) / SHARDS_DIR / info.name
        try:
            st = os.stat(path)
        except FileNotFoundError:
            problems[info.name] = f"{path}: missing, the manifest lists it"
        except OSError as exc:
            problems[info.name] = f"{path}: cannot be read ({exc.strerror})"
        else:
            if not stat.S_ISREG(st.st_mode):
                problems[info.name] = f"{path}: not a regular file"
            elif st.st_size != info.bytes:
                problems[info.name] = f"{path}: {st.st_size} bytes, the manifest records {info.bytes}"
    return problems


def shard_object_problems(storage: Storage, shards: Sequence[ShardInfo]) -> dict[str, str]:
    """`shard_file_problems` on object storage: one listing (a request per 1000 shards), no read."""
    sizes = storage.list_sizes(SHARDS_DIR)
    problems: dict[str, str] = {}
    for info in shards:
        where = storage.where(f"{SHARDS_DIR}/{info.name}")
        size = sizes.get(info.name)
        if size is None:
            problems[info.name] = f"{where}: missing, the manifest lists it"
        elif size != info.bytes:
            problems[info.name] = f"{where}: {size} bytes, the manifest records {info.bytes}"
    return problems


class Cache:
    """A cache directory; open with `Cache.open(path)`. Shards open lazily and are shared by threads."""

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        shard_names: list[str],
        from_manifest: bool,
        max_open_shards: int,
        unique_rows: bool = True,
        storage: Storage | None = None,
    ):
        if max_open_shards < 1:
            raise ValueError(f"max_open_shards must be >= 1, got {max_open_shards}")
        self.path = path  # local: the cache; remote: the local copy of its manifest and target/
        self.storage = storage if storage is not None and storage.is_remote else None
        self.location = self.storage.location if self.storage else str(path)  # what messages name
        self._shard_cache: ShardFileCache | None = None
        self.manifest = manifest
        self.shard_names = shard_names
        self._known = set(shard_names)
        self._listed = {s.name: s for s in manifest.shards}
        self._from_manifest = from_manifest
        self._max_open = max_open_shards
        self.limits = ReadLimits.of(manifest)
        self._lock = threading.Lock()
        # Most recently used readers; an evicted reader closes its descriptor when the last thread
        # still holding it lets go (reference counting), so eviction never breaks a read in flight.
        self._readers: OrderedDict[str, ShardReader] = OrderedDict()
        self._rows: dict[int, tuple[str, int]] | None = None
        self._ledger = RowLedger(str(path)) if unique_rows else None

    @classmethod
    def open(
        cls,
        path: str | os.PathLike,
        require_complete: bool = True,
        *,
        max_open_shards: int | None = None,
        unique_rows: bool = True,
        local_dir: str | os.PathLike | None = None,
        shard_cache_bytes: int = 0,
    ) -> Cache:
        """Complete caches list shards from the manifest (no directory scan, no footer read until used);
        `require_complete=False` lists the committed `shards/shard-*.dfs` instead (resume, verify).
        At most `max_open_shards` readers (file descriptors + parsed indexes) stay cached (default:
        `default_open_shards()`).
        `unique_rows` (readers that plan over the cache) refuses a row stored twice (`DuplicateRows`): here
        when the manifest already suggests one (`suspect_repeated_rows`), else when the shard holding the
        second copy is opened; `verify` and the inspecting commands pass False and report it themselves.
        `path` may be a URL (`s3://bucket/prefix`): manifest and target/ are copied into `local_dir` (default:
        one per URL under ~/.cache/dflash/remote) and shards are read by range requests, or, with
        `shard_cache_bytes`, downloaded whole into `local_dir`/shards and kept there up to that many bytes
        (`kept_shards.ShardFileCache`)."""
        if max_open_shards is None:
            max_open_shards = default_open_shards()
        storage = open_storage(path) if is_url(str(path)) else None
        if storage is not None:  # a remote cache's manifest and target/ are read from their local copy
            path = stage_remote(storage, local_dir) if storage.is_remote else storage.root
        path = Path(path)
        label = storage.location if storage is not None and storage.is_remote else str(path)
        manifest = load_manifest(path)
        check_manifest_for_reading(manifest, f"{label}/manifest.json")
        if manifest.complete:
            names = [s.name for s in manifest.shards]
            cache = cls(path, manifest, names, True, max_open_shards, unique_rows, storage)
            cache.use_shard_cache(shard_cache_bytes)
            if unique_rows and suspect_repeated_rows(manifest):
                try:
                    cache.check_rows_once()
                except BaseException:
                    cache.close()
                    raise
            return cache
        if require_complete:
            raise ShardError(
                f"{label}: cache is incomplete (extraction running or interrupted): resume the extraction, "
                "or open with require_complete=False to read what is committed"
            )
        cache = cls(path, manifest, [], False, max_open_shards, unique_rows, storage)
        cache.use_shard_cache(shard_cache_bytes)
        cache.shard_names = cache.committed_names()
        cache._known = set(cache.shard_names)
        return cache

    def use_shard_cache(self, max_bytes: int) -> None:
        """Keep up to `max_bytes` of whole remote shards in `path`/shards (a remote cache; 0: range reads only)."""
        if self.storage is not None and max_bytes > 0:
            self._shard_cache = ShardFileCache(self.path / SHARDS_DIR, max_bytes)

    @property
    def shard_cache_bytes(self) -> int:
        """The bound `use_shard_cache` set (0: none): another process opening this cache shares the directory."""
        return self._shard_cache.max_bytes if self._shard_cache is not None else 0

    def committed_names(self) -> list[str]:
        """The committed shards present now (`shard-*.dfs` on disk, or objects under the prefix), sorted."""
        if self.storage is not None:
            return sorted(n for n in self.storage.list_sizes(SHARDS_DIR) if unit_of_shard(n) is not None)
        shard_dir = self.path / SHARDS_DIR
        return sorted(p.name for p in shard_dir.glob("shard-*.dfs")) if shard_dir.is_dir() else []

    def where(self, name: str) -> str:
        """Shard `name`'s path or URL, for messages."""
        if self.storage is not None:
            return self.storage.where(f"{SHARDS_DIR}/{name}")
        return str(self.path / SHARDS_DIR / name)

    @property
    def layers(self) -> list[int]:
        return list(self.manifest.layers)

    @property
    def read_fanout(self) -> int:
        """Reads worth keeping in flight per reading thread: a range request spends most of its time waiting on
        the network (an object store's first byte: 10-50 ms), a local pread on a core; 1 when every shard
        is read from local disk."""
        if self.storage is None:
            return 1
        kept = self._shard_cache.max_bytes if self._shard_cache is not None else 0
        return 1 if kept >= sum(s.bytes for s in self._listed.values()) > 0 else REMOTE_READ_FANOUT

    @property
    def codec(self) -> Codec:
        return codec_from_dict(self.manifest.codec)

    @property
    def shard_infos(self) -> list[ShardInfo]:
        """Per-shard stats: from the manifest when complete, else from each shard's footer."""
        if self._from_manifest:
            return list(self.manifest.shards)
        return [self.shard(n).info() for n in self.shard_names]

    def shard(self, name: str) -> ShardReader:
        with self._lock:
            reader = self._readers.get(name)
            if reader is not None:
                self._readers.move_to_end(name)
                return reader
            if name not in self._known:
                raise KeyError(f"{self.location}: no shard named {name!r}")
        reader = self._open_reader(name)  # outside the lock: disk or network I/O
        try:
            check_shard_layout(reader.path, self.manifest, reader.codec.to_dict(), reader.layers,
                               reader.dtype, reader.hidden_size)  # fmt: skip
            if self._from_manifest:
                check_shard_identity(reader.path, self._listed[name], reader.info())
            if self._ledger is not None:
                self._ledger.add(name, reader.rows)
        except ShardError:
            reader.close()
            raise
        with self._lock:
            reader = self._readers.setdefault(name, reader)
            self._readers.move_to_end(name)
            while len(self._readers) > self._max_open:
                self._readers.popitem(last=False)
            return reader

    def _open_reader(self, name: str) -> ShardReader:
        if self.storage is None:
            return ShardReader.open(self.path / SHARDS_DIR / name, self.limits)
        key = f"{SHARDS_DIR}/{name}"
        listed = self._listed.get(name)
        size = listed.bytes if listed else None  # a complete cache's manifest lists it: no HEAD per open
        if self._shard_cache is None:
            file = RemoteFile(self.storage, key, size)
        else:
            file = self._shard_cache.open(self.storage, key, name, size)
        return ShardReader.open_file(file, self.storage.where(key), self.limits, name)

    def shard_file_problems(self) -> dict[str, str]:
        """`shard_file_problems` of the shards the manifest lists (none for a cache still being written)."""
        if not self._from_manifest:
            return {}
        if self.storage is not None:
            return shard_object_problems(self.storage, self.manifest.shards)
        return shard_file_problems(self.path, self.manifest.shards)

    def check_rows_once(self) -> None:
        """Read every shard's index now (no sample data) so that a row stored twice is refused before any work
        (`DuplicateRows`); a shard that cannot be read is left to whoever reads it (its own error, or
        `--on-corrupt skip`)."""
        for name in self.shard_names:
            try:
                self.shard(name)
            except DuplicateRows:
                raise
            except (ShardError, OSError):
                continue

    def entries(self) -> list[CacheEntry]:
        """Every sample (row, length, supervised, shard, index) from the shard indexes; reads all footers."""
        out = []
        for name in self.shard_names:
            for i, e in enumerate(self.shard(name).entries):
                out.append(
                    CacheEntry(row=e.row, length=e.length, supervised=e.supervised, shard=name, index=i)
                )
        return out

    def locate(self, row: int) -> CacheEntry:
        with self._lock:
            rows = self._rows
        if rows is None:
            rows = {e.row: (e.shard, e.index) for e in self.entries()}
            with self._lock:
                self._rows = rows
        if row not in rows:
            raise KeyError(f"{self.location}: row {row} is not in this cache")
        name, i = rows[row]
        e = self.shard(name).entries[i]
        return CacheEntry(row=row, length=e.length, supervised=e.supervised, shard=name, index=i)

    def read(self, row: int, layers: Sequence[int] | None = None, *, dequantize: bool = True) -> Sample:
        """The sample of dataset row `row` (first call builds the row map from all indexes)."""
        e = self.locate(row)
        return self.shard(e.shard).read(e.index, layers, dequantize=dequantize)

    def close(self) -> None:
        with self._lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()

    def __enter__(self) -> Cache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
