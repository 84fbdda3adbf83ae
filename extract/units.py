"""Who writes which work unit, resume state, and the locks that keep independent runs out of one cache.

A work unit is one shard (`shards/shard-NNNNNN.dfs`, NNNNNN = unit index in the deterministic plan);
a committed shard is a finished unit, anything else is redone. Rank r of world w takes the
uncommitted units u with u % w == r, so any world size can resume any cache.

Coordination is the shared filesystem only (no process group needed):
- rank 0 holds `CACHE/.lock` (fcntl, exclusive) for the whole run. It checks or writes the manifest,
  removes temp files of killed writers, then writes `{"ready": true, world_size, run}` into the lock
  file. It is also the one that finalizes the manifest once every unit is committed.
- rank r > 0 holds `CACHE/.lock.rank<r>` and starts writing only after it sees `.lock` held and ready
  for the same world size and run id.
Two independent runs therefore always collide on some lock (rank 0's, a rank's own, or a world-size
mismatch) and the second one stops with a message naming the holder.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash.shards.errors import ShardError
from dflash.shards.locks import FileLock, holder_info, holder_text, is_held, read_holder
from dflash.shards.manifest import Manifest, load_manifest, refuse_other_settings, save_manifest
from dflash.shards.outdir import check_out_dir, raise_if_not_ours
from dflash.shards.paths import (
    LOCK_NAME,
    MANIFEST_NAME,
    committed_shard_names,
    shard_name,
    shard_path,
    unit_of_shard,
)
from dflash.shards.published import published_shards

log = logging.getLogger(__name__)


class CacheLocked(ShardError):
    """Another extraction holds the cache's lock."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankInfo:
    """This process's place in a (possibly multi-process) run; from torchrun's env or the defaults."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    run_id: str = ""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of world size {self.world_size}: need 0 <= RANK < WORLD_SIZE")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> RankInfo:
        env = dict(os.environ if env is None else env)
        try:
            rank = int(env.get("RANK", "0"))
            world = int(env.get("WORLD_SIZE", "1"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError as exc:
            raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers ({exc})") from None
        # Shared by all ranks of one launch; keeps a rank from joining another launch's rank 0.
        run = env.get("DFLASH_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or ""
        if not run and env.get("MASTER_ADDR"):
            run = f"{env['MASTER_ADDR']}:{env.get('MASTER_PORT', '')}"
        return cls(rank=rank, world_size=world, local_rank=local, run_id=run)


def committed_units(cache_dir: str | Path) -> set[int]:
    """Unit indexes whose shard is committed (renamed to its final name)."""
    return {unit_of_shard(name) for name in committed_shard_names(cache_dir)}


def assign_units(num_units: int, committed: Iterable[int], rank: int, world_size: int) -> list[int]:
    """The uncommitted units of `rank`: u % world_size == rank, ascending."""
    done = set(committed)
    return [u for u in range(rank, num_units, world_size) if u not in done]


def _rank_lock_path(cache_dir: Path, rank: int) -> Path:
    return cache_dir / (LOCK_NAME if rank == 0 else f"{LOCK_NAME}.rank{rank}")


class RunLocks:
    """This rank's lock on the cache plus the handshake with rank 0 (see the module docstring)."""

    def __init__(self, cache_dir: Path, rank: RankInfo):
        self.cache_dir = cache_dir
        self.rank = rank
        self.lock = FileLock(_rank_lock_path(cache_dir, rank.rank))

    def _info(self, ready: bool) -> dict[str, Any]:
        r = self.rank
        return holder_info(rank=r.rank, world_size=r.world_size, run=r.run_id, ready=ready)

    def acquire(self) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # A short retry covers rank 0 probing this rank's lock at the moment we start.
        if not self.lock.acquire(retry_seconds=2.0):
            holder = read_holder(self.lock.path)
            raise CacheLocked(
                f"{self.cache_dir} is being written by another extraction ({holder_text(holder)}; lock "
                f"{self.lock.path.name}); wait for it to finish or choose another --out"
            )
        self.lock.write(self._info(ready=False))

    def mark_ready(self) -> None:
        self.lock.write(self._info(ready=True))

    def wait_for_rank0(self, timeout: float = 600.0) -> None:
        """Rank > 0: block until this run's rank 0 holds `.lock` and has prepared the cache."""
        path = self.cache_dir / LOCK_NAME
        deadline = time.monotonic() + timeout
        mismatch = ""
        while time.monotonic() < deadline:
            info = read_holder(path)
            if is_held(path) and info.get("ready"):
                if info.get("world_size") == self.rank.world_size and info.get("run", "") == self.rank.run_id:
                    return
                mismatch = f"; {path.name} is held by {holder_text(info)}, a different run"
            time.sleep(0.05)
        raise CacheLocked(
            f"rank {self.rank.rank}: rank 0 of this run did not prepare {self.cache_dir} within {timeout:.0f} s"
            f"{mismatch}; start all ranks with the same command and world size"
        )

    def others_alive(self) -> bool:
        """Rank 0: whether any other rank of this run still holds its lock."""
        return any(is_held(_rank_lock_path(self.cache_dir, r)) for r in range(1, self.rank.world_size))

    def release(self) -> None:
        self.lock.release()


