"""Copy the frozen target parts training needs into CACHE/target/, so `dflash-train` never opens the target.

    CACHE/target/config.json           the target's config.json, byte for byte
    CACHE/target/frozen.safetensors    embed_tokens.weight [V, H], lm_head.weight [V, H] (bf16)
    CACHE/target/tokenizer*.json ...   tokenizer and chat-template files when the target has them

The two matrices are read by tensor name from the checkpoint's safetensors files (via the index json
when sharded), never by loading the model. The directory is built beside its final name and renamed
into place, so CACHE/target/ is either complete or absent.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from dflash.shards.errors import DiskFull, ShardError
from dflash.shards.manifest import fsync_dir
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)

TARGET_DIR = "target"
FROZEN_NAME = "frozen.safetensors"
# Tokenizer, chat template and generation defaults: small files a drafter export or a demo may need.
EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
# Known checkpoint names, most specific first; the VLM-wrapped qwen3_5 nests the text model as language_model.
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")


def _weight_map(target: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index json or the single model.safetensors."""
    index = target / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        return {name: target / file for name, file in data.get("weight_map", {}).items()}
    single = target / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(
        f"target {target}: no model.safetensors or model.safetensors.index.json (only safetensors checkpoints are read)"
    )


def _find(weights: Mapping[str, Path], names: tuple[str, ...], suffix: str) -> str | None:
    for name in names:
        if name in weights:
            return name
    # Unknown wrappers: the one tensor ending with the suffix outside vision / multi-token-prediction parts.
    found = [
        n for n in weights if n.endswith(suffix) and not any(p in n for p in ("visual", "vision", "mtp"))
    ]
    return found[0] if len(found) == 1 else None


def _read(weights: Mapping[str, Path], name: str) -> torch.Tensor:
    with safe_open(weights[name], framework="pt") as f:
        return f.get_tensor(name)


def _tied(config: Mapping[str, Any]) -> bool:
    text = config.get("text_config") or {}
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    return bool(text.get("tie_word_embeddings", False))


def read_frozen(target: str | Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """{"embed_tokens.weight", "lm_head.weight"} read from the checkpoint by name (lm_head = embed when tied)."""
    target = Path(target)
    config = json.loads((target / "config.json").read_text())
    weights = _weight_map(target)
    embed_name = _find(weights, EMBED_NAMES, "embed_tokens.weight")
    if embed_name is None:
        raise ShardError(
            f"target {target}: no embed_tokens weight among {len(weights)} tensors (tried {EMBED_NAMES})"
        )
    embed = _read(weights, embed_name)
    head_name = _find(weights, LM_HEAD_NAMES, "lm_head.weight")
    if _tied(config) or head_name is None:
        if not _tied(config):
            raise ShardError(
                f"target {target}: tie_word_embeddings is false but the checkpoint has no lm_head weight "
                f"(tried {LM_HEAD_NAMES})"
            )
        head = embed
    else:
        head = _read(weights, head_name)
    if head.shape != embed.shape:
        raise ShardError(
            f"target {target}: lm_head {tuple(head.shape)} and embed_tokens {tuple(embed.shape)} differ"
        )
    return {
        "embed_tokens.weight": embed.to(dtype).contiguous(),
        "lm_head.weight": head.to(dtype).contiguous(),
    }


def _save_frozen(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, its I/O errors (raised as SafetensorError) turned into one-line ones."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except Exception as exc:
        text = str(exc)
        if "os error 28" in text or "os error 122" in text:  # ENOSPC, EDQUOT
            raise DiskFull(
                f"{path}: no space left on device while writing the target's frozen parts; committed work "
                "is intact, free space and re-run the same command to resume"
            ) from None
        raise ShardError(f"{path}: could not write the target's frozen parts ({text})") from None


def write_target_parts(
    cache_dir: str | Path, target: str | Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write CACHE/target/ atomically; an existing one for the same config.json is kept as is."""
    cache_dir, target = Path(cache_dir), Path(target)
    final = cache_dir / TARGET_DIR
    config_bytes = (target / "config.json").read_bytes()
    if (final / FROZEN_NAME).is_file() and (final / "config.json").is_file():
        if (final / "config.json").read_bytes() == config_bytes:
            return final
        log.warning("%s holds another target's parts; replacing them", final)
    tmp = cache_dir / f".{TARGET_DIR}.tmp-{os.getpid()}"
    if tmp.is_symlink():  # planted: remove the link itself, never what it points to
        tmp.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_bytes(config_bytes)
        tensors = read_frozen(target, dtype)
        _save_frozen(tensors, tmp / FROZEN_NAME, {"source": str(target)})
        for name in EXTRA_FILES:
            if (target / name).is_file():
                shutil.copyfile(target / name, tmp / name)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(cache_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
