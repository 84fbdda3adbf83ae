"""Writing a cache to object storage: built in a local staging directory by the usual writer, published object
by object with the cache contract kept (`remote_output`, used by `dflash-extract --out s3://...` and
`dflash-shards convert --out s3://...`).

    with remote_output("s3://bucket/cache", stage_dir) as local:   # the remote lock, then staging
        ... write the cache into `local` as into any local cache ...
    # on leaving: every committed shard uploaded, then the manifest, last

- One writer per prefix: `.lock` is created with `If-None-Match: *` (`Storage.create_exclusive`); a second
  writer is refused naming the holder. The holder renews it (`renewed`) every `LEASE_RENEW_S`; a lock not
  renewed for `LEASE_TTL_S`, or held by a process of this host that no longer runs (a killed writer), is
  taken over. Takeovers and renewals replace only the version they read (`If-Match`): two writers taking
  over one stale lock cannot both win, and a writer whose lock was taken over stops publishing.
- A shard object is uploaded only once its local file is committed (renamed), and an object PUT is atomic:
  no reader ever sees part of a shard. Shards are uploaded while the writer works (`Publisher`, a thread).
- `manifest.json` is uploaded complete only after a listing shows every shard it names at its recorded size;
  an incomplete manifest (complete=false) goes up first, so a killed run's prefix is a resumable cache.
- Resume: the same command re-run finds its staging directory (same URL, same `--stage-dir`) and continues;
  objects already up at their size are not uploaded again. A staging directory lost with its node (a resume
  elsewhere) gets the remote manifest and target/ back, and the writer redoes the shards it cannot see
  locally (the objects are replaced whole; nothing torn is ever named).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .atomic import process_alive
from .errors import ShardError
from .manifest import load_manifest
from .outdir import MARK_NAME
from .paths import LOCK_NAME, MANIFEST_NAME, SHARDS_DIR, TARGET_DIR, committed_shard_names, unit_of_shard
from .published import published_shards, record_published
from .reader import ShardReader
from .remote_cache import RemoteFile, stage_remote
from .retries import transient_counts
from .safe_io import load_json
from .storage import Storage, open_storage
from .trust import check_shard_layout
from .urls import default_stage_dir

log = logging.getLogger(__name__)
LEASE_TTL_S = 300.0
LEASE_RENEW_S = 30.0
PUBLISH_EVERY_S = 2.0
_HELD: set[float] = set()  # `started` of the locks this process holds now


class PrefixLocked(ShardError):
    """Another writer holds the prefix's lock object."""


