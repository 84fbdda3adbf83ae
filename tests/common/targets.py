"""Tiny random Qwen-family targets saved as local HF directories (vocab 256, hidden 64, 4 layers).

Built from configs in memory and saved with `save_pretrained` (fp32 by default), so tests exercise
the real loading code offline in tens of milliseconds. Kinds:
  qwen3, qwen3_moe, qwen3_next, qwen3_5_text  -- text-only causal LMs
  qwen3_5                                     -- the VLM wrapper (`Qwen3_5ForConditionalGeneration`,
                                                 text params under `text_config`, weights under
                                                 `model.language_model.*`) that AutoModelForCausalLM
                                                 loads text-only
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

KINDS = ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5")
VOCAB = 256
HIDDEN = 64

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    # Larger than HF's 0.02 so layer outputs differ visibly from the embeddings.
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_LINEAR = dict(
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4
)


def _build(kind: str, num_layers: int, tie: bool) -> torch.nn.Module:
    common = dict(_COMMON, num_hidden_layers=num_layers, tie_word_embeddings=tie)
    if kind == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(**common))
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        return Qwen3MoeForCausalLM(cfg)
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            **common,
            **_LINEAR,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
        )
        return Qwen3NextForCausalLM(cfg)
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config, Qwen3_5TextConfig

    if kind == "qwen3_5_text":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**common, **_LINEAR))
    if kind == "qwen3_5":
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

        text = dict(common, **_LINEAR)  # tie_word_embeddings kept in both places, as released configs do
        vision = dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=HIDDEN,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=1,
        )
        cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie)
        return Qwen3_5ForConditionalGeneration(cfg)
    raise ValueError(f"unknown tiny target kind {kind!r}; choose one of {KINDS}")


def write_tokenizer(path: Path) -> None:
    """A word tokenizer over the tiny vocab but its last row, saved as tokenizer.json + tokenizer_config.json:
    the table is padded past the tokenizer as Qwen's is (151669 tokens, 151936 rows), so row 255 is free for
    the drafter's mask token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, VOCAB - 1)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "eos_token": "</s>"})
    )


def make_target(
    root: str | Path,
    kind: str = "qwen3",
    *,
    num_layers: int = 4,
    tie: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: bool = True,
) -> Path:
    """Build a tiny random target of `kind` and save it under root/kind; return the directory."""
    torch.manual_seed(seed)
    model = _build(kind, num_layers, tie).to(dtype).eval()
    out = Path(root) / f"{kind}{'_tied' if tie else ''}"
    model.save_pretrained(out)
    if tokenizer:
        write_tokenizer(out)
    return out


def load_reference(path: str | Path) -> torch.nn.Module:
    """The full target as plain HF loads it (fp32, CPU): the oracle for captured states."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_layer_outputs(
    model: torch.nn.Module, input_ids: torch.Tensor, layer_ids: list[int]
) -> list[torch.Tensor]:
    """Outputs of decoder layers `layer_ids` for ONE unpadded row [S] -> K tensors [S, H].

    Uses output_hidden_states of a plain forward: entry i+1 is layer i's output except for the last
    layer, whose entry is the final-norm output; that one case is rejected here rather than faked.
    """
    n = len(model.model.layers)
    if any(i >= n - 1 for i in layer_ids):
        raise ValueError(f"the reference cannot give layer {n - 1}'s raw output via output_hidden_states")
    out = model.model(input_ids=input_ids[None], use_cache=False, output_hidden_states=True)
    return [out.hidden_states[i + 1][0] for i in layer_ids]
