"""HF checkpoint directory out (for vLLM, SGLang, the authors' code) and in (to continue training or evaluate).

Public API (stable):
    hf_config_dict(config: DrafterConfig) -> dict       exactly the config.json keys of DFLASH.md
    export_drafter(model_or_state_dict, config, out_dir, *, dtype=torch.bfloat16) -> Path
        writes config.json, model.safetensors (names without `model.`, no embed/lm_head) and dflash.py
    config_from_hf(config_dict, *, mask_token_id=None) -> DrafterConfig    our exports and public drafters
    load_drafter(path, *, mask_token_id=None, device=None, dtype=None) -> DFlashDrafter   (model.config set)
Files are written to a temporary name and renamed, so a crash never leaves a half-written checkpoint file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from dflash.shards.atomic import atomic_write, atomic_write_json
from dflash.shards.errors import ShardError
from dflash.shards.layers import resolve_layer_ids
from dflash.shards.safe_io import read_json
from dflash.shards.tensor_io import save_tensors
from safetensors import safe_open

from .drafter_config import DrafterConfig, rope_settings
from .model import DFlashDrafter

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MODELING_FILE = "dflash.py"
_FROZEN_PREFIXES = ("embed_tokens.", "lm_head.")
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def hf_config_dict(config: DrafterConfig, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """config.json for the export. rope_theta/rope_scaling are written at the top level on purpose: the
    authors' code (transformers 4.57) silently falls back to theta 10000 without them."""
    return {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(config.target_layer_ids),
            "mask_token_id": config.mask_token_id,
        },
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": config.vocab_size,
        "layer_types": ["full_attention"] * config.num_hidden_layers,
        "dtype": _DTYPE_NAMES[dtype],
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    }


def export_drafter(
    model: DFlashDrafter | dict[str, torch.Tensor],
    config: DrafterConfig,
    out_dir: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write an HF drafter directory; returns its path. `model` may be a module or its state_dict."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    state = model.state_dict() if isinstance(model, torch.nn.Module) else model
    expected = _expected_names(config)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        name = name.removeprefix("module.").removeprefix("_orig_mod.")  # DDP / torch.compile wrappers
        tensors[name] = value.detach().to(device="cpu", dtype=dtype).contiguous()
    if set(tensors) != expected:
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ValueError(
            f"state_dict does not match the drafter config: missing {missing[:5]}, extra {extra[:5]}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / WEIGHTS_FILE, lambda p: save_tensors(tensors, p, metadata={"format": "pt"}))
    source = (Path(__file__).with_name("hf_modeling.py")).read_text(encoding="utf-8")
    atomic_write(out / MODELING_FILE, lambda p: p.write_text(source, encoding="utf-8"))
    # Last: loaders and engines take a directory with config.json for a model, so an export cut off before
    # its end must not leave one beside missing weights.
    atomic_write_json(out / CONFIG_FILE, hf_config_dict(config, dtype))
    return out


def _expected_names(config: DrafterConfig) -> set[str]:
    names = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    per_layer = [
        "input_layernorm",
        "post_attention_layernorm",
        "self_attn.q_norm",
        "self_attn.k_norm",
        *(f"self_attn.{p}_proj" for p in "qkvo"),
        *(f"mlp.{p}_proj" for p in ("gate", "up", "down")),
    ]
    for i in range(config.num_hidden_layers):
        names.update(f"layers.{i}.{p}.weight" for p in per_layer)
    return names


def config_from_hf(raw: dict[str, Any], *, mask_token_id: int | None = None) -> DrafterConfig:
    """DrafterConfig from a drafter's config.json (ours or a public one: ids and mask id may sit in
    `dflash_config` or at the top level; theta in `rope_theta` or `rope_parameters`)."""
    dflash = dict(raw.get("dflash_config") or {})
    try:
        layers = int(raw["num_hidden_layers"])
        num_target_layers = int(raw["num_target_layers"])
        ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        ids = resolve_layer_ids(num_target_layers, layers, ids)
        mask = (
            mask_token_id
            if mask_token_id is not None
            else dflash.get("mask_token_id", raw.get("mask_token_id"))
        )
        if mask is None:
            raise ValueError("the drafter config has no dflash_config.mask_token_id; pass mask_token_id")
        theta, scaling = rope_settings(raw)
        heads = int(raw["num_attention_heads"])
        return DrafterConfig(
            hidden_size=int(raw["hidden_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            num_target_layers=num_target_layers,
            target_layer_ids=tuple(ids),
            mask_token_id=int(mask),
            num_hidden_layers=layers,
            block_size=int(raw.get("block_size", dflash.get("block_size", 16))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
        )
    except KeyError as exc:
        raise ValueError(f"drafter config lacks {exc.args[0]!r}") from None


def load_drafter(
    path: str | Path,
    *,
    mask_token_id: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> DFlashDrafter:
    """Build a DFlashDrafter from an HF drafter directory. Weights keep their stored dtype unless `dtype`."""
    root = Path(path)
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    for p in (config_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing: not an HF drafter directory")
    raw = read_json(config_path, max_bytes=16 << 20)  # depth-limited; special files refused
    config = config_from_hf(raw, mask_token_id=mask_token_id)
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = key.removeprefix("model.")
                if name.startswith(_FROZEN_PREFIXES):
                    continue  # some public drafters ship a copy of the target's embedding: we use the target's
                state[name] = f.get_tensor(key)
    except Exception as exc:
        raise ShardError(f"{weights_path}: unreadable safetensors file ({exc})") from None
    expected = _expected_names(config)
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ShardError(
            f"{weights_path}: weights do not match {config_path}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    model = DFlashDrafter(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ShardError(
            f"{weights_path}: {str(exc).splitlines()[0]} ({str(exc).splitlines()[-1].strip()})"
        ) from None
    target_dtype = dtype or next(iter(state.values())).dtype
    return model.to(device=device, dtype=target_dtype)
