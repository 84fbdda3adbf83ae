"""DFlash drafter for `AutoModel.from_pretrained(dir, trust_remote_code=True)`.

This file is copied into every exported drafter as `dflash.py`. It imports only torch and transformers
(users load it without dflash installed) and works with transformers 4.57 and 5.x.

forward(position_ids, attention_mask=None, noise_embedding=None, target_hidden=None, past_key_values=None,
        use_cache=False) -> hidden [batch, q_len, hidden]   (the final-norm output; apply the target's lm_head)
    noise_embedding: the target's embedding of the block [anchor token, mask_token_id x (B-1)], [b, q_len, H]
    target_hidden:   target layer outputs `dflash_config.target_layer_ids` concatenated, [b, ctx_len, K*H]
    position_ids:    [b, ctx_len + q_len], context positions first, then the block's (a, a+1, ...)
    attention_mask:  optional, passed to SDPA over keys [cached | context | block]; None = all visible
    past_key_values: optional transformers Cache; context and block keys are appended (crop the block after).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel, Qwen3Config


def _rope_settings(config: Qwen3Config) -> tuple[float, float]:
    """(theta, position scale) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or {}
    scaling = getattr(config, "rope_scaling", None) or params
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    theta = float(theta if theta is not None else getattr(config, "rope_theta", 10000.0))
    kind = (
        scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else "default"
    )
    if kind not in ("default", "linear"):
        raise ValueError(f"DFlash drafter: rope type {kind!r} is not supported (default or linear only)")
    return theta, 1.0 / float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0


class DFlashRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = DFlashRMSNorm(d, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(d, config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, cos, sin, attention_mask=None, past_key_values=None):
        b, q_len, _ = hidden_states.shape
        ctx_len, d = target_hidden.shape[1], self.head_dim
        q = self.q_norm(self.q_proj(hidden_states).view(b, q_len, self.num_heads, d)).transpose(1, 2)
        # Context K/V: this layer's projections of the fused target features, in front of the block's.
        k = torch.cat([self.k_proj(target_hidden), self.k_proj(hidden_states)], dim=1)
        v = torch.cat([self.v_proj(target_hidden), self.v_proj(hidden_states)], dim=1)
        k = self.k_norm(k.view(b, ctx_len + q_len, self.num_kv_heads, d)).transpose(1, 2)
        v = v.view(b, ctx_len + q_len, self.num_kv_heads, d).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[..., -q_len:, :] + _rotate_half(q) * sin[..., -q_len:, :]
        k = k * cos + _rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, is_causal=False, scale=d**-0.5
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * d))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden_states, target_hidden, cos, sin, attention_mask=None, past_key_values=None):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), target_hidden, cos, sin, attention_mask, past_key_values
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


def _default_layer_ids(num_target_layers: int, k: int) -> list[int]:
    # A copy of dflash.shards.layers.default_layer_ids (this file loads without dflash); a test pins both.
    if num_target_layers < 1 or k < 1:
        raise ValueError(f"need num_target_layers >= 1 and k >= 1, got L={num_target_layers}, k={k}")
    if k == 1:
        return [num_target_layers // 2]
    if num_target_layers < 4:
        raise ValueError(
            f"the default layer rule needs a target of >= 4 layers (got {num_target_layers}); "
            "pass the layer ids explicitly"
        )
    return [round(1 + i * (num_target_layers - 4) / (k - 1)) for i in range(k)]


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]  # noqa: RUF012
    _supports_sdpa = True

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        ids = dflash.get("target_layer_ids")
        self.target_layer_ids = (
            list(ids)
            if ids is not None
            else _default_layer_ids(config.num_target_layers, config.num_hidden_layers)
        )
        self.mask_token_id = dflash.get("mask_token_id")
        self.block_size = int(getattr(config, "block_size", 16))
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Computed per call (no buffer): nothing to go wrong when weights are materialized from a meta device.
        d = self.layers[0].self_attn.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device=position_ids.device).float() / d
        theta, position_scale = _rope_settings(self.config)
        inv_freq = 1.0 / (theta**exponents)
        angles = position_ids.float()[..., None] * position_scale * inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        position_ids,
        attention_mask=None,
        noise_embedding=None,
        target_hidden=None,
        past_key_values=None,
        use_cache=False,
        **kwargs,
    ):
        hidden_states = noise_embedding
        target_hidden = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        cos, sin = self._rope(position_ids, hidden_states.dtype)
        cache = past_key_values if use_cache or past_key_values is not None else None
        for layer in self.layers:
            hidden_states = layer(hidden_states, target_hidden, cos, sin, attention_mask, cache)
        return self.norm(hidden_states)
