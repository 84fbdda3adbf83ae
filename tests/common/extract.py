"""Helpers shared by the extraction tests: a tiny target + dataset pair, configs, cache comparisons."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash.extract.config import ExtractConfig
from dflash.shards.reader import SHARDS_DIR, Cache
from tests.common.datasets import make_rows, write_save_to_disk

LAYERS = [0, 1, 2]  # of the 4-layer tiny targets: the reference can check all of them (not the last)


def tiny_rows(n: int = 24, *, seed: int = 0, max_len: int = 40) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows for the tiny targets (vocab 256): row 3 empty, row 5 unsupervised (both skipped)."""
    return make_rows(n, seed=seed, min_len=1, max_len=max_len, vocab=256, empty=(3,), unsupervised=(5,))


def write_dataset(root: Path, rows: list, *, rows_per_batch: int = 7) -> Path:
    """save_to_disk layout with several record batches (multi-chunk)."""
    return write_save_to_disk(rows, Path(root) / "dataset", num_files=2, rows_per_batch=rows_per_batch)


def make_config(target: Path, dataset: Path, out: Path, *, unit_bytes: int | None = None, **kw) -> ExtractConfig:
    """A CPU fp32 config; `unit_bytes` below ExtractConfig's 1 MiB floor is set after validation so tiny
    datasets still make several units (= shards)."""
    kw.setdefault("layers", LAYERS)
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("token_budget", 256)
    kw.setdefault("max_len", 32)
    cfg = ExtractConfig(target=target, dataset=dataset, out=out, **kw)
    if unit_bytes is not None:
        cfg.unit_bytes = unit_bytes
    return cfg


def shard_bytes(cache_dir: Path) -> dict[str, bytes]:
    d = Path(cache_dir) / SHARDS_DIR
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def samples_by_row(cache_dir: Path) -> dict[int, object]:
    with Cache.open(cache_dir) as cache:
        return {e.row: cache.read(e.row) for e in cache.entries()}
