"""The names of a cache's files, spelled once (who writes and who reads each one: ARCHITECTURE.md).

CACHE/manifest.json             `manifest.py`
CACHE/shards/shard-NNNNNN.dfs   `writer.py` writes, `reader.py` reads (NNNNNN: the work unit)
CACHE/target/                   `target_parts.py` (config.json, frozen.safetensors, tokenizer files)
CACHE/.lock, .lock.rank<r>      held by a running extraction (`dflash.extract.units`)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MANIFEST_NAME = "manifest.json"
SHARDS_DIR = "shards"
TARGET_DIR = "target"
LOCK_NAME = ".lock"
SHARD_SUFFIX = ".dfs"
# [0-9], not \d (which takes any Unicode digit); fullmatch, since `$` also matches before a final newline.
_SHARD_RE = re.compile(r"shard-([0-9]{6,})\.dfs")


def shard_name(unit: int) -> str:
    """File name of work unit `unit`'s shard: shard-000123.dfs."""
    if unit < 0:
        raise ValueError(f"shard unit id must be >= 0, got {unit}")
    return f"shard-{unit:06d}{SHARD_SUFFIX}"


def unit_of_shard(name: str) -> int | None:
    """The work unit of a committed shard's file name; None for any other name (temp files included)."""
    m = _SHARD_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def shard_path(cache_dir: str | os.PathLike, name: str) -> Path:
    return Path(cache_dir) / SHARDS_DIR / name


def committed_shard_names(cache_dir: str | os.PathLike) -> list[str]:
    """The committed shards in CACHE/shards/ (renamed to their final name), and those a staging directory
    uploaded and deleted (`published.py`), sorted."""
    from .published import published_shards  # it reads this module's names

    d = Path(cache_dir) / SHARDS_DIR
    local = {p.name for p in d.iterdir() if unit_of_shard(p.name) is not None} if d.is_dir() else set()
    return sorted(local | set(published_shards(cache_dir)))
