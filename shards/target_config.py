"""A target's `config.json`, read the one way every phase reads it (dry run, extraction, training, export).

Plain JSON, no transformers import: the dry run starts in a second and training never needs the
target's code. VLM wrappers (qwen3_5) keep the decoder's settings under `text_config`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .safe_io import read_json

CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # HF configs are a few KB
_SIZES = ("num_hidden_layers", "hidden_size", "vocab_size")


def decoder_config(config_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's settings: VLM wrappers (qwen3_5) keep them under `text_config`, whose values win over
    the wrapper's; other configs are returned as they are."""
    inner = config_dict.get("text_config")
    return {**config_dict, **inner} if isinstance(inner, Mapping) else dict(config_dict)


def tied_embeddings(config_dict: Mapping[str, Any]) -> bool:
    """Whether lm_head IS the embedding. The wrapper's own `tie_word_embeddings` wins over text_config's:
    it is the wrapper that owns both matrices (transformers ties them at that level)."""
    if "tie_word_embeddings" in config_dict:
        return bool(config_dict["tie_word_embeddings"])
    inner = config_dict.get("text_config")
    return bool(inner.get("tie_word_embeddings", False)) if isinstance(inner, Mapping) else False


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetConfig:
    """config.json as stored (`raw`) plus the decoder facts every phase needs."""

    raw: dict[str, Any]
    source: str
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool

    @classmethod
    def from_dict(cls, raw: Any, source: str = CONFIG_NAME) -> TargetConfig:
        if not isinstance(raw, dict):
            raise ValueError(f"{source} holds a JSON {type(raw).__name__}, not a config object")
        text = decoder_config(raw)
        missing = [k for k in _SIZES if type(text.get(k)) is not int or text[k] < 1]
        if missing:
            raise ValueError(f"{source} lacks integer {', '.join(missing)} (>= 1): not a decoder's config")
        return cls(
            raw=raw,
            source=source,
            model_type=str(raw.get("model_type", "unknown")),
            num_hidden_layers=text["num_hidden_layers"],
            hidden_size=text["hidden_size"],
            vocab_size=text["vocab_size"],
            tie_word_embeddings=tied_embeddings(raw),
        )

    @property
    def decoder(self) -> dict[str, Any]:
        return decoder_config(self.raw)

    def shape(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }


def read_target_config(path: str | os.PathLike) -> TargetConfig:
    """A model directory's config.json (or that file itself)."""
    path = Path(path)
    file = path / CONFIG_NAME if path.is_dir() or not path.suffix else path
    if not os.path.lexists(file):  # a FIFO or a directory is refused by read_json, in one line
        raise FileNotFoundError(f"{file}: no config.json; pass a Hugging Face model directory")
    raw = read_json(file, max_bytes=MAX_CONFIG_BYTES)  # depth-limited; special files refused up front
    return TargetConfig.from_dict(raw, source=str(file))
