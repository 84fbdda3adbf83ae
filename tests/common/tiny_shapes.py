"""Tiny Qwen3-shaped target configs for the drafter tests: one base shape, each test names what it changes.

The base is small enough that a forward pass costs milliseconds on one CPU thread, yet keeps grouped-query
attention (4 query heads over 2 KV heads) so head bookkeeping is exercised.
"""

from __future__ import annotations

from typing import Any

_BASE: dict[str, Any] = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=64,
    num_hidden_layers=6,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=256,
)


def tiny_target(**overrides: Any) -> dict[str, Any]:
    """A fresh target config dict: the base shape (hidden 32, 4/2 heads, head_dim 8, 6 layers, vocab 64)
    with `overrides` applied on top."""
    return {**_BASE, **overrides}
