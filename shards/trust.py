"""What a reader takes from a manifest before opening any shard: the limits every index must respect, and
the refusals of a manifest nothing should be read through (each one line naming the field)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .codecs import DTYPES, codec_from_dict
from .errors import LayoutMismatch, ShardError
from .manifest import Manifest, ShardInfo
from .paths import unit_of_shard


@dataclass(frozen=True, slots=True)
class ReadLimits:
    """What a cache declares about its samples, enforced before anything is decoded: the longest sample
    (manifest `options.max_len`) and the vocabulary every token id must fall in (`target.vocab_size`)."""

    max_length: int | None = None
    vocab_size: int | None = None

    @classmethod
    def of(cls, manifest: Manifest) -> ReadLimits:
        def positive(value: object) -> int | None:
            return value if type(value) is int and value >= 1 else None

        return cls(positive(manifest.options.get("max_len")), positive(manifest.target.get("vocab_size")))

    def ids_problem(self, ids: np.ndarray) -> str | None:
        """Why token ids `ids` cannot be trusted (some fall outside the vocabulary), or None."""
        vocab = self.vocab_size
        if vocab is None or not ids.size or (int(ids.min()) >= 0 and int(ids.max()) < vocab):
            return None
        bad = int(np.count_nonzero((ids < 0) | (ids >= vocab)))
        return f"{bad} token ids outside the target's vocabulary 0..{vocab - 1}"


NO_LIMITS = ReadLimits()  # a shard opened alone: only the format's own bounds apply


def check_manifest_for_reading(m: Manifest, source: str) -> None:
    """Refuse, in one line, a manifest a reader cannot trust: unknown codec or dtype, repeated layers, and
    for a complete cache missing layers or a duplicated or malformed shard entry."""
    try:
        codec_from_dict(m.codec)
    except ValueError as exc:
        raise ShardError(f"{source}: codec: {exc}") from None
    if m.dtype not in DTYPES:
        raise ShardError(f"{source}: dtype {m.dtype!r} is not one of {sorted(DTYPES)}")
    if len(set(m.layers)) != len(m.layers):
        raise ShardError(f"{source}: 'layers' lists a layer twice: {m.layers}")
    # The limits readers enforce come from these fields: a value that is present but not a count would
    # silently lift a limit (ReadLimits ignores it) instead of refusing the cache.
    for section, key, least in (
        ("target", "vocab_size", 1),
        ("target", "hidden_size", 1),
        ("target", "num_hidden_layers", 1),
        ("options", "max_len", 1),
        ("dataset", "rows", 0),
    ):
        value = getattr(m, section).get(key)
        if value is not None and (type(value) is not int or value < least):
            raise ShardError(f"{source}: {section}.{key} is {value!r}, not an integer >= {least}")
    width = m.target.get("hidden_size")
    if width is not None and m.hidden_size and width != m.hidden_size:
        raise ShardError(f"{source}: target.hidden_size {width} != hidden_size {m.hidden_size}")
    if not m.complete:
        return
    if not m.layers or m.hidden_size < 1:
        raise ShardError(f"{source}: a complete cache needs layers and hidden_size >= 1")
    seen: set[str] = set()
    for n in (s.name for s in m.shards):
        if not isinstance(n, str) or unit_of_shard(n) is None:
            raise ShardError(f"{source}: shard name {n!r} is not of the form shard-NNNNNN.dfs")
        if n in seen:
            raise ShardError(f"{source}: shard {n} is listed twice")
        seen.add(n)


def check_shard_identity(path: Path, listed: ShardInfo, got: ShardInfo) -> None:
    """A shard must be the one the manifest committed: a shard copied in from another extraction has
    sound checksums of its own, and only its identity (index checksum, rows, bytes) tells it apart."""
    wrong = [
        f"{key} {getattr(got, key)!r} != manifest {getattr(listed, key)!r}"
        for key in ("index_checksum", "rows", "bytes")
        if getattr(got, key) != getattr(listed, key)
    ]
    if wrong:
        raise ShardError(
            f"{path}: not the shard this cache's manifest lists ({'; '.join(wrong)}): replaced or "
            "rewritten after extraction; restore it or re-extract"
        )


def check_shard_layout(
    path: Path, m: Manifest, codec: dict, layers: list[int], dtype: str, hidden: int
) -> None:
    """A shard's own header must describe the cache's layout: readers find frames through the shard's
    `layers` and decode them with its codec, dtype and width, so a shard whose header disagrees with the
    manifest (rewritten, or copied in from another cache) would hand training other layers or garbage."""
    wrong = [
        f"{key} {got!r} != manifest {want!r}"
        for key, got, want in (
            ("codec", codec, m.codec),
            ("layers", layers, list(m.layers)),
            ("dtype", dtype, m.dtype),
            ("hidden_size", hidden, m.hidden_size or hidden),  # 0: an incomplete cache's, not yet known
        )
        if got != want
    ]
    if wrong:  # not damage to this one shard: when the manifest is what changed, every shard disagrees
        raise LayoutMismatch(
            f"{path}: its header disagrees with the manifest ({'; '.join(wrong)}): this shard or manifest.json "
            "was replaced, or files of two caches were mixed; restore the cache's own files or re-extract "
            f"(`dflash-shards verify {path.parent.parent}` lists every shard that disagrees)"
        )
