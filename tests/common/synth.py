"""LLM-like hidden states for tests and benches (no model needed).

Real decoder activations are far from i.i.d. Gaussian: channel scales spread log-normally, a few
"massive" channels sit 50-1000x above the rest, tokens vary in norm, and the residual stream grows
with depth. Codec ratios and fp8 errors measured on plain Gaussians would flatter both codecs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from dflash.shards import (
    Manifest,
    ShardMeta,
    ShardWriter,
    encode_sample,
    get_codec,
    save_manifest,
    shard_name,
)
from dflash.shards.codecs import dtype_name
from dflash.shards.target_files import digest_files

from .fake_cache import TINY_TARGET, write_fake_target


def llm_like_layers(
    seq_len: int,
    hidden: int,
    num_layers: int = 5,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    massive_channels: int = 4,
    channel_sigma: float = 0.8,
    token_sigma: float = 0.3,
    layer_growth: float = 1.6,
) -> list[torch.Tensor]:
    """`num_layers` tensors [seq_len, hidden] of `dtype`; layer l has scale layer_growth**l."""
    rng = np.random.default_rng(seed)
    channel_scale = rng.lognormal(0.0, channel_sigma, size=hidden).astype(np.float32)
    n_massive = min(massive_channels, hidden)
    if n_massive:
        idx = rng.choice(hidden, size=n_massive, replace=False)
        channel_scale[idx] *= rng.uniform(50.0, 1000.0, size=n_massive).astype(np.float32)
    out = []
    for layer in range(num_layers):
        token_scale = rng.lognormal(0.0, token_sigma, size=(seq_len, 1)).astype(np.float32)
        x = rng.standard_normal((seq_len, hidden), dtype=np.float32)
        x *= channel_scale * token_scale * np.float32(layer_growth**layer)
        t = torch.from_numpy(x)
        if dtype == torch.float16:  # massive channels of deep layers exceed fp16; real fp16 models saturate
            t = t.clamp_(-60000.0, 60000.0)
        out.append(t.to(dtype))
    return out


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """||approx - exact|| / ||exact|| in float64 (0 for an all-zero exact)."""
    a, e = approx.double(), exact.double()
    denom = e.norm().item()
    return (a - e).norm().item() / denom if denom else (a - e).norm().item()


def make_cache(
    path: str | Path,
    lengths: list[int],
    *,
    layers: tuple[int, ...] = (1, 3),
    hidden: int = 32,
    codec: str = "lossless",
    rows_per_shard: int = 4,
    seed: int = 0,
    complete: bool = True,
    skipped: tuple[tuple[int, str], ...] = (),
    dtype: torch.dtype = torch.bfloat16,
) -> dict[int, list[torch.Tensor]]:
    """A small real cache at `path` (rows 0..len(lengths)-1, row i of length lengths[i], except the
    `skipped` rows); returns {row: [layer tensors]} as written, for comparisons."""
    c = get_codec(codec)
    stored = c.stored_dtype(dtype_name(dtype))
    manifest = Manifest(
        target={"name_or_path": "synthetic", "model_type": "qwen3", "hidden_size": hidden},
        layers=list(layers),
        dtype=stored,
        hidden_size=hidden,
        codec=c.to_dict(),
        dataset={"rows": len(lengths)},
        skipped=[{"row": r, "reason": why} for r, why in skipped],
    )
    save_manifest(path, manifest)
    # target/ as extraction writes it first (a vocabulary above every id written below)
    target = {**TINY_TARGET, "hidden_size": hidden, "head_dim": hidden // 2, "vocab_size": 8192}
    write_fake_target(Path(path) / "target", target, seed)
    manifest.target_files = digest_files(Path(path) / "target")
    skip = {r for r, _ in skipped}
    rows = [r for r in range(len(lengths)) if r not in skip]
    written: dict[int, list[torch.Tensor]] = {}
    infos = []
    meta = ShardMeta(codec=c, layers=list(layers), hidden_size=hidden, dtype=stored)
    for unit, start in enumerate(range(0, len(rows), rows_per_shard)):
        with ShardWriter(Path(path) / "shards" / shard_name(unit), meta) as w:
            for r in rows[start : start + rows_per_shard]:
                s = lengths[r]
                xs = llm_like_layers(s, hidden, len(layers), seed=seed * 100003 + r, dtype=dtype)
                ids = torch.arange(s) * 7 + r
                mask = (torch.arange(s) % 3) != 0
                w.append(encode_sample(c, r, ids, mask, xs))
                written[r] = xs
            infos.append(w.commit())
    if complete:
        manifest.shards = infos
        manifest.complete = True
        save_manifest(path, manifest)
    return written
