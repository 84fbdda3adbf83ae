"""Byte counts and a cache's size: one definition, used by the demo, `dflash-shards info`, extraction's
summary and `convert` (no torch: dry runs stay light).

A cache's size is its stored bytes (every shard file: frames, index and footer) against the raw bytes of
the hidden states it holds, in the dtype they are stored and decode to (the manifest's `dtype`): tokens x
layers x hidden x itemsize. `ratio` = raw / stored, so lossless float32 and lossless bfloat16 caches of
the same states have different ratios and the text always names the dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

# Bytes per element of the dtypes a cache stores (shards/codec_base.py DTYPES, kept torch-free here).
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def size_text(n: float) -> str:
    """Bytes in binary units: '512 B', '1.5 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def raw_state_bytes(tokens: int, num_layers: int, hidden_size: int, dtype: str) -> int:
    """Bytes of `tokens` x `num_layers` x `hidden_size` hidden states in `dtype`, uncompressed."""
    if dtype not in ITEMSIZE:
        raise ValueError(f"unknown stored dtype {dtype!r}; expected one of {sorted(ITEMSIZE)}")
    return tokens * num_layers * hidden_size * ITEMSIZE[dtype]


class _ShardSize(Protocol):
    tokens: int
    bytes: int


@dataclass(frozen=True, slots=True)
class CacheSize:
    """Stored bytes of a cache (or of one run's share of it) against its states' raw bytes
    (`raw_state_bytes` in the stored dtype)."""

    stored_bytes: int
    raw_bytes: int
    dtype: str  # the stored dtype, as the manifest names it

    @property
    def ratio(self) -> float | None:
        """raw / stored (> 1: smaller than the raw states); None when nothing is stored."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else None

    def text(self) -> str:
        """'34.7 MiB stored, 40.8 MiB raw float32 states, ratio 1.17x' (the one wording everywhere)."""
        ratio = f"{self.ratio:.2f}x" if self.ratio else "-"
        return (
            f"{size_text(self.stored_bytes)} stored, {size_text(self.raw_bytes)} raw {self.dtype} states, "
            f"ratio {ratio}"
        )

    def to_dict(self) -> dict[str, object]:
        return {
            "bytes": self.stored_bytes,
            "raw_bytes": self.raw_bytes,
            "raw_dtype": self.dtype,
            "ratio": self.ratio,
        }


def cache_size(shards: Iterable[_ShardSize], num_layers: int, hidden_size: int, dtype: str) -> CacheSize:
    """The size of a cache whose shards (manifest `ShardInfo`s) hold states of `num_layers` x `hidden_size`
    stored as `dtype`: their file bytes against `raw_state_bytes` of their tokens."""
    shards = list(shards)
    tokens = sum(s.tokens for s in shards)
    return CacheSize(
        stored_bytes=sum(s.bytes for s in shards),
        raw_bytes=raw_state_bytes(tokens, num_layers, hidden_size, dtype),
        dtype=dtype,
    )
