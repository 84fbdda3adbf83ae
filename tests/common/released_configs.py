"""The released `config.json` and `generation_config.json` of each Qwen layout family users run, with their
sources; `tests/common/released.py` shrinks them into tiny checkpoints (sizes and token ids only).

Each family's `config` is the released `config.json` (`https://huggingface.co/<source>/blob/main/config.json`)
and `generation` its `generation_config.json`. Sources and how each was checked (the Hub itself is not
reachable from here; each was compared with public verbatim copies):
  - Qwen3-0.6B, Qwen3-4B, Qwen3-8B: a model card quoting Qwen3-0.6B's config.json, copies of Qwen3-4B's,
    and Hub commits titled "Copy config.json from Qwen/Qwen3-8B" (thejaminator/qwen-hook-layer-9); all three
    share one 30-key layout written by transformers 4.51.0 (`rope_theta`, `rope_scaling: null`, `torch_dtype`).
  - Qwen3-30B-A3B: the qwen3_moe layout of the same release (copies of its config in Hub repos).
  - Qwen3-Next-80B-A3B-Instruct: transformers 4.57.0.dev0 layout, hybrid pattern by `full_attention_interval`
    (no `layer_types` key), `partial_rotary_factor` 0.25, shared expert.
  - Qwen3.5-27B and Qwen3.5-35B-A3B: the VLM wrapper (`text_config`, `vision_config`, `rope_parameters` with
    mrope); checked against converters that pin the official text_config / rope values (also of Qwen3.6,
    same layout). Their generation_config sampling values (not the token ids) had no copy to check against;
    nothing here reads them.
Qwen3-0.6B and Qwen3-4B share the keys and every non-size value, so one tiny checkpoint stands for both.

| family      | released checkpoints                 | what the layout exercises                                     |
|-------------|--------------------------------------|---------------------------------------------------------------|
| qwen3_tied  | Qwen/Qwen3-0.6B, Qwen/Qwen3-4B       | tie_word_embeddings true: no lm_head.weight                   |
| qwen3       | Qwen/Qwen3-8B                        | untied dense; transformers 4.x keys                           |
| qwen3_moe   | Qwen/Qwen3-30B-A3B                   | per-expert weights, router, mlp_only_layers                   |
| qwen3_next  | Qwen/Qwen3-Next-80B-A3B-Instruct     | hybrid without layer_types, partial rotary, mtp.* weights     |
| qwen3_5     | Qwen/Qwen3.5-27B                     | VLM wrapper: model.language_model.*, model.visual.*, mtp.*    |
| qwen3_5_moe | Qwen/Qwen3.5-35B-A3B                 | the wrapper around an MoE decoder without intermediate_size   |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_QWEN3_GENERATION = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def _qwen3_dense(*, hidden: int, intermediate: int, layers: int, heads: int, tie: bool) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "model_type": "qwen3",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


QWEN3_MOE_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "model_type": "qwen3_next",
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_QWEN3_5_ROPE = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
}


def hybrid_layer_types(num_layers: int, interval: int = 4) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def _qwen3_5_vision(model_type: str, out_hidden_size: int) -> dict[str, Any]:
    return {
        "deepstack_visual_indexes": [],
        "depth": 27,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 4304,
        "model_type": model_type,
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": out_hidden_size,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }


def _qwen3_5_wrapper(architecture: str, model_type: str, text: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": [architecture],
        "image_token_id": 248056,
        "model_type": model_type,
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 248057,
        "vision_config": _qwen3_5_vision(model_type, text["hidden_size"]),
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


_QWEN3_5_TEXT_COMMON = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "dtype": "bfloat16",
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "rms_norm_eps": 1e-06,
    "use_cache": True,
    "vocab_size": 248320,
    "mamba_ssm_dtype": "float32",
    "rope_parameters": _QWEN3_5_ROPE,
}

QWEN3_5_27B = _qwen3_5_wrapper(
    "Qwen3_5ForConditionalGeneration",
    "qwen3_5",
    {
        **_QWEN3_5_TEXT_COMMON,
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "layer_types": hybrid_layer_types(64),
        "linear_num_value_heads": 48,
        "model_type": "qwen3_5_text",
        "num_attention_heads": 24,
        "num_hidden_layers": 64,
        "num_key_value_heads": 4,
    },
)

QWEN3_5_35B_A3B = _qwen3_5_wrapper(
    "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe",
    {
        **_QWEN3_5_TEXT_COMMON,
        "hidden_size": 2048,
        "layer_types": hybrid_layer_types(40),
        "linear_num_value_heads": 32,
        "model_type": "qwen3_5_moe_text",
        "moe_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 40,
        "num_key_value_heads": 2,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512,
    },
)

_QWEN3_5_GENERATION = {
    "bos_token_id": 248044,
    "do_sample": True,
    "eos_token_id": [248046, 248044],
    "pad_token_id": 248044,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.57.0.dev0",
}

# The chat special tokens of each vocabulary: (real id, token text in the tiny tokenizer).
_QWEN3_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
_QWEN3_5_SPECIALS = {248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>"}


@dataclass(frozen=True)
class Family:
    """One released layout: its config.json and generation_config.json as published, and where from."""

    name: str
    sources: tuple[str, ...]  # Hub repositories whose config.json has this layout
    config: dict[str, Any]
    generation: dict[str, Any]
    specials: dict[int, str]  # real special-token ids -> the token text in the tiny tokenizer
    mtp: bool = False  # the checkpoint carries multi-token-prediction (mtp.*) weights transformers skips
    tied: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tied", bool(self.config.get("tie_word_embeddings", False)))

    @property
    def wrapped(self) -> bool:
        return "text_config" in self.config


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "qwen3_tied",
            ("Qwen/Qwen3-0.6B", "Qwen/Qwen3-4B"),
            _qwen3_dense(hidden=1024, intermediate=3072, layers=28, heads=16, tie=True),
            _QWEN3_GENERATION,
            _QWEN3_SPECIALS,
        ),
        Family(
            "qwen3",
            ("Qwen/Qwen3-8B",),
            _qwen3_dense(hidden=4096, intermediate=12288, layers=36, heads=32, tie=False),
            _QWEN3_GENERATION,
            _QWEN3_SPECIALS,
        ),
        Family("qwen3_moe", ("Qwen/Qwen3-30B-A3B",), QWEN3_MOE_30B_A3B, _QWEN3_GENERATION, _QWEN3_SPECIALS),
        Family(
            "qwen3_next",
            ("Qwen/Qwen3-Next-80B-A3B-Instruct",),
            QWEN3_NEXT_80B_A3B,
            {**_QWEN3_GENERATION, "temperature": 0.7, "top_p": 0.8, "transformers_version": "4.57.0.dev0"},
            _QWEN3_SPECIALS,
            mtp=True,
        ),
        Family(
            "qwen3_5", ("Qwen/Qwen3.5-27B",), QWEN3_5_27B, _QWEN3_5_GENERATION, _QWEN3_5_SPECIALS, mtp=True
        ),
        Family(
            "qwen3_5_moe",
            ("Qwen/Qwen3.5-35B-A3B",),
            QWEN3_5_35B_A3B,
            _QWEN3_5_GENERATION,
            _QWEN3_5_SPECIALS,
            mtp=True,
        ),
    )
}
