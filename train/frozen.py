"""The target's frozen embedding and lm_head, read from a cache's `target/` folder (never trained or exported).

Public API (stable):
    FrozenTarget(embed_weight[V, H], lm_head_weight[V, H], config: dict, mask_token_id: int | None,
                 final_norm_gain[H] | None)
        .embed(ids) -> [..., H]; .logits(hidden) -> [..., V]; .to(device=None, dtype=None) -> FrozenTarget
        .final_norm(last_layer_output[..., H]) -> [..., H]: the target's final RMSNorm (None gain: refused),
            so `.logits(.final_norm(h))` are the target's own logits from its cached last layer
        .vocab_size, .hidden_size, .num_layers, .norm_eps
    load_frozen_target(cache_dir, *, mask_token_id=None, device=None, dtype=None) -> FrozenTarget
        reads CACHE/target/ (`dflash.shards.target_parts`); mask_token_id defaults to the first unused
        embedding row (`default_mask_token_id`), an error when none is free and none is given; a given id
        the tokenizer uses for text is refused (`mask_token.check_mask_token_id`).
A tied target's lm_head IS its embedding: one tensor, on every device and in every dtype.
    default_mask_token_id(target_dir, vocab_size) -> int | None   (from `mask_token.py`)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from dflash.shards.target_config import decoder_config
from dflash.shards.target_parts import read_target_parts

from .mask_token import check_mask_token_id, default_mask_token_id


class FrozenTarget:
    """Plain tensors, not an nn.Module: wrappers (DDP/FSDP), optimizers and checkpoints never see them."""

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        config: dict[str, Any],
        mask_token_id: int | None = None,
        final_norm_gain: torch.Tensor | None = None,
    ):
        if embed_weight.ndim != 2 or embed_weight.shape != lm_head_weight.shape:
            raise ValueError(
                f"embed {tuple(embed_weight.shape)} and lm_head {tuple(lm_head_weight.shape)} "
                "must both be [vocab, hidden]"
            )
        tied = lm_head_weight is embed_weight
        self.embed_weight = embed_weight.detach().requires_grad_(False)
        self.lm_head_weight = self.embed_weight if tied else lm_head_weight.detach().requires_grad_(False)
        self.config = config
        self.mask_token_id = mask_token_id
        self.final_norm_gain = None if final_norm_gain is None else final_norm_gain.detach().float()

    @property
    def vocab_size(self) -> int:
        return int(self.embed_weight.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embed_weight.shape[1])

    @property
    def num_layers(self) -> int:
        return int(decoder_config(self.config)["num_hidden_layers"])

    @property
    def norm_eps(self) -> float:
        return float(decoder_config(self.config).get("rms_norm_eps", 1e-6))

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm in fp32, as its own forward computes it before the lm_head."""
        if self.final_norm_gain is None:
            raise ValueError(
                "this cache's target/ holds no final norm gain (written by an older dflash-extract)"
            )
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return x * self.final_norm_gain

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.embed_weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.lm_head_weight.dtype) @ self.lm_head_weight.t()

    @property
    def tied(self) -> bool:
        return self.lm_head_weight is self.embed_weight

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> FrozenTarget:
        embed = self.embed_weight.to(device=device, dtype=dtype)
        head = embed if self.tied else self.lm_head_weight.to(device=device, dtype=dtype)
        gain = None if self.final_norm_gain is None else self.final_norm_gain.to(device=device)
        return FrozenTarget(embed, head, self.config, self.mask_token_id, gain)


def load_frozen_target(
    cache_dir: str | Path,
    *,
    mask_token_id: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> FrozenTarget:
    parts = read_target_parts(cache_dir)
    target_dir, config, embed, head = parts.directory, parts.config.raw, parts.embed, parts.lm_head
    vocab = int(embed.shape[0])
    if mask_token_id is None:
        mask_token_id = default_mask_token_id(target_dir, vocab)
        if mask_token_id is None:
            raise ValueError(
                f"no free embedding row for the mask token in {target_dir} (tokenizer fills the "
                f"{vocab}-row table or is absent); pass mask_token_id explicitly"
            )
    elif not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask_token_id {mask_token_id} outside the target vocabulary 0..{vocab - 1}")
    else:
        check_mask_token_id(target_dir, mask_token_id, vocab)
    frozen = FrozenTarget(embed, head, config, mask_token_id, parts.final_norm_gain)
    return frozen.to(device=device, dtype=dtype) if (device is not None or dtype is not None) else frozen