class RemoteLock:
    """The one writer of a prefix: `.lock`, created only where none exists, renewed while held."""

    def __init__(self, storage: Storage, what: str):
        self.storage, self.what = storage, what
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "what": what, "started": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._etag: str | None = None  # the version of `.lock` this writer last wrote
        self.lost = False  # another writer took the lock over (this one was not renewed in time)

    def _body(self) -> bytes:
        return json.dumps({**self.info, "renewed": time.time()}).encode()

    def _holder(self) -> tuple[dict[str, Any], str | None]:
        """The lock's content and the version it was read at (taken first: a takeover replaces that version
        only, so two writers taking over one stale lock cannot both win)."""
        etag = self.storage.etag(LOCK_NAME)
        try:
            d = load_json(self.storage.read_all(LOCK_NAME, 1 << 16), self.storage.where(LOCK_NAME))
        except (FileNotFoundError, ShardError):
            d = {}
        return (d if isinstance(d, dict) else {}), etag

    def _stale(self, holder: dict[str, Any]) -> str | None:
        renewed = holder.get("renewed")
        if not isinstance(renewed, (int, float)) or time.time() - renewed > LEASE_TTL_S:
            return f"not renewed for over {LEASE_TTL_S:.0f} s"
        pid = holder.get("pid")
        if holder.get("host") == self.info["host"] and isinstance(pid, int):
            if not process_alive(pid):
                return f"pid {pid} on this host no longer runs"
            if pid == os.getpid() and holder.get("started") not in _HELD:  # an earlier run of this process
                return "run in this process ended without releasing it"
        return None

    def _held(self) -> RemoteLock:
        self._etag = self.storage.etag(LOCK_NAME)
        _HELD.add(self.info["started"])
        self._thread = threading.Thread(target=self._renew, name="dflash-lease", daemon=True)
        self._thread.start()
        return self

    def acquire(self) -> RemoteLock:
        for _ in range(3):
            if self.storage.create_exclusive(LOCK_NAME, self._body()):
                return self._held()
            holder, etag = self._holder()
            if etag is None:  # released meanwhile: try to create it again
                continue
            why = self._stale(holder) if holder else "unreadable"
            if why is None:
                raise PrefixLocked(
                    f"{self.storage.location} is being written by another process ({holder.get('what')}, pid "
                    f"{holder.get('pid')} on {holder.get('host')}; lock object {self.storage.where(LOCK_NAME)} "
                    "renewed "
                    f"{time.time() - holder['renewed']:.0f} s ago): wait for it to finish or choose another --out"
                )
            if self.storage.replace_if(LOCK_NAME, self._body(), etag):  # only the version judged stale
                log.warning("took over the lock of %s: its holder's %s", self.storage.location, why)
                return self._held()
        raise PrefixLocked(f"{self.storage.where(LOCK_NAME)}: another writer keeps taking the lock")

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_RENEW_S):
            try:  # only the version this writer wrote: a lock taken over meanwhile is not overwritten
                if self._etag is None or not self.storage.replace_if(LOCK_NAME, self._body(), self._etag):
                    self.lost = True
                    log.error("lost the lock of %s to another writer", self.storage.location)
                    return
                self._etag = self.storage.etag(LOCK_NAME)
            except OSError:  # unreachable for now: retried at the next tick
                continue

    def check(self) -> None:
        """Refuse to publish a manifest once another writer has taken the prefix over."""
        if self.lost:
            raise PrefixLocked(
                f"{self.storage.location}: another writer took the lock over while this one ran (not renewed "
                f"for {LEASE_TTL_S:.0f} s); nothing more was published: re-run the same command"
            )

    def release(self) -> None:
        _HELD.discard(self.info["started"])
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if not self.lost:
                with contextlib.suppress(OSError):
                    self.storage.delete(LOCK_NAME)


