"""Target shapes the benches share: Qwen3-8B, Qwen3.5-27B (text part), a small target, a tiny one for CPU runs.

Each is the text config as a checkpoint's config.json holds it (the fields the drafter, the cache writer
and `transformers` config classes read), so a bench builds a random-weight model or a drafter of the real
size without downloading anything. `layers` in the benches picks the captured layers; the full layer count
here is what a real checkpoint declares.
"""

from __future__ import annotations

from typing import Any

QWEN3_8B: dict[str, Any] = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    num_hidden_layers=36,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
    tie_word_embeddings=False,
)

# Hybrid attention (3 of 4 layers Gated DeltaNet); rope settings are the config class defaults.
QWEN35_27B: dict[str, Any] = dict(
    model_type="qwen3_5_text",
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_hidden_layers=64,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)

# Seconds on a CPU, yet grouped-query attention (4 query heads over 2 KV heads) like the real shapes.
TINY: dict[str, Any] = dict(
    QWEN3_8B,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=512,
    num_hidden_layers=8,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)

# A ~5M-parameter drafter's target (3 drafter layers of hidden 384, vocab 4096): per-step overhead, not FLOPs,
# bounds how fast it trains, so it is the shape that shows launch and host-sync costs.
SMALL: dict[str, Any] = dict(
    QWEN3_8B,
    hidden_size=384,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=1024,
    vocab_size=4096,
    num_hidden_layers=12,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)

_NOT_CONFIG_KWARGS = ("model_type", "architectures", "num_hidden_layers")


def config_kwargs(shape: dict[str, Any], num_hidden_layers: int) -> dict[str, Any]:
    """Keyword arguments for the `transformers` config class of `shape["model_type"]`, with the layer count
    the caller builds (a truncated model keeps only the layers up to the last captured one)."""
    kwargs = {k: v for k, v in shape.items() if k not in _NOT_CONFIG_KWARGS}
    return {**kwargs, "num_hidden_layers": num_hidden_layers}
