"""Errors shared by every phase: bad data raises `ShardError`, bad settings `ValueError`.

Each message names the file, sample and field at fault and, where there is one, the fix.
"""

from __future__ import annotations


class ShardError(Exception):
    """A cache, shard or frame is malformed, corrupt, or does not match what was asked."""


class CorruptFrame(ShardError):
    """A frame's checksum or decoded size does not match its index entry."""


class ManifestMismatch(ShardError):
    """Two manifests (a resume, or a training run against a cache) disagree on fields that matter."""

    def __init__(self, what: str, differences: list[str]):
        self.differences = differences
        super().__init__(f"{what}: " + "; ".join(differences))


class DiskFull(ShardError):
    """The filesystem ran out of space; everything committed so far is intact."""


class LayoutMismatch(ShardError):
    """A shard's header (codec, layers, dtype, width) contradicts the manifest: files of two caches mixed, or
    one of them replaced. Not damage of one shard: skipping would drop every shard when the manifest is wrong."""


class DuplicateRows(ShardError):
    """A dataset row is stored more than once (two shards, or twice in one): a reader planning over the cache
    would use it twice. Never skipped: which copy is the right one is not for a reader to guess."""
