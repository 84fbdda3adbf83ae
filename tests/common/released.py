"""Tiny checkpoints in the released layouts of `tests/common/released_configs.py` (sources and the family
table there): the released config.json with only the sizes and token ids shrunk, saved like a Hub checkpoint.

`make_released_checkpoint` builds the class `architectures[0]` names from the tiny config, casts it to bf16
and saves it with `save_pretrained` in several shards (`model.safetensors.index.json`); then it writes the
released `config.json` and `generation_config.json` over the ones transformers 5 writes (which would
rename keys, e.g. `rope_theta` -> `rope_parameters`), the project's tiny tokenizer, and, where released
checkpoints carry a multi-token-prediction head, a few `mtp.*` tensors that transformers does not load.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.common.released_configs import Family, hybrid_layer_types

# --- shrinking ---------------------------------------------------------------------------------------------
NUM_LAYERS = 5  # hybrids: 3 linear-attention layers, the full-attention layer 3, one more linear layer
TINY_TEXT = {  # decoder sizes; each key is replaced only where the released config has it
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": NUM_LAYERS,
    "max_window_layers": NUM_LAYERS,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2}
TOKEN_ID_KEYS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


def tiny_vocab_size(tokenizer_len: int) -> int:
    """Pad the table past the tokenizer as Qwen does (151669 tokens in 151936 rows): a multiple of 64 with
    at least one free row (the drafter's mask token)."""
    return 64 * math.ceil((tokenizer_len + 1) / 64)


def _map_ids(value: Any, id_map: dict[int, int]) -> Any:
    if isinstance(value, list):
        return [id_map[v] for v in value]
    return id_map[value] if isinstance(value, int) and not isinstance(value, bool) else value


def shrink(family: Family, tokenizer_ids: dict[str, int], tokenizer_len: int) -> tuple[dict, dict]:
    """(config.json, generation_config.json) of the tiny checkpoint: the released ones with the sizes and
    the token ids replaced, every other key and value kept.

    Chat special tokens map to the tiny tokenizer's same tokens; other ids (vision tokens) keep their
    distance from the end of the embedding table."""
    config = copy.deepcopy(family.config)
    text = config["text_config"] if family.wrapped else config
    real_vocab, vocab = int(text["vocab_size"]), tiny_vocab_size(tokenizer_len)
    ids = {
        int(v)
        for section in (config, text, family.generation)
        for k in TOKEN_ID_KEYS
        for v in (section.get(k) if isinstance(section.get(k), list) else [section.get(k)])
        if isinstance(v, int)
    }
    id_map = {
        i: tokenizer_ids[family.specials[i]] if i in family.specials else vocab - (real_vocab - i)
        for i in ids
    }
    text.update({k: v for k, v in TINY_TEXT.items() if k in text})
    text["vocab_size"] = vocab
    if "layer_types" in text:
        text["layer_types"] = hybrid_layer_types(NUM_LAYERS, int(text["full_attention_interval"]))
    if family.wrapped:
        vision = config["vision_config"]
        vision.update(TINY_VISION)
        vision["out_hidden_size"] = text["hidden_size"]
    for section in (config, text) if family.wrapped else (config,):
        for key in TOKEN_ID_KEYS:
            if key in section:
                section[key] = _map_ids(section[key], id_map)
    generation = {k: _map_ids(v, id_map) if k in TOKEN_ID_KEYS else v for k, v in family.generation.items()}
    return config, generation


# --- building ----------------------------------------------------------------------------------------------
MAX_SHARD_SIZE = "150KB"  # a few shards per tiny checkpoint, so the index is what loaders read


def _build_model(config_dir: Path) -> torch.nn.Module:
    """The model class `architectures[0]` names, random weights. Initialised wider than the released 0.02 (in
    the config object only) so each layer changes the residual stream visibly: a wrong layer or a leak then
    stands out from bf16 rounding."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_dir)
    for section in {id(c): c for c in (config, config.get_text_config())}.values():
        section.initializer_range = 0.1
    return getattr(transformers, config.architectures[0])(config)


def _add_mtp_weights(out: Path, hidden: int, seed: int) -> None:
    """Put a few `mtp.*` tensors into the last shard and the index, as released hybrid checkpoints have."""
    from safetensors.torch import load_file, save_file

    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    g = torch.Generator().manual_seed(seed)
    extra = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden, generator=g),
        "mtp.norm.weight": torch.ones(hidden),
        "mtp.pre_fc_norm_embedding.weight": torch.ones(hidden),
        "mtp.pre_fc_norm_hidden.weight": torch.ones(hidden),
        "mtp.layers.0.input_layernorm.weight": torch.ones(hidden),
    }
    tensors = load_file(str(out / last))
    tensors.update({k: v.to(torch.bfloat16) for k, v in extra.items()})
    save_file(tensors, str(out / last), metadata={"format": "pt"})
    index["weight_map"].update(dict.fromkeys(extra, last))
    index["metadata"]["total_size"] += sum(v.numel() * 2 for v in extra.values())
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def make_released_checkpoint(root: Path, family: Family, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """The tiny bf16 checkpoint of `family` under root/<name>, laid out like the released one."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    token_ids = {text: tokenizer.convert_tokens_to_ids(text) for text in family.specials.values()}
    config, generation = shrink(family, token_ids, len(tokenizer))
    out = Path(root) / family.name
    out.mkdir(parents=True)
    config_text = json.dumps(config, indent=2) + "\n"
    (out / "config.json").write_text(config_text)
    torch.manual_seed(seed)
    model = _build_model(out).to(torch.bfloat16).eval()
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        model.save_pretrained(out, max_shard_size=MAX_SHARD_SIZE)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    # transformers 5 writes its own spelling of both files; the released spelling is what users have.
    (out / "config.json").write_text(config_text)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for f in tokenizer_dir.iterdir():
        shutil.copyfile(f, out / f.name)
    if family.mtp:
        text = config["text_config"] if family.wrapped else config
        _add_mtp_weights(out, int(text["hidden_size"]), seed)
    return out
