"""A plain eager DFlash training step written from DFLASH.md alone: the floor the project's step must beat.

What a careful user writes first, without the project's training code: the drafter as a few tensors per
layer and one forward function, FlexAttention over a `create_block_mask` mask built every step (compiled,
as FlexAttention must be at this size; on a CPU the same rule as a dense SDPA mask), cross-entropy through
the frozen lm_head in 2048-row chunks under activation checkpointing (logits recomputed in backward),
AdamW (fused on CUDA), gradient clipping. Parameter names equal the project's drafter, so one state_dict
loads into both (the agreement check uses that).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from dflash.train.blocks import PackedBatch
from dflash.train.drafter_config import DrafterConfig
from dflash.train.frozen import FrozenTarget
from torch import nn
from torch.utils.checkpoint import checkpoint


def _norm(size: int) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(torch.ones(size))
    return module


def _linears(names: dict[str, tuple[int, int]]) -> nn.Module:
    module = nn.Module()
    for name, (n_in, n_out) in names.items():
        setattr(module, name, nn.Linear(n_in, n_out, bias=False))
    return module


class ReferenceDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        hq, hkv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        self.cfg = cfg
        self.layers = nn.ModuleList()
        for _ in range(cfg.num_hidden_layers):
            layer = nn.Module()
            layer.input_layernorm, layer.post_attention_layernorm = _norm(h), _norm(h)
            layer.self_attn = _linears(
                {"q_proj": (h, hq), "k_proj": (h, hkv), "v_proj": (h, hkv), "o_proj": (hq, h)}
            )
            layer.self_attn.q_norm, layer.self_attn.k_norm = _norm(d), _norm(d)
            layer.mlp = _linears({"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)})
            self.layers.append(layer)
        self.fc = nn.Linear(cfg.num_features * h, h, bias=False)
        self.hidden_norm, self.norm = _norm(h), _norm(h)
        for p in self.parameters():
            if p.ndim == 2:
                nn.init.normal_(p, std=cfg.initializer_range)

    def rms(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return norm.weight * y.to(x.dtype)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.cfg.head_dim
        inv = 1.0 / self.cfg.rope_theta ** (torch.arange(0, d, 2, device=positions.device).float() / d)
        angles = positions.float()[:, None] * inv
        angles = torch.cat([angles, angles], dim=-1)[:, None, :]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(
        self, batch: PackedBatch, embeds: torch.Tensor, attend: Callable[..., torch.Tensor]
    ) -> torch.Tensor:
        cfg, dtype = self.cfg, self.fc.weight.dtype
        n, b = batch.block_ids.shape
        t, d, hq, hkv = (
            batch.num_context_tokens,
            cfg.head_dim,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        )
        ctx = self.rms(self.fc(batch.features.to(dtype)), self.hidden_norm)
        cos_b, sin_b = self.rope(
            (batch.anchor_pos[:, None] + torch.arange(b, device=ctx.device)).flatten(), dtype
        )
        cos_c, sin_c = self.rope(batch.context_pos, dtype)

        def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat([-x2, x1], dim=-1) * sin

        x = embeds.reshape(n * b, -1).to(dtype)
        for layer in self.layers:
            att = layer.self_attn
            hdn = self.rms(x, layer.input_layernorm)
            q = rotate(self.rms(att.q_proj(hdn).view(-1, hq, d), att.q_norm), cos_b, sin_b)
            k_ctx = rotate(self.rms(att.k_proj(ctx).view(t, hkv, d), att.k_norm), cos_c, sin_c)
            k_blk = rotate(self.rms(att.k_proj(hdn).view(-1, hkv, d), att.k_norm), cos_b, sin_b)
            v = torch.cat([att.v_proj(ctx), att.v_proj(hdn)]).view(-1, hkv, d)
            k = torch.cat([k_ctx, k_blk])
            heads = [z.transpose(0, 1)[None].to(v.dtype) for z in (q, k, v)]
            out = attend(*heads, scale=d**-0.5)[0].transpose(0, 1).reshape(n * b, hq * d)
            x = x + att.o_proj(out)
            hdn = self.rms(x, layer.post_attention_layernorm)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(hdn)) * layer.mlp.up_proj(hdn))
        return self.rms(x, self.norm).view(n, b, -1)


def reference_attention(batch: PackedBatch) -> Callable[..., torch.Tensor]:
    """attend(q, k, v, scale) for this batch: the DFLASH.md rule as a mask_mod, compiled FlexAttention on CUDA."""
    ctx_seq, ctx_pos, blk_seq, anchor = (
        batch.context_seq,
        batch.context_pos,
        batch.block_seq,
        batch.anchor_pos,
    )
    t, b = batch.num_context_tokens, batch.block_size
    n_ctx = torch.tensor(t, device=ctx_seq.device)

    def visible(_b: Any, _h: Any, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        blk = q // b
        c = kv.clamp(max=n_ctx - 1)
        earlier_same_sequence = (ctx_seq[c] == blk_seq[blk]) & (ctx_pos[c] < anchor[blk])
        same_block = ((kv - n_ctx) // b == blk) & (blk_seq[blk] >= 0)
        return torch.where(kv < n_ctx, earlier_same_sequence, same_block)

    m = batch.num_blocks * b
    if ctx_seq.device.type != "cuda":  # FlexAttention has no CPU backward: the same rule as a dense mask
        from torch.nn.attention.flex_attention import create_mask

        dense = create_mask(visible, None, None, m, t + m, device=ctx_seq.device)
        return lambda q, k, v, scale: F.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, scale=scale, enable_gqa=True
        )
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(visible, None, None, m, t + m, device=ctx_seq.device, _compile=True)
    flex = _compiled_flex(flex_attention)
    return lambda q, k, v, scale: flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)


_flex: list[Callable[..., torch.Tensor]] = []


def _compiled_flex(flex_attention: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    if not _flex:
        _flex.append(torch.compile(flex_attention))
    return _flex[0]


def _chunk_loss(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    with torch.profiler.record_function("dflash::lm_head_loss"):
        return (F.cross_entropy((h @ w.t()).float(), labels, reduction="none") * weights).sum()


def reference_loss(
    hidden: torch.Tensor, frozen: FrozenTarget, batch: PackedBatch, chunk: int = 2048
) -> torch.Tensor:
    h = hidden[:, 1:].reshape(-1, hidden.shape[-1])
    labels, weights = batch.labels[:, 1:].reshape(-1), batch.weights[:, 1:].reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk):
        e = s + chunk
        total = total + checkpoint(
            _chunk_loss, h[s:e], frozen.lm_head_weight, labels[s:e], weights[s:e], use_reentrant=False
        )
    return total / weights.sum()


def reference_loss_and_backward(
    model: ReferenceDrafter, frozen: FrozenTarget, batch: PackedBatch, autocast: Any
) -> torch.Tensor:
    with autocast:
        attend = reference_attention(batch)
        loss = reference_loss(model(batch, frozen.embed(batch.block_ids), attend), frozen, batch)
    loss.backward()
    return loss.detach()
