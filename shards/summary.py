"""Summaries behind `dflash-shards info|ls|show|stats` as plain JSON-ready dicts (no printing here)."""

from __future__ import annotations

import random
from typing import Any

import torch

from . import sizes
from .cache import Cache
from .sizes import CacheSize


def cache_info(cache: Cache) -> dict[str, Any]:
    """Size and provenance: samples, tokens, stored bytes against the states' raw bytes in the stored dtype
    (`sizes.CacheSize`) and the ratio between them."""
    m = cache.manifest
    infos = cache.shard_infos
    samples = sum(s.rows for s in infos)
    tokens = sum(s.tokens for s in infos)
    size = cache_size(cache)
    stored, raw = size.stored_bytes, size.raw_bytes
    return {
        "path": cache.location,
        "complete": m.complete,
        "samples": samples,
        "tokens": tokens,
        "supervised": sum(s.supervised for s in infos),
        "bytes": stored,
        "raw_bytes": raw,
        "raw_dtype": size.dtype,
        "ratio": size.ratio,
        "bytes_per_token": stored / tokens if tokens else None,
        "shards": len(infos),
        "layers": list(m.layers),
        "hidden_size": m.hidden_size,
        "dtype": m.dtype,
        "codec": dict(m.codec),
        "target": dict(m.target),
        "dataset": dict(m.dataset),
        "skipped": len(m.skipped),
        "tool_version": m.tool_version,
    }


def cache_size(cache: Cache) -> CacheSize:
    """The cache's stored bytes (every listed shard file) against its states' raw bytes."""
    m = cache.manifest
    return sizes.cache_size(cache.shard_infos, len(m.layers), m.hidden_size, m.dtype)


def shard_list(cache: Cache) -> list[dict[str, Any]]:
    return [s.to_dict() for s in cache.shard_infos]


def tensor_stats(x: torch.Tensor) -> dict[str, Any]:
    """mean/std/absmax over the finite values (float64) and the number of NaN/Inf elements."""
    xf = x.double()
    finite = torch.isfinite(xf)
    n_bad = int((~finite).sum())
    vals = xf[finite] if n_bad else xf.reshape(-1)
    if vals.numel() == 0:
        return {"mean": None, "std": None, "absmax": None, "nonfinite": n_bad}
    return {
        "mean": float(vals.mean()),
        "std": float(vals.std(unbiased=False)),
        "absmax": float(vals.abs().max()),
        "nonfinite": n_bad,
    }


def sample_report(cache: Cache, row: int) -> dict[str, Any]:
    try:
        s = cache.read(row)
    except KeyError:
        reasons = [
            s.get("reason") for s in cache.manifest.skipped if isinstance(s, dict) and s.get("row") == row
        ]
        why = f": skipped at extraction ({reasons[0]})" if reasons else ""
        raise ValueError(f"{cache.location}: row {row} is not in this cache{why}") from None
    return {
        "row": s.row,
        "length": s.length,
        "supervised": int(s.loss_mask.sum()),
        "layers": {str(layer): tensor_stats(x) for layer, x in s.hidden.items()},
    }


def _length_histogram(lengths: list[int]) -> list[dict[str, int]]:
    """Counts per power-of-two bucket (lo, hi]: (0, 1], (1, 2], (2, 4], ..."""
    counts: dict[int, int] = {}
    for n in lengths:
        hi = 1 << max(0, (n - 1).bit_length())
        counts[hi] = counts.get(hi, 0) + 1
    return [{"lo": hi // 2, "hi": hi, "count": counts[hi]} for hi in sorted(counts)]


def cache_stats(cache: Cache, sample: int = 64, seed: int = 0, top_channels: int = 5) -> dict[str, Any]:
    """Per-layer activation statistics over `sample` random rows (all if fewer); lengths over all rows."""
    entries = cache.entries()
    lengths = sorted(e.length for e in entries)
    picked = random.Random(seed).sample(entries, min(sample, len(entries)))
    acc: dict[int, dict[str, Any]] = {}
    for e in picked:
        s = cache.shard(e.shard).read(e.index)
        for layer, x in s.hidden.items():
            xf = x.double()
            finite = torch.isfinite(xf)
            bad = int((~finite).sum())
            xf = torch.where(finite, xf, torch.zeros((), dtype=xf.dtype))
            a = acc.setdefault(
                layer, {"n": 0, "sum": 0.0, "sumsq": 0.0, "absmax": 0.0, "nonfinite": 0, "ch": 0}
            )
            a["n"] += int(finite.sum())
            a["sum"] += float(xf.sum())
            a["sumsq"] += float((xf * xf).sum())
            a["absmax"] = max(a["absmax"], float(xf.abs().max()))
            a["nonfinite"] += bad
            a["ch"] = a["ch"] + xf.abs().sum(dim=0)
    layers = {}
    for layer, a in acc.items():
        n = max(a["n"], 1)
        mean = a["sum"] / n
        top = torch.topk(a["ch"], min(top_channels, a["ch"].numel()))
        layers[str(layer)] = {
            "mean": mean,
            "std": max(a["sumsq"] / n - mean * mean, 0.0) ** 0.5,
            "rms": (a["sumsq"] / n) ** 0.5,
            "absmax": a["absmax"],
            "nonfinite": a["nonfinite"],
            "top_channels": [int(i) for i in top.indices],
        }

    def pct(q: float) -> int | None:
        return lengths[min(len(lengths) - 1, int(q * len(lengths)))] if lengths else None

    return {
        "rows": len(entries),
        "rows_sampled": len(picked),
        "tokens_sampled": sum(e.length for e in picked),
        "layers": layers,
        "lengths": {
            "min": lengths[0] if lengths else None,
            "p50": pct(0.5),
            "p90": pct(0.9),
            "max": lengths[-1] if lengths else None,
            "mean": sum(lengths) / len(lengths) if lengths else None,
        },
        "length_histogram": _length_histogram(lengths),
    }
