"""The drafter's shape and semantics, as its export's config.json records them, and how a target's config.json
sets them (width, heads, rope and vocabulary copied from the target). No torch: the loader and the dry run
read it without building a model.

    DrafterConfig (kw_only dataclass) and DrafterConfig.from_target_config(target_config_dict, ...)
    rope_settings(config_dict) -> (rope_theta, rope_scaling)     transformers 4.x and 5.x config layouts
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from dflash.shards.layers import check_layer_ids, resolve_layer_ids
from dflash.shards.target_config import decoder_config


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from a transformers 4.x (`rope_theta`) or 5.x (`rope_parameters`) config."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError("target config has neither rope_theta nor rope_parameters.rope_theta")
    scaling = config.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") not in ("default",):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ("default", None):
        scaling = None
    return float(theta), scaling


@dataclass(kw_only=True, slots=True)
class DrafterConfig:
    """Everything that fixes the drafter's shape and semantics; written to the export's config.json."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_hidden_layers: int = 5
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "num_target_layers",
            "num_hidden_layers",
        ):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"DrafterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.block_size < 2:
            raise ValueError(
                f"block_size must be >= 2 (an anchor plus at least one drafted slot), got {self.block_size}"
            )
        self.target_layer_ids = check_layer_ids(self.target_layer_ids, self.num_target_layers)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} outside the vocabulary 0..{self.vocab_size - 1}"
            )

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target_config(
        cls,
        target: dict[str, Any],
        *,
        mask_token_id: int,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: Sequence[int] | None = None,
        **overrides: Any,
    ) -> DrafterConfig:
        """Copy width, heads, rope and vocab from the target's config.json (dict); `overrides` win."""
        text = decoder_config(target)
        try:
            hidden = int(text["hidden_size"])
            heads = int(text["num_attention_heads"])
            num_target_layers = int(text["num_hidden_layers"])
            values: dict[str, Any] = dict(
                hidden_size=hidden,
                num_attention_heads=heads,
                num_key_value_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                # MoE-only targets (Qwen3.5-35B-A3B) have no dense MLP width: 3 x hidden is what public
                # DFlash drafters of such targets use, and Qwen3-30B-A3B's own `intermediate_size`.
                intermediate_size=int(text.get("intermediate_size") or 3 * hidden),
                vocab_size=int(text["vocab_size"]),
            )
        except KeyError as exc:
            raise ValueError(
                f"target config lacks {exc.args[0]!r}; is it a decoder-only Qwen config?"
            ) from None
        theta, scaling = rope_settings(text)
        values.update(
            num_target_layers=num_target_layers,
            target_layer_ids=resolve_layer_ids(num_target_layers, num_hidden_layers, target_layer_ids),
            mask_token_id=mask_token_id,
            num_hidden_layers=num_hidden_layers,
            block_size=block_size,
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 40960)),
            bos_token_id=text.get("bos_token_id", target.get("bos_token_id")),
            eos_token_id=text.get("eos_token_id", target.get("eos_token_id")),
        )
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown DrafterConfig fields {sorted(unknown)}; known: {sorted(known)}")
        values.update(overrides)
        return cls(**values)