def check_or_write_manifest(cache_dir: Path, expected: Manifest, *, write: bool) -> Manifest:
    """Compare an existing manifest's provenance with `expected` (refuse on any difference) or write it.

    Returns the manifest on disk (which may already be complete). Only rank 0 writes.
    """
    path = cache_dir / MANIFEST_NAME
    if os.path.lexists(path):
        current = load_manifest(cache_dir)
        refuse_other_settings(current, expected, f"{cache_dir} was extracted with other settings")
        return current
    if not write:
        raise ShardError(f"{path} is missing although rank 0 reported the cache ready")
    existing = (
        [p.name for p in cache_dir.iterdir() if not p.name.startswith(".")] if cache_dir.is_dir() else []
    )
    if existing:
        raise ValueError(
            f"{cache_dir} is not empty ({', '.join(sorted(existing)[:5])}) and has no manifest.json: "
            "not a dflash cache; choose an empty or new --out"
        )
    save_manifest(cache_dir, expected)
    return expected


def reopen_for_lost_shards(cache_dir: Path, manifest: Manifest) -> Manifest:
    """A complete cache whose listed shards are missing or cut short is marked incomplete again, so the same
    command extracts them again (as it resumes any extraction); a shard of another size that reads whole is
    another cache's, and is refused rather than deleted."""
    from dflash.shards.cache import shard_file_problems
    from dflash.shards.reader import ShardReader

    published = published_shards(cache_dir)  # uploaded and deleted here on purpose (an object-storage run)
    problems = {
        n: p for n, p in shard_file_problems(cache_dir, manifest.shards).items() if n not in published
    }
    if not problems:
        return manifest
    for name, problem in problems.items():
        path = shard_path(cache_dir, name)
        if not path.is_file():
            continue
        try:
            ShardReader.open(path).close()
        except (ShardError, OSError):
            continue  # cut short: `drop_unreadable_shards` removes it and its unit is redone
        raise ShardError(
            f"{problem}, yet it reads as a whole shard: not the one this cache lists; move it out of the "
            "cache and re-run this command to extract it again"
        )
    log.warning(
        "%d of %d shards of this complete cache are missing or cut short (%s): extracting them again",
        len(problems),
        len(manifest.shards),
        "; ".join(list(problems.values())[:3]),
    )
    manifest.complete = False
    save_manifest(cache_dir, manifest)  # a repair cut short resumes like any extraction
    return manifest


def drop_unreadable_shards(cache_dir: Path, committed: set[int]) -> set[int]:
    """Remove committed shards whose footer does not parse (a disk error after commit): they are redone."""
    from dflash.shards.reader import ShardReader

    raise_if_not_ours(cache_dir, "cache")
    published = published_shards(cache_dir)
    good = {u for u in committed if shard_name(u) in published}  # whole in object storage, gone from here
    for u in sorted(committed - good):
        path = shard_path(cache_dir, shard_name(u))
        try:
            ShardReader.open(path).close()
            good.add(u)
        except FileNotFoundError:  # uploaded to object storage and deleted meanwhile: recorded since
            if path.name in published_shards(cache_dir):
                good.add(u)
        except (ShardError, OSError) as exc:
            log.warning("removing unreadable shard %s (%s); its unit is redone", path.name, exc)
            path.unlink(missing_ok=True)
    return good


def wait_for_claim(cache_dir: Path, timeout: float = 600.0) -> None:
    """Rank > 0: wait until rank 0 has claimed `cache_dir` (its `.dflash` mark or a manifest); refuse
    at once a directory the --out rule forbids, so no rank creates its lock file there."""
    deadline = time.monotonic() + timeout
    while not check_out_dir(cache_dir, "cache"):
        if time.monotonic() >= deadline:
            raise CacheLocked(
                f"rank 0 of this run did not claim {cache_dir} within {timeout:.0f} s; start all ranks together"
            )
        time.sleep(0.05)


def wait_for_other_ranks(cache_dir: Path, num_units: int, locks: RunLocks, grace_s: float) -> bool:
    """Rank 0: True once every unit is committed; False when units are left and no other rank has held
    its lock for grace_s seconds (they died or never started: the caller takes their units over)."""
    alone_since: float | None = None
    while True:
        left = num_units - len(committed_units(cache_dir))
        if left <= 0:
            return True
        if locks.others_alive():
            alone_since = None
        elif alone_since is None:
            alone_since = time.monotonic()
        elif time.monotonic() - alone_since >= grace_s:
            log.warning("%d units are uncommitted and no other rank is running; rank 0 takes them over", left)
            return False
        time.sleep(0.2)
