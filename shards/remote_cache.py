"""A cache on object storage, read locally: its manifest and `target/` copied into a local directory, so every
reader of those files (training's frozen weights, the target-file digests, verify) works unchanged, while
shards stay remote and are read by range requests (`cache.Cache`).

The local directory (`local_dir`, default one per URL under `$XDG_CACHE_HOME/dflash/remote`) holds only what
is copied: a `target/` file already there with the recorded size and digest is kept (a 2.5 GB frozen table is
fetched once per node, not once per launch), anything else is fetched again; the manifest is fetched every
time (an extraction may be writing it). Every copied file is checked against the manifest's digests by the
readers that use it, exactly as a local cache's are.
"""

from __future__ import annotations

import os
from pathlib import Path

from .atomic import atomic_write, atomic_write_bytes, left_by_dead_process
from .errors import ShardError
from .manifest import MAX_MANIFEST_BYTES, load_manifest
from .paths import MANIFEST_NAME, TARGET_DIR
from .storage import Storage
from .target_files import HASH, file_digest, is_plain_name
from .urls import default_local_dir


class RemoteFile:
    """One remote object read by ranges, shaped as `reader.ShardReader` reads a local file."""

    tail_hint = 1 << 20  # the shard's footer and index come in one request (an index is ~100 B per sample)
    coalesce = True  # a sample's wanted frames in one request (the layers between them ride along)

    def __init__(self, storage: Storage, key: str, size: int | None = None):
        """`size`: the object's, where the manifest lists it (saves a HEAD per open: a shard replaced by one of
        another size then fails its footer or a short read, as a truncated shard does)."""
        self.storage, self.key = storage, key
        if size is None:
            size = storage.size(key)
            if size is None:
                raise FileNotFoundError(f"{storage.where(key)}: not found")
        self.size = size

    def pread(self, size: int, offset: int) -> bytes:
        data = self.storage.read_range(self.key, offset, size)
        if len(data) != size:
            raise ShardError(
                f"{self.storage.where(self.key)}: wanted {size} bytes at offset {offset}, got {len(data)}: "
                "truncated"
            )
        return data

    def advise_sequential(self) -> None:
        pass

    def close(self) -> None:
        pass


def _matches(path: Path, record: dict) -> bool:
    try:
        got = file_digest(path)
    except (OSError, ValueError):
        return False
    return got["bytes"] == record.get("bytes") and (HASH not in record or got[HASH] == record[HASH])


def _download(storage: Storage, key: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: storage.get_file(key, tmp))


def stage_remote(storage: Storage, local_dir: str | os.PathLike | None = None) -> Path:
    """Copy the manifest and target/ of the cache at `storage` into `local_dir` (default: `default_local_dir`);
    returns that directory."""
    local = Path(local_dir) if local_dir else default_local_dir(storage.location)
    local.mkdir(parents=True, exist_ok=True)
    data = storage.read_all(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    atomic_write_bytes(local / MANIFEST_NAME, data)
    manifest = load_manifest(local)
    recorded = dict(manifest.target_files)
    # Recorded names are plain file names (`parse_target_files`); listed ones are held to the same rule.
    names = set(recorded) or {n for n in storage.list_sizes(TARGET_DIR) if is_plain_name(n)}
    target = local / TARGET_DIR
    for name in sorted(names):
        path = target / name
        if name in recorded and _matches(path, recorded[name]):
            continue
        _download(storage, f"{TARGET_DIR}/{name}", path)
    if target.is_dir():  # files of an older copy the manifest no longer records would be refused as extra
        for extra in target.iterdir():
            # another process staging the same cache (a rank, a loader worker) writes under a temp name
            in_flight = extra.name.startswith(".") and not left_by_dead_process(extra)
            if extra.name not in names and extra.is_file() and not in_flight:
                extra.unlink()
    return local