class Publisher:
    """Uploads a staging directory's committed shards and target/ to `storage`; manifest last (`finish`)."""

    def __init__(self, storage: Storage, local: Path, keep_local: bool = True):
        self.storage, self.local, self.keep_local = storage, local, keep_local
        self.uploaded: dict[str, int] = {}  # shard name -> size, objects known to be up
        self.target_done = False
        self.manifest_sent: bytes | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.uploaded = self.storage.list_sizes(SHARDS_DIR)
        self._thread = threading.Thread(target=self._loop, name="dflash-publish", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(PUBLISH_EVERY_S):
            try:
                self.sync_shards()
                self.sync_manifest(complete=False)
            except Exception as exc:  # retried at the next tick; `finish` meets what is left and raises it
                log.warning("upload to %s failed, retried: %s", self.storage.location, exc)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def sync_shards(self) -> int:
        """Upload every committed local shard whose object is missing or of another size; returns how many.
        Without `keep_local`, each uploaded shard is recorded (`published.py`) and its local file deleted."""
        sent = 0
        published = set() if self.keep_local else set(published_shards(self.local))
        for name in committed_shard_names(self.local):
            path = self.local / SHARDS_DIR / name
            if name in published or not path.is_file():
                continue
            size = path.stat().st_size
            if self.uploaded.get(name) != size:
                self.storage.put_file(f"{SHARDS_DIR}/{name}", path)
                self.uploaded[name] = size
                sent += 1
            if not self.keep_local:
                with ShardReader.open(path) as reader:
                    info, skipped = reader.info(), reader.meta.get("skipped", [])
                record_published(self.local, name, info, skipped if isinstance(skipped, list) else [])
                path.unlink()
        return sent

    def sync_target(self) -> None:
        directory = self.local / TARGET_DIR
        if self.target_done or not directory.is_dir():
            return
        for path in sorted(directory.iterdir()):
            if path.is_file():
                self.storage.put_file(f"{TARGET_DIR}/{path.name}", path)
        self.target_done = True

    def sync_manifest(self, complete: bool = True) -> None:
        """The local manifest, uploaded when it changed; a complete one (not while `complete` is False) only
        once every shard it names is up at its recorded size (checked by a fresh listing, not from memory)."""
        path = self.local / MANIFEST_NAME
        if not path.is_file():
            return
        data = path.read_bytes()
        if data == self.manifest_sent:
            return
        manifest = load_manifest(self.local)
        if manifest.complete and not complete:
            return
        self.sync_target()  # what the manifest's `target_files` names goes up before it
        if manifest.complete:
            up = self.storage.list_sizes(SHARDS_DIR)
            wrong = [s.name for s in manifest.shards if up.get(s.name) != s.bytes]
            if wrong:
                raise ShardError(
                    f"{self.storage.location}: {len(wrong)} shards are not up at their size ({wrong[0]}, ...); "
                    "the manifest was not published: re-run the same command"
                )
        self.storage.put(MANIFEST_NAME, data)
        self.manifest_sent = data

    def finish(self) -> None:
        self.stop()
        self.sync_shards()
        self.sync_target()
        self.sync_manifest()


def _hydrate(storage: Storage, local: Path, keep_local: bool) -> bool:
    """A staging directory without a manifest gets the prefix's manifest and target/ (a resume elsewhere), so
    the writer checks its settings against the cache's instead of starting another one over it; without
    `keep_local`, every shard object up there is recorded as published (its footer and index read and
    checked: 3 requests), so the writer does not redo it. True when the prefix already holds a complete cache
    (nothing to write)."""
    if (local / MANIFEST_NAME).exists() or storage.size(MANIFEST_NAME) is None:
        return False
    stage_remote(storage, local)
    if load_manifest(local).complete:
        return True
    with contextlib.suppress(FileExistsError):
        (local / MARK_NAME).write_text(json.dumps({"kind": "cache"}) + "\n")
    if not keep_local:
        manifest = load_manifest(local)
        for name in sorted(storage.list_sizes(SHARDS_DIR)):
            if unit_of_shard(name) is None:
                continue
            key = f"{SHARDS_DIR}/{name}"
            try:
                reader = ShardReader.open_file(RemoteFile(storage, key), storage.where(key), name=name)
            except ShardError as exc:  # not a whole shard: the writer redoes its unit and replaces it
                log.warning("%s: %s; its unit is extracted again", storage.where(key), exc)
                continue
            with reader:  # another cache's shard (codec, layers, dtype, width) is refused, not recorded
                check_shard_layout(reader.path, manifest, reader.codec.to_dict(), reader.layers,
                                   reader.dtype, reader.hidden_size)  # fmt: skip
                skipped = reader.meta.get("skipped", [])
                record_published(local, name, reader.info(), skipped if isinstance(skipped, list) else [])
    return False


def retried_text() -> str:
    """'; N requests retried (kind: n, ...)' once any remote request was retried, else ''."""
    counts = transient_counts()
    if not counts:
        return ""
    kinds = ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()) if k != "retries")
    return f"; {counts['retries']} requests retried ({kinds})"


@contextlib.contextmanager
def remote_output(
    url: str, stage_dir: str | os.PathLike | None, what: str, *, keep_local: bool = True
) -> Iterator[Path | None]:
    """A local directory to write a cache into, published to `url` as it is written (None: `url` already holds
    a complete cache, nothing to do); see the module docstring. Without `keep_local` the staging directory
    keeps only shards not yet uploaded (the writer must read committed shards through `published.py`, as
    extraction does)."""
    storage = open_storage(url)
    local = Path(stage_dir) if stage_dir else default_stage_dir(storage.location)
    local.parent.mkdir(parents=True, exist_ok=True)
    lock = RemoteLock(storage, what).acquire()
    publisher = Publisher(storage, local, keep_local)
    try:
        if _hydrate(storage, local, keep_local):
            yield None
            return
        if storage.size(MARK_NAME) is None:
            storage.put(MARK_NAME, json.dumps({"kind": "cache"}).encode() + b"\n")
        publisher.start()
        yield local
        lock.check()
        publisher.finish()
    except BaseException:
        publisher.stop()
        if not lock.lost:
            with contextlib.suppress(Exception):  # keep what was committed: the re-run uploads the rest
                publisher.sync_shards()
                publisher.sync_manifest(complete=False)
        raise
    finally:
        lock.release()
