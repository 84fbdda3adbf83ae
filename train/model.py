"""The DFlash drafter: N Qwen3-style layers that draft a whole block in one pass from fused target features.

Public API (stable; other modules rely on it):
    DFlashDrafter(config: DrafterConfig)    (the config and `rope_settings`: `train/drafter_config.py`)
        .forward(batch: PackedBatch, block_embeds: Tensor[N, B, H], attn_mask=None) -> Tensor[N, B, H]
            (final-norm output; logits come from the frozen target lm_head, see `train/loss.py`)
        .fuse_features(features[T, K*H]) -> Tensor[T, H]
    flops_per_step(config, context_tokens, num_blocks, visible_pairs) -> dict   model FLOPs of a training step

Single device, no distributed code (that lives in `parallelize.py`). Parameter names equal the exported
checkpoint's names (`layers.{i}.self_attn.q_proj.weight`, `fc.weight`, ...), so `state_dict()` is exported as is.
The semantics follow the DFlash paper (arXiv 2602.06036) and the authors' released drafters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .drafter_config import DrafterConfig

if TYPE_CHECKING:
    from .blocks import PackedBatch
    from .mask import AttentionMask


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE (rotate halves). Only default/linear scaling: what Qwen3 drafters use."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        scaling = config.rope_scaling or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear"):
            raise ValueError(
                f"rope_scaling type {kind!r} is not supported by the drafter; use rope_scaling=None"
            )
        self.position_scale = 1.0 / float(scaling.get("factor", 1.0)) if kind == "linear" else 1.0
        dim = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[..., None] * self.position_scale * self.inv_freq.float()
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [L, heads, D]; cos/sin [L, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """The projections and norms of one layer's attention; `DecoderLayer` calls `project`, the mask's
    `attend`, then `output` (the kernel call sits between two separately compilable parts)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def project(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_blocks: tuple[torch.Tensor, torch.Tensor],
        rope_context: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [1, heads, M, D] for the block tokens x [M, H]; k, v [1, kv_heads, T+M, D] for [context | blocks]."""
        m, t, d = x.shape[0], context.shape[0], self.head_dim
        q = apply_rope(self.q_norm(self.q_proj(x).view(m, self.num_heads, d)), *rope_blocks)
        # Context keys/values come from THIS layer's projections of the shared fused vectors (KV injection).
        k_ctx = apply_rope(self.k_norm(self.k_proj(context).view(t, self.num_kv_heads, d)), *rope_context)
        k_blk = apply_rope(self.k_norm(self.k_proj(x).view(m, self.num_kv_heads, d)), *rope_blocks)
        v_ctx = self.v_proj(context).view(t, self.num_kv_heads, d)
        v_blk = self.v_proj(x).view(m, self.num_kv_heads, d)
        k = torch.cat([k_ctx, k_blk], dim=0).transpose(0, 1)[None]
        v = torch.cat([v_ctx, v_blk], dim=0).transpose(0, 1)[None]
        # Under autocast the fp32 norm weights promote q/k to fp32 while v is bf16; kernels want one dtype.
        return q.to(v.dtype).transpose(0, 1)[None], k.to(v.dtype), v

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """[1, heads, M, D] attention output -> [M, H]."""
        m = attended.shape[2]
        return self.o_proj(attended[0].transpose(0, 1).reshape(m, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    # The layer runs as three parts so that the two around attention can be compiled on their own
    # (`train/compiled.py`) while attention itself stays behind the `AttentionMask` with its fallback.
    def attention_inputs(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_blocks: tuple[torch.Tensor, torch.Tensor],
        rope_context: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.self_attn.project(self.input_layernorm(x), context, rope_blocks, rope_context)

    def attention_output_and_mlp(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.output(attended)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        rope_blocks: tuple[torch.Tensor, torch.Tensor],
        rope_context: tuple[torch.Tensor, torch.Tensor],
        attn_mask: AttentionMask,
        regions: Regions | None = None,
    ) -> torch.Tensor:
        parts = regions or EAGER_REGIONS
        q, k, v = parts.attention_inputs(self, x, context, rope_blocks, rope_context)
        attended = attn_mask.attend(q, k, v, scale=self.self_attn.head_dim**-0.5)
        if parts.backend is not None and not x.requires_grad and torch.is_grad_enabled():
            # The first layer's x (frozen embeddings) has no grad, so a compiled region would need a graph
            # of its own for it. As a leaf that asks for one, x reaches the output/MLP region as every later
            # layer's does and shares their graph: one compile fewer before step 1, and no extra work, since
            # x's gradient there is the residual's, which the backward computes anyway.
            x = x.detach().requires_grad_()
        return parts.attention_output_and_mlp(self, x, attended)


class DFlashDrafter(nn.Module):
    """The trainable drafter. The target's embedding and lm_head are NOT part of it (see `train/frozen.py`)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        # Plain methods by default; `train/compiled.py` installs compiled versions (not part of state_dict).
        self.regions: Regions = EAGER_REGIONS
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """From-scratch init as HF Qwen3 does: linears N(0, initializer_range), norms 1."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """[T, K*H] concatenated target layers -> [T, H] context vectors shared by every layer. Columns past
        K*H (distillation's teacher layer, loaded after the features) are not the drafter's to see."""
        features = features[:, : self.fc.in_features]
        if not torch.is_autocast_enabled(features.device.type):  # autocast casts inside fc; no fp32 copy
            features = features.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(features))

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def forward(
        self, batch: PackedBatch, block_embeds: torch.Tensor, attn_mask: AttentionMask | None = None
    ) -> torch.Tensor:
        """Block hidden states [N, B, H] after the final norm, for the blocks of a packed batch.

        `block_embeds` = frozen target embedding of `batch.block_ids` ([N, B, H]); `attn_mask` defaults to
        `mask.build_attention_mask(batch)` ("auto": see `mask.choose_backend`).
        """
        if attn_mask is None:
            from .mask import build_attention_mask

            attn_mask = build_attention_mask(batch)
        n, b = batch.block_ids.shape
        if block_embeds.shape[:2] != (n, b):
            raise ValueError(f"block_embeds has shape {tuple(block_embeds.shape)}, expected ({n}, {b}, H)")
        dtype = self.fc.weight.dtype
        # Compiled regions serve training steps; evaluation (no grad, shapes of its own) stays eager.
        regions = self.regions if torch.is_grad_enabled() else EAGER_REGIONS
        context = regions.fuse_features(self, batch.features)
        slots = torch.arange(b, device=batch.anchor_pos.device)
        block_pos = (batch.anchor_pos[:, None] + slots).reshape(-1)
        rope_blocks = self.rotary(block_pos, dtype)
        rope_context = self.rotary(batch.context_pos, dtype)
        x = block_embeds.reshape(n * b, -1).to(dtype)
        for layer in self.layers:
            x = layer(x, context, rope_blocks, rope_context, attn_mask, regions)
        return regions.final_norm(self, x).view(n, b, -1)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@dataclass(frozen=True, slots=True)
class Regions:
    """The functions `DFlashDrafter.forward` runs around attention, each called with its module first.

    All the drafter's work except attention and RoPE tables: `train/compiled.py` compiles these four (one
    compiled function serves every layer) while attention keeps its own kernel choice and fallback."""

    fuse_features: Callable[[DFlashDrafter, torch.Tensor], torch.Tensor]
    attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    attention_output_and_mlp: Callable[[DecoderLayer, torch.Tensor, torch.Tensor], torch.Tensor]
    final_norm: Callable[[DFlashDrafter, torch.Tensor], torch.Tensor]
    backend: str | None = None  # the torch.compile backend of these functions; None: the plain methods


EAGER_REGIONS = Regions(
    fuse_features=DFlashDrafter.fuse_features,
    attention_inputs=DecoderLayer.attention_inputs,
    attention_output_and_mlp=DecoderLayer.attention_output_and_mlp,
    final_norm=DFlashDrafter.final_norm,
)


def flops_per_step(
    config: DrafterConfig, context_tokens: int, num_blocks: int, visible_pairs: int
) -> dict[str, float]:
    """Model FLOPs of one training step (2 per multiply-add), counting only work the math requires.

    Drafter matmuls: forward + 2x backward (grad input, grad weight); `fc` has no grad input (the features
    are data): 2x. Attention: QK^T and PV over the `visible_pairs` the mask allows (a block-sparse kernel
    skips the rest), 3x. Frozen lm_head: logits + grad input, 2x, for the B-1 drafted slots (slot 0 is
    never projected). Norms, RoPE, softmax and elementwise work are not counted.
    """
    h, d, b = config.hidden_size, config.head_dim, config.block_size
    m = num_blocks * b
    hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d
    proj_block = 2 * m * h * (hq + 2 * hkv) + 2 * m * hq * h + 2 * m * h * config.intermediate_size * 3
    proj_context = 2 * context_tokens * h * 2 * hkv
    attention = 4 * visible_pairs * hq
    fc = 2 * context_tokens * config.num_features * h * h
    layers = config.num_hidden_layers
    lm_head = 2 * num_blocks * (b - 1) * h * config.vocab_size
    parts = {
        "projections": 3.0 * layers * (proj_block + proj_context),
        "attention": 3.0 * layers * attention,
        "fc": 2.0 * fc,
        "lm_head": 2.0 * lm_head,
    }
    parts["total"] = sum(parts.values())
    return parts
