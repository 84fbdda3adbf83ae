"""The frozen target parts training needs, read from the target checkpoint for `CACHE/target/`.

The embedding and lm_head are read by tensor name from the checkpoint's safetensors files (via the
index json when sharded), never by loading the model; `dflash.shards.target_parts` writes and checks
the directory (its layout, and why a tied target stores one matrix, are documented there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from dflash.shards.errors import ShardError
from dflash.shards.safe_io import read_json
from dflash.shards.target_config import CONFIG_NAME, TargetConfig, read_target_config
from dflash.shards.target_parts import EMBED_KEY, EXTRA_FILES, FINAL_NORM_KEY, LM_HEAD_KEY
from dflash.shards.target_parts import write_target_parts as write_parts
from safetensors import SafetensorError, safe_open

# Known checkpoint names, most specific first; the VLM-wrapped qwen3_5 nests the text model as language_model.
EMBED_NAMES = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
FINAL_NORM_NAMES = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
)
# Model types whose RMSNorm multiplies by (1 + weight) (weights stored centred at zero), the others by weight.
ZERO_CENTRED_NORMS = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
KNOWN_NORMS = ZERO_CENTRED_NORMS | {"qwen2", "qwen3", "qwen3_moe"}


def _weight_map(target: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index json or the single model.safetensors."""
    index = target / "model.safetensors.index.json"
    if index.is_file():
        data = read_json(index, max_bytes=64 << 20)  # depth-limited; special files refused
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict):
            raise ShardError(f"{index}: no 'weight_map' object: not a safetensors index")
        return {name: target / str(file) for name, file in weight_map.items()}
    single = target / "model.safetensors"
    if single.is_file():
        with _readable(single), safe_open(single, framework="pt") as f:
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
    with _readable(weights[name]), safe_open(weights[name], framework="pt") as f:
        return f.get_tensor(name)


@contextlib.contextmanager
def _readable(path: Path) -> Iterator[None]:
    """safetensors' refusal of a damaged file (multi-line, its own type) as one line naming the file."""
    try:
        yield
    except SafetensorError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ShardError(f"target {path}: not a readable safetensors file ({detail})") from None


def read_frozen(
    target: str | Path, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(embed_tokens, lm_head) read from the checkpoint by name, in `dtype`; lm_head is None when tied."""
    tensors = frozen_tensors(target, dtype)
    return tensors[EMBED_KEY], tensors.get(LM_HEAD_KEY)


def frozen_tensors(target: str | Path, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """What CACHE/target/frozen.safetensors stores, by its key names, read from the checkpoint by tensor
    name: the embedding and (untied) lm_head in `dtype`, and the final norm's gain when its kind is known."""
    target = Path(target)
    config = read_target_config(target)
    weights = _weight_map(target)
    embed_name = _find(weights, EMBED_NAMES, "embed_tokens.weight")
    if embed_name is None:
        raise ShardError(
            f"target {target}: no embed_tokens weight among {len(weights)} tensors (tried {EMBED_NAMES})"
        )
    tensors = {EMBED_KEY: _read(weights, embed_name).to(dtype)}
    if not config.tie_word_embeddings:
        head_name = _find(weights, LM_HEAD_NAMES, "lm_head.weight")
        if head_name is None:
            raise ShardError(
                f"target {target}: tie_word_embeddings is false but the checkpoint has no lm_head weight "
                f"(tried {LM_HEAD_NAMES})"
            )
        head = _read(weights, head_name).to(dtype)
        if head.shape != tensors[EMBED_KEY].shape:
            raise ShardError(
                f"target {target}: lm_head {tuple(head.shape)} and embed_tokens "
                f"{tuple(tensors[EMBED_KEY].shape)} differ"
            )
        tensors[LM_HEAD_KEY] = head
    gain = _final_norm_gain(config, weights)
    if gain is not None:
        tensors[FINAL_NORM_KEY] = gain
    return tensors


def _final_norm_gain(config: TargetConfig, weights: Mapping[str, Path]) -> torch.Tensor | None:
    """The final RMSNorm's effective gain [H] in fp32 (weight, or 1 + weight for zero-centred norms), or
    None for a model type whose norm is not known here or a checkpoint without the tensor: distillation then
    refuses at training time, nothing else needs it."""
    types = {config.model_type, str(config.decoder.get("model_type", config.model_type))}
    name = next((n for n in FINAL_NORM_NAMES if n in weights), None)
    if not types & KNOWN_NORMS or name is None:
        return None
    weight = _read(weights, name).float()
    return 1.0 + weight if types & ZERO_CENTRED_NORMS else weight


def write_target_parts(
    cache_dir: str | Path,
    target: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    recorded: Mapping[str, Any] | None = None,
) -> dict[str, dict[str, Any]]:
    """Write and check CACHE/target/ from the checkpoint, returning its files' digests; one for the same
    config.json that matches `recorded` (the manifest's `target_files`) is kept as is."""
    target = Path(target)
    return write_parts(
        cache_dir,
        config_bytes=(target / CONFIG_NAME).read_bytes(),
        frozen=lambda: frozen_tensors(target, dtype),
        extra_files={name: target / name for name in EXTRA_FILES if (target / name).is_file()},
        source=str(target),
        recorded=recorded,
    )
