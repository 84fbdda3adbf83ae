"""A small, valid cache written directly with the shards writer (no target forward), for trainer tests.

`structured=True` makes the data learnable: token sequences follow a fixed successor table with a
little noise, and each cached layer holds a fixed random projection of the current token (plus
noise), so a drafter can learn to draft the next tokens and tau rises above 1 within a few hundred
tiny steps. `target/` holds config.json, frozen.safetensors (random embed/lm_head) and a tokenizer
whose size leaves free rows for the mask token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dflash.shards import (
    Manifest,
    ShardReader,
    ShardWriter,
    encode_sample,
    get_codec,
    save_manifest,
    shard_name,
)
from dflash.shards.manifest import target_info
from dflash.shards.target_files import digest_files
from dflash.shards.writer import ShardMeta
from safetensors.torch import save_file

TINY_TARGET: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
TOKENIZER_SIZE = 90  # ids 90..95 are free rows: the default mask token is 90


def write_fake_target(target_dir: Path, config: dict[str, Any], seed: int) -> None:
    """CACHE/target/ for `config`: config.json, random frozen embed/lm_head, a word-level tokenizer."""
    from tokenizers import Tokenizer, models

    target_dir.mkdir(parents=True, exist_ok=True)
    (target_dir / "config.json").write_text(json.dumps(config, indent=1))
    g = torch.Generator().manual_seed(seed)
    v, h = config["vocab_size"], config["hidden_size"]
    save_file(
        {
            "embed_tokens.weight": torch.randn(v, h, generator=g).to(torch.bfloat16),
            "lm_head.weight": (torch.randn(v, h, generator=g) / h**0.5).to(torch.bfloat16),
            "final_norm.gain": 1 + 0.1 * torch.randn(h, generator=g),  # as extraction stores it
        },
        str(target_dir / "frozen.safetensors"),
    )
    vocab = {f"t{i}": i for i in range(TOKENIZER_SIZE)}
    Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0")).save(str(target_dir / "tokenizer.json"))


def write_fake_cache(
    path: str | os.PathLike,
    *,
    num_samples: int = 64,
    samples_per_shard: int = 16,
    min_len: int = 12,
    max_len: int = 40,
    layers: tuple[int, ...] = (0, 1, 2, 3),
    codec: str = "lossless",
    structured: bool = True,
    noise: float = 0.3,
    seed: int = 0,
    target: dict[str, Any] | None = None,
    nonfinite_rows: tuple[int, ...] = (),
) -> Path:
    """Write CACHE/{manifest.json, shards/, target/}; rows are 0..num_samples-1, prompts unsupervised.
    Rows in `nonfinite_rows` hold a NaN and an inf in every layer (valid checksums: damage at the source)."""
    root = Path(path)
    config = dict(TINY_TARGET if target is None else target)
    h, vocab = config["hidden_size"], TOKENIZER_SIZE
    rng = np.random.default_rng(seed)
    successor = (
        rng.permutation(vocab - 3) + 3
    )  # a fixed "language": token t is usually followed by successor[t]
    projections = [rng.standard_normal((vocab, h)).astype(np.float32) for _ in layers]
    codec_obj = get_codec(codec)
    meta = ShardMeta(codec=codec_obj, layers=list(layers), hidden_size=h, dtype="bfloat16")
    infos = []
    for unit, start in enumerate(range(0, num_samples, samples_per_shard)):
        with ShardWriter(root / "shards" / shard_name(unit), meta) as writer:
            for row in range(start, min(start + samples_per_shard, num_samples)):
                s = int(rng.integers(min_len, max_len + 1))
                ids = np.empty(s, dtype=np.int64)
                ids[0] = rng.integers(3, vocab)
                for t in range(1, s):
                    jump = rng.random() < 0.1 or not structured
                    ids[t] = rng.integers(3, vocab) if jump else successor[ids[t - 1] - 3]
                mask = np.ones(s, dtype=np.uint8)
                mask[: max(1, s // 4)] = 0
                hidden = []
                for proj in projections:
                    x = proj[ids] if structured else np.zeros((s, h), np.float32)
                    x = x + noise * rng.standard_normal((s, h)).astype(np.float32)
                    if row in nonfinite_rows:
                        x[s // 2, :2] = (np.nan, np.inf)
                    hidden.append(torch.from_numpy(x).to(torch.bfloat16))
                writer.append(encode_sample(codec_obj, row, ids, mask, hidden))
            infos.append(writer.commit())
    write_fake_target(root / "target", config, seed)
    manifest = Manifest(
        complete=True,
        target=target_info(config, "tiny-fake-target"),
        layers=list(layers),
        dtype="bfloat16",
        hidden_size=h,
        codec=codec_obj.to_dict(),
        dataset={"name": "fake", "rows": num_samples, "seed": seed},
        options={"max_len": max_len},
        plan={"samples_per_shard": samples_per_shard},
        shards=infos,
        target_files=digest_files(root / "target"),
    )
    save_manifest(root, manifest)
    return root


def corrupt_sample(cache_dir: str | os.PathLike, shard: str, index: int, frame: int = 2) -> int:
    """Flip one byte inside frame `frame` (2 = first layer) of sample `index`; returns that sample's row."""
    path = Path(cache_dir) / "shards" / shard
    with ShardReader.open(path) as reader:
        entry = reader.entries[index]
        offset, length, _ = entry.frames[frame]
    with open(path, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)
        f.seek(offset + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return entry.row
