"""A complete synthetic cache written with the real shards writer, for the training and loader benchmarks:
LLM-like features (log-normal channel scales, massive channels; each sample a window of a per-layer pool so
writing is fast), a target config of any shape, random frozen embed/lm_head; fp8 quantized on the device as the
extractor does."""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards import (
    Manifest,
    ShardWriter,
    encode_sample,
    get_codec,
    quantize_fp8,
    save_manifest,
    shard_name,
)
from dflash.shards.layers import default_layer_ids
from dflash.shards.manifest import target_info
from dflash.shards.writer import ShardMeta

from tests.common.synth import llm_like_layers


def write_cache(
    root: Path,
    target: dict[str, Any],
    *,
    codec_name: str,
    samples: int,
    min_len: int,
    max_len: int,
    per_shard: int,
    device: torch.device,
    threads: int,
    seed: int = 0,
    layers: list[int] | None = None,
) -> dict[str, Any]:
    """A complete cache of `layers` (default: DFlash's rule for 5 drafter layers); returns write stats."""
    h, vocab = target["hidden_size"], target["vocab_size"]
    layers = layers or default_layer_ids(target["num_hidden_layers"], 5)
    rng = np.random.default_rng(seed)
    pool_len = 2 * max_len
    pool = llm_like_layers(pool_len, h, len(layers), seed=seed)  # each sample is a random window of it
    codec = get_codec(codec_name)
    meta = ShardMeta(codec=codec, layers=layers, hidden_size=h, dtype="bfloat16")
    lengths = rng.integers(min_len, max_len + 1, size=samples)
    starts = rng.integers(0, pool_len - max_len, size=samples)

    def encode(row: int) -> Any:
        s, a = int(lengths[row]), int(starts[row])
        ids = np.random.default_rng(row).integers(0, min(vocab, 151643), size=s)
        mask = np.ones(s, np.uint8)
        mask[: s // 5] = 0
        feats = [x[a : a + s] for x in pool]
        if codec_name == "fp8":
            feats = [quantize_fp8(f.to(device)) for f in feats]
        return encode_sample(codec, row, ids, mask, feats)

    t0 = time.perf_counter()
    infos, raw = [], 0
    with ThreadPoolExecutor(threads) as ex:
        for unit, start in enumerate(range(0, samples, per_shard)):
            with ShardWriter(root / "shards" / shard_name(unit), meta) as w:
                for enc in ex.map(encode, range(start, min(start + per_shard, samples))):
                    w.append(enc)
                    raw += enc.length * h * 2 * len(layers)
                infos.append(w.commit())
    write_s = time.perf_counter() - t0
    tdir = root / "target"
    tdir.mkdir(parents=True, exist_ok=True)
    (tdir / "config.json").write_text(json.dumps(target))
    g = torch.Generator(device=device).manual_seed(seed)
    save_file(
        {
            k: (torch.randn(vocab, h, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()
            for k in ("embed_tokens.weight", "lm_head.weight")
        },
        str(tdir / "frozen.safetensors"),
    )
    save_manifest(
        root,
        Manifest(
            complete=True,
            target=target_info(target, "synthetic"),
            layers=layers,
            hidden_size=h,
            codec=codec.to_dict(),
            dataset={"name": "synthetic"},
            options={},
            plan={},
            shards=infos,
        ),
    )
    stored = sum(i.bytes for i in infos)
    return {
        "samples": samples,
        "tokens": int(lengths.sum()),
        "raw_gb": raw / 1e9,
        "stored_gb": stored / 1e9,
        "ratio": raw / stored,
        "write_s": write_s,
        "write_raw_gbps": raw / 1e9 / write_s,
    }
