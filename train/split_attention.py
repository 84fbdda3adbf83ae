"""Block attention in two parts: the context keys through FlexAttention, each block's own B slots densely.

A query of block n sees two key intervals (`block_mask.KeyIntervals`): context [lo_n, hi_n) and its block's
own B slots. In one BlockMask over [context | slots], each 128-query tile (8 blocks of B = 16) visits a
128-key tile of slots of which 1/8 is visible, besides its context tiles. Split, FlexAttention runs over the
T context keys alone, each block's slots are one [B x B] attention (a batched matmul), and the two softmaxes
are merged through their log-sum-exps:

    out = (o_ctx * exp(lse_ctx) + o_own * exp(lse_own)) / (exp(lse_ctx) + exp(lse_own))

which is one softmax over both intervals (`tests/test_split_attention.py` checks it, and its gradients,
against dense SDPA over the rule). Padding blocks see nothing and output 0, as in `mask.py`.

Public API:
    own_block_attention(q, k, v, scale, block_size, real_rows) -> (out [1, H, M, D], lse [1, H, M]), fp32 at least
    merge_softmaxes(out_a, lse_a, out_b, lse_b) -> [1, H, M, D] (fp32 at least)  rows where both lse are -inf -> 0
    split_attention(flex, q, k_ctx, v_ctx, k_own, v_own, block_mask, scale, block_size, real_rows,
                    kernel_options=None) -> [1, H, M, D]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _wide(x: torch.Tensor) -> torch.Tensor:
    """fp32 at least (bf16 inputs are summed in fp32; a float64 test stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def own_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    block_size: int,
    real_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's B queries over its own B slots. q [1, H, M, D], k/v [1, Hkv, M, D] (M = N * B, H a
    multiple of Hkv), real_rows [M] bool (False: a padding block's row, whose lse is -inf)."""
    heads, m, d = q.shape[1], q.shape[2], q.shape[3]
    n = m // block_size
    groups = heads // k.shape[1]
    # The products in the inputs' dtype (tensor cores for bf16), the softmax in fp32 at least.
    qb = q[0].view(heads, n, block_size, d)
    kb = k[0].view(-1, n, block_size, d).repeat_interleave(groups, dim=0)
    vb = v[0].view(-1, n, block_size, d).repeat_interleave(groups, dim=0)
    scores = _wide(torch.matmul(qb, kb.transpose(-1, -2))) * scale  # [H, N, B, B]
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]).to(vb.dtype), vb)
    lse = lse.reshape(1, heads, m).masked_fill(~real_rows, float("-inf"))
    return out.reshape(1, heads, m, d), lse


def merge_softmaxes(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """One softmax's output from two over disjoint keys ([1, H, M, D] outputs, [1, H, M] natural-log lse)."""
    top = torch.maximum(lse_a, lse_b).detach()  # a stabiliser only: the result does not depend on it
    top = top.masked_fill(torch.isinf(top), 0.0)  # rows that see no key at all: both weights 0
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = (w_a + w_b).clamp_min(torch.finfo(torch.float32).tiny)
    return (_wide(out_a) * w_a[..., None] + _wide(out_b) * w_b[..., None]) / total[..., None]


def split_attention(
    flex: Callable[..., Any],
    q: torch.Tensor,
    k_ctx: torch.Tensor,
    v_ctx: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    block_mask: object,
    scale: float,
    block_size: int,
    real_rows: torch.Tensor,
    kernel_options: dict[str, int] | None = None,
) -> torch.Tensor:
    """`flex` (FlexAttention, compiled or not) over the context with `block_mask` (context intervals only),
    the own slots densely, merged; in q's dtype. `kernel_options` go to `flex` as they are."""
    from torch.nn.attention.flex_attention import AuxRequest

    out_ctx, aux = flex(
        q,
        k_ctx,
        v_ctx,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k_ctx.shape[1],
        return_aux=AuxRequest(lse=True),
        kernel_options=kernel_options,
    )
    out_own, lse_own = own_block_attention(q, k_own, v_own, scale, block_size, real_rows)
    return merge_softmaxes(out_ctx, aux.lse, out_own, lse_own).to(q.dtype)
