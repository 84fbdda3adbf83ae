"""Whole shards of a remote cache kept on a local disk, up to a bound (`dflash-train --shard-cache-gb`).

Shards are kept as they are first opened until the next one would pass the bound; a shard opened after that
is read by range requests, as with no local copy, and nothing is evicted. A training epoch visits the shards
in a new random order, each several times under the `spans` data order (a span is 64 samples, a shard holds
hundreds): evicting the least recently used to make room downloaded a shard whole at nearly every visit,
more bytes per epoch than the cache itself once the bound was below the cache's size. Keeping a fixed part
fetches only the rest, once per epoch, by the bytes of its samples (`bench/bench_shard_cache.py`).

The directory is shared by the processes that use it (loader workers, later runs, and every node's where it
lies on a shared filesystem, as a home directory on NFS may): the bound holds for what they keep together,
counted from the directory's content under an fcntl lock (`.shards.lock` beside it). A download first reserves
its bytes there (`.reserve-<pid>-<host>-<bytes>-<name>`, removed once the shard is renamed in), so downloads in
flight count; a reservation or a temp file whose process is gone is removed as stale (this host's by pid,
another host's once untouched for an hour: `atomic.owner_gone`). A smaller bound than a previous run's
keeps the most recently used shards that fit it. What is read from here is checked as what is read remotely: the
index checksum at open, the manifest's identity, every frame's checksum.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .atomic import atomic_write, left_by_dead_process, owner, owner_gone
from .reader import LocalFile, RangeFile
from .remote_cache import RemoteFile
from .storage import Storage

RESERVE = ".reserve-"


def reservation_name(holder: str, size: int, name: str) -> str:
    """`.reserve-PID-HOST-BYTES-NAME`: `size` bytes of the directory held for shard `name` by `holder`
    (`atomic.owner()`'s PID-HOST) while it downloads."""
    return f"{RESERVE}{holder}-{size}-{name}"


RECHECK_SECONDS = 30.0  # a full directory is counted again this long after (each count lists the directory)


class ShardFileCache:
    """Shards of one remote cache kept whole in `directory`, `max_bytes` of them at most (see the module)."""

    def __init__(self, directory: Path, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self._lock = threading.Lock()  # this process's threads; `_dir_lock` is every process's
        self._downloading: dict[str, threading.Event] = {}
        self._full_until = 0.0  # monotonic time before which the directory is taken as full
        self.hits = self.misses = self.remote = 0  # opened from disk / downloaded / read by ranges
        if directory.is_dir():
            with self._dir_lock():
                self._trim()

    def open(self, storage: Storage, key: str, name: str, size: int | None) -> RangeFile:
        """A local copy of shard `name` (`size` bytes, as the manifest lists it) when kept or when there is room
        to keep it; else the remote object, read by ranges."""
        if size is None or size > self.max_bytes:
            return RemoteFile(storage, key, size)
        path = self.directory / name
        while True:
            with self._lock:
                kept = _open_kept(path, size)
                if kept is not None:
                    self.hits += 1
                    return kept
                downloading = self._downloading.get(name)
                if downloading is None:
                    reservation = self._reserve(name, size) if time.monotonic() >= self._full_until else None
                    if reservation is None:
                        self._full_until = max(self._full_until, time.monotonic() + RECHECK_SECONDS)
                        self.remote += 1
                        return RemoteFile(storage, key, size)
                    self._downloading[name] = threading.Event()
                    break
            downloading.wait()  # another thread of this process fetches it: one download, then read it here
        try:
            self.misses += 1
            atomic_write(path, lambda tmp: storage.get_file(key, tmp))
        finally:
            reservation.unlink(missing_ok=True)
            with self._lock:
                self._downloading.pop(name).set()
        try:
            return LocalFile(path)
        except FileNotFoundError:  # another run's smaller bound trimmed it meanwhile: ranges this time
            return RemoteFile(storage, key, size)

    def _reserve(self, name: str, size: int) -> Path | None:
        self.directory.mkdir(parents=True, exist_ok=True)
        with self._dir_lock():
            if self._used() + size > self.max_bytes:
                return None
            reservation = self.directory / reservation_name(owner(), size, name)
            reservation.touch()
            return reservation

    @contextlib.contextmanager
    def _dir_lock(self) -> Iterator[None]:
        lock = self.directory.with_name(f".{self.directory.name}.lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the lock

    def _used(self) -> int:
        """Bytes kept and reserved (under the directory lock); stale reservations and temp files removed."""
        return sum(size for size, _, _ in self._entries())

    def _trim(self) -> None:
        """Drop the least recently used kept shards until what is kept and reserved fits the bound."""
        entries = self._entries()
        used = sum(size for size, _, _ in entries)
        for size, _, path in sorted((e for e in entries if e[2] is not None), key=lambda e: e[1]):
            if used <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            used -= size

    def _entries(self) -> list[tuple[int, float, Path | None]]:
        """(bytes, last use, kept file or None for a reservation) of what the directory holds."""
        entries: list[tuple[int, float, Path | None]] = []
        for p in self.directory.iterdir():
            name = p.name
            if name.startswith(RESERVE):
                pid, host, size, *_ = [*name[len(RESERVE) :].split("-", 3), "", "", ""]
                if not (pid.isdigit() and size.isdigit()):
                    continue  # not one of ours
                if owner_gone(int(pid), host, p):
                    p.unlink(missing_ok=True)
                else:
                    entries.append((int(size), 0.0, None))
            elif name.startswith("."):  # a download's temp file: its reservation counts it while it runs
                if left_by_dead_process(p):
                    p.unlink(missing_ok=True)
            else:
                with contextlib.suppress(FileNotFoundError):  # trimmed by another process meanwhile
                    st = p.stat()
                    entries.append((st.st_size, st.st_mtime, p))
        return entries


def _open_kept(path: Path, size: int) -> LocalFile | None:
    with contextlib.suppress(FileNotFoundError):  # trimmed by another process meanwhile
        if path.stat().st_size == size:
            file = LocalFile(path)
            os.utime(path)  # its last use: a smaller bound later keeps the most recently used
            return file
    return None
