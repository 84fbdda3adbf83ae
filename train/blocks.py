"""Training blocks (pure tensor logic, no I/O): anchors, block inputs, labels, loss weights, packing.

Public API (stable):
    PackedBatch                      the model's input (fields as in ARCHITECTURE.md), `.to(device)`, `.pin_memory()`,
                                     `.dequantized()` (fp8-packed features -> bf16 wherever the batch is),
                                     `.with_tile_layout()` (FlexAttention's tiles built ahead, `block_mask.py`)
    SequenceInput(input_ids, loss_mask, features)   one sequence; `features` [S, K*H]
    default_gamma(block_size) -> float              7 / 5 / 4 for B = 16 / 10 / 8 (the rule lives in config.py)
    slot_weights(block_size, gamma) -> Tensor[B]    0 at slot 0, exp(-(k-1)/gamma) after
    eligible_anchors(loss_mask) -> LongTensor       positions a with loss_mask[a] and loss_mask[a+1]
    sample_anchors(loss_mask, num_anchors, generator, preference=None) -> LongTensor (sorted, distinct)
    copy_preference(input_ids, loss_mask, block_size, weight) -> Tensor[S]   anchor odds by what lookup copies
    lookup_copies(input_ids, loss_mask, block_size) -> LongTensor[S]   tokens prompt lookup gets accepted there
    raise_copied_slots(weights, copied, weight) -> Tensor[n, B]   slots lookup copies weighed at least `weight`
    build_blocks(input_ids, loss_mask, anchors, block_size, mask_token_id, gamma) -> (block_ids, labels, weights)
    make_packed_batch(sequences, *, block_size, mask_token_id, num_anchors, gamma=None, generator=None,
                      anchors=None, layer_ids=None, pad_blocks_to_multiple=1, copy_anchor_weight=1.0,
                      copy_slot_weight=0.0)
                      -> PackedBatch

A sequence may be a `SequenceInput` or anything with `input_ids`, `loss_mask` and `hidden: dict[layer, [S, H]]`
(a `dflash.shards` Sample); the latter needs `layer_ids` to pick and order the layers. Samples read from an
fp8 cache with `dequantize=False` hold `Fp8Block`s: they pack as fp8 bits plus per-token scales (half the
bytes to pin and copy) and `dequantized()` turns them into the cache's bf16 values on the GPU. q4/q6 caches
hold `QBlock`s, packed likewise as int8 codes plus their token, group and per-sequence channel scales.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from dflash.shards import Fp8Block, dequantize_fp8
from dflash.shards.qcodec import QBlock, dequantize_q

from .block_mask import Tile, TileLayout
from .config import default_gamma
from .lookup import lookup_accepted


@dataclass(slots=True)
class PackedBatch:
    """Several sequences' context tokens and blocks. T context tokens, N blocks of B slots.

    Layout (`block_mask.py` relies on it): each sequence's context tokens are contiguous and in position
    order from 0, sequences in pack order (`context_seq` sorted)."""

    features: torch.Tensor  # [T, K*H] target features, layers concatenated in target_layer_ids order
    context_pos: torch.Tensor  # [T] long, position within its own sequence
    context_seq: torch.Tensor  # [T] long, sequence index within the pack
    block_ids: torch.Tensor  # [N, B] long, anchor token then mask_token_id x (B-1)
    anchor_pos: torch.Tensor  # [N] long, anchor position a (slot k sits at a + k)
    block_seq: torch.Tensor  # [N] long, sequence of each block, -1 for padding blocks
    labels: torch.Tensor  # [N, B] long, x[a + k] (0 where the weight is 0 past the end)
    weights: torch.Tensor  # [N, B] float32 loss weights
    # [T, K] float32 when `features` holds fp8 e4m3 bits (uint8 [T, K*H]) or q codes (int8 [T, K*H]), else None
    feature_scales: torch.Tensor | None = None
    # q codes only: ratio codes uint8 [T, K*ceil(H/32)] and channel scale codes int8 [sequences, K*H]
    feature_group_scales: torch.Tensor | None = None
    feature_channel_scales: torch.Tensor | None = None
    # FlexAttention's tiles, built ahead by a GPU run's loader (`with_tile_layout`); None: built when needed
    tile_layout: TileLayout | None = None

    @property
    def num_blocks(self) -> int:
        return int(self.block_ids.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.block_ids.shape[1])

    @property
    def num_context_tokens(self) -> int:
        return int(self.features.shape[0])

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the batch holds (optional fields that are None left out, the tile layout's in)."""
        held = [getattr(self, f.name) for f in fields(self)]
        return [t for t in held if isinstance(t, torch.Tensor)] + (
            self.tile_layout.tensors() if self.tile_layout is not None else []
        )

    def with_tile_layout(self, tile: int | Tile | None = None, context_only: bool = False) -> PackedBatch:
        """This batch carrying its FlexAttention tiles (`block_mask.TileLayout`), built where it is."""
        return replace(self, tile_layout=TileLayout.of(self, tile, context_only))

    def _map(self, fn: Any) -> PackedBatch:
        return PackedBatch(**{f.name: _maybe(fn, getattr(self, f.name)) for f in fields(self)})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        return self._map(lambda t: t.pin_memory())

    def clone(self) -> PackedBatch:
        return self._map(torch.clone)

    def dequantized(self) -> PackedBatch:
        """bf16 features from fp8- or q-packed ones (same bits as the codec's own decode); else self."""
        if self.feature_scales is None:
            return self
        t, k = self.feature_scales.shape
        h = self.features.shape[1] // k
        if self.feature_group_scales is not None:
            out = self._dequantized_q(t, k, h)
        else:
            out = torch.empty((t, k * h), dtype=torch.bfloat16, device=self.features.device)
            for j in range(k):  # one layer at a time: an fp32 temporary of [T, H], not [T, K*H]
                cols = slice(j * h, (j + 1) * h)
                block = Fp8Block(q=self.features[:, cols], scale=self.feature_scales[:, j])
                out[:, cols] = dequantize_fp8(block, torch.bfloat16)
        return replace(
            self, features=out, feature_scales=None, feature_group_scales=None, feature_channel_scales=None
        )

    def _dequantized_q(self, t: int, k: int, h: int) -> torch.Tensor:
        """[T, K*H] bf16 from q codes in one `dequantize_q` call over every layer (its steps bound the fp32
        temporaries): token t's layer j is row t * K + j, and its channel scales row seq(t) * K + j. One call,
        not one a layer: on a GPU each operation is a launch, a GIL hand-off beside the training thread."""
        g = self.feature_group_scales.shape[1] // k
        rows = self.feature_channel_scales.shape[0]
        layer = torch.arange(k, device=self.context_seq.device)
        q = QBlock(
            codes=self.features.reshape(t * k, h),
            group_scales=self.feature_group_scales.reshape(t * k, g),
            token_scales=self.feature_scales.reshape(t * k),
            channel_scales=self.feature_channel_scales.reshape(rows * k, h),
        )
        row_of_token = (self.context_seq[:, None] * k + layer).reshape(t * k)
        return dequantize_q(q, torch.bfloat16, row_of_token=row_of_token).view(t, k * h)


def _maybe(fn: Any, t: torch.Tensor | TileLayout | None) -> torch.Tensor | TileLayout | None:
    if t is None:
        return None
    return t.map(fn) if isinstance(t, TileLayout) else fn(t)


@dataclass(slots=True)
class SequenceInput:
    input_ids: torch.Tensor  # [S] long
    loss_mask: torch.Tensor  # [S] bool
    features: torch.Tensor  # [S, K*H]


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] float32: 0 for the anchor slot (it is given, not drafted), exp(-(k-1)/gamma) for slot k >= 1."""
    if gamma <= 0 or not math.isfinite(gamma):
        raise ValueError(f"gamma must be a positive finite number, got {gamma}")
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a with loss_mask[a] and loss_mask[a+1]: the anchor is given and at least slot 1 is trained."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:], as_tuple=False).flatten()


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    preference: torch.Tensor | None = None,
) -> torch.Tensor:
    """Up to `num_anchors` distinct eligible positions without replacement, sorted: uniformly, or with odds
    in proportion to `preference` ([S], positive where eligible) when it is given."""
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    candidates = eligible_anchors(loss_mask)
    if candidates.numel() <= num_anchors:
        return candidates
    if preference is None:
        pick = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
    else:
        odds = preference.double()[candidates]
        pick = torch.multinomial(odds, num_anchors, replacement=False, generator=generator)
    return candidates[pick].sort().values


def copy_preference(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, block_size: int, weight: float
) -> torch.Tensor:
    """[S] float64 anchor odds: 1 + (weight - 1) x the share of the block prompt lookup would copy there.

    Where the drafter loses to prompt lookup is where lookup copies whole blocks (the quality benchmark's
    lookup split); drawing those anchors more often shows the drafter more copies to learn from. Anchors
    lookup cannot draft at all keep odds 1, so every eligible anchor can still be drawn."""
    return _copy_odds(lookup_copies(input_ids, loss_mask, block_size), block_size, weight)


def _copy_odds(copies: torch.Tensor, block_size: int, weight: float) -> torch.Tensor:
    return 1.0 + (weight - 1.0) * copies.double() / (block_size - 1)


def lookup_copies(input_ids: torch.Tensor, loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """[S] int64: the drafted tokens prompt lookup would get accepted at each anchor (0 where none)."""
    accepted = lookup_accepted(input_ids.numpy(), loss_mask.numpy(), block_size - 1)
    return torch.from_numpy(accepted.clip(min=0))


def raise_copied_slots(weights: torch.Tensor, copied: torch.Tensor, weight: float) -> torch.Tensor:
    """`weights` [n, B] with slots 1..copied[i] of block i raised to at least `weight`.

    The decay (or reach's floor) weighs slot 10 at e^-4.5 with gamma 2, so the far slots of a block prompt
    lookup copies whole barely train, and there the drafter falls furthest behind lookup (the benchmark's
    split). A copy is the same operation at every slot: its far slots are as learnable as its first. Slots
    outside the response keep weight 0 (lookup counts only response tokens)."""
    k = torch.arange(weights.shape[1])
    copy = (k[None, :] >= 1) & (k[None, :] <= copied[:, None]) & (weights > 0)
    return torch.where(copy, weights.clamp(min=weight), weights)


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block inputs [n, B] (anchor token, then mask tokens), labels x[a+k] [n, B], weights [n, B] float32."""
    s = input_ids.shape[0]
    anchors = anchors.long()
    if anchors.numel() and (int(anchors.min()) < 0 or int(anchors.max()) >= s):
        raise ValueError(
            f"anchors must lie in 0..{s - 1}, got min {int(anchors.min())} max {int(anchors.max())}"
        )
    pos = anchors[:, None] + torch.arange(block_size)
    inside = pos < s
    safe = pos.clamp(max=s - 1)
    labels = torch.where(inside, input_ids.long()[safe], torch.zeros_like(safe))
    weights = slot_weights(block_size, gamma)[None, :] * (inside & loss_mask.bool()[safe]).float()
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[:, 0] = input_ids.long()[anchors]
    return block_ids, labels, weights


def _features_of(seq: Any, layer_ids: Sequence[int] | None) -> list[torch.Tensor]:
    if isinstance(seq, SequenceInput) or (layer_ids is None and hasattr(seq, "features")):
        return [seq.features]
    if layer_ids is None:
        raise ValueError(
            "sequences carry `hidden` per layer: pass layer_ids (the drafter's target_layer_ids)"
        )
    missing = [i for i in layer_ids if i not in seq.hidden]
    if missing:
        raise ValueError(
            f"sequence lacks target layers {missing} (has {sorted(seq.hidden)}); "
            "the cache does not hold the layers this drafter needs"
        )
    return [seq.hidden[i] for i in layer_ids]


def make_packed_batch(
    sequences: Sequence[Any],
    *,
    block_size: int,
    mask_token_id: int,
    num_anchors: int,
    gamma: float | None = None,
    generator: torch.Generator | None = None,
    anchors: Sequence[torch.Tensor] | None = None,
    layer_ids: Sequence[int] | None = None,
    pad_blocks_to_multiple: int = 1,
    feature_dtype: torch.dtype | None = None,
    copy_anchor_weight: float = 1.0,
    copy_slot_weight: float = 0.0,
) -> PackedBatch:
    """Pack sequences into one row: all context tokens, then up to `num_anchors` blocks PER sequence.

    `anchors` (one tensor per sequence) replaces sampling, e.g. every eligible position for evaluation.
    `copy_anchor_weight` != 1 draws anchors by `copy_preference` instead of uniformly; `copy_slot_weight` > 0
    weighs the slots prompt lookup would copy at least that much (`raise_copied_slots`).
    Padding blocks (block_seq -1, weight 0) round N up to a multiple of `pad_blocks_to_multiple`.
    """
    if not sequences:
        raise ValueError("make_packed_batch needs at least one sequence")
    if anchors is not None and len(anchors) != len(sequences):
        raise ValueError(f"got {len(anchors)} anchor tensors for {len(sequences)} sequences")
    if pad_blocks_to_multiple < 1:
        raise ValueError(f"pad_blocks_to_multiple must be >= 1, got {pad_blocks_to_multiple}")
    gamma = default_gamma(block_size) if gamma is None else gamma
    parts: list[list[torch.Tensor]] = []
    lengths: list[int] = []
    block_parts: list[tuple[torch.Tensor, ...]] = []
    for index, seq in enumerate(sequences):
        ids, mask = seq.input_ids, seq.loss_mask
        feats = _features_of(seq, layer_ids)
        s = ids.shape[0]
        if mask.shape[0] != s or any(f.shape[0] != s for f in feats):
            raise ValueError(
                f"sequence {index}: input_ids ({s}), loss_mask ({mask.shape[0]}) and features "
                f"({[f.shape[0] for f in feats]}) disagree on length"
            )
        copies = None
        if copy_slot_weight > 0 or (anchors is None and copy_anchor_weight != 1.0):
            copies = lookup_copies(ids, mask, block_size)
        if anchors is not None:
            chosen = anchors[index].long()
        else:
            prefer = None if copy_anchor_weight == 1.0 else _copy_odds(copies, block_size, copy_anchor_weight)
            chosen = sample_anchors(mask, num_anchors, generator, prefer)
        blk, lab, wt = build_blocks(ids, mask, chosen, block_size, mask_token_id, gamma)
        if copy_slot_weight > 0:
            wt = raise_copied_slots(wt, copies[chosen], copy_slot_weight)
        parts.append(feats)
        lengths.append(s)
        block_parts.append((blk, lab, wt, chosen, torch.full_like(chosen, index)))

    packed_features = _pack_features(parts, lengths, feature_dtype)
    context_pos = torch.cat([torch.arange(s) for s in lengths])
    context_seq = torch.cat([torch.full((s,), i, dtype=torch.long) for i, s in enumerate(lengths)])
    block_ids, labels, weights, anchor_pos, block_seq = (torch.cat(x) for x in zip(*block_parts, strict=True))
    pad = -block_ids.shape[0] % pad_blocks_to_multiple
    if block_ids.shape[0] + pad == 0:  # no sequence had an eligible anchor: keep shapes non-empty
        pad = pad_blocks_to_multiple
    if pad:
        block_ids = torch.cat([block_ids, torch.full((pad, block_size), mask_token_id, dtype=torch.long)])
        labels = torch.cat([labels, torch.zeros(pad, block_size, dtype=torch.long)])
        weights = torch.cat([weights, torch.zeros(pad, block_size)])
        anchor_pos = torch.cat([anchor_pos, torch.zeros(pad, dtype=torch.long)])
        block_seq = torch.cat([block_seq, torch.full((pad,), -1, dtype=torch.long)])
    return PackedBatch(
        context_pos=context_pos,
        context_seq=context_seq,
        block_ids=block_ids,
        anchor_pos=anchor_pos,
        block_seq=block_seq,
        labels=labels,
        weights=weights,
        **packed_features,
    )


def _pack_features(
    parts: list[list[Any]], lengths: list[int], feature_dtype: torch.dtype | None
) -> dict[str, Any]:
    """[T, K*H] features in one allocation (per-layer slices copied straight in), as PackedBatch fields.
    fp8 blocks pack as uint8 bits plus [T, K] scales; q blocks as int8 codes plus [T, K] token scales,
    [T, K*G] group scales and one row of channel scales per sequence."""
    first = parts[0][0]
    kind = type(first) if isinstance(first, Fp8Block | QBlock) else torch.Tensor
    width = sum(f.shape[1] for f in parts[0])
    total, k = sum(lengths), len(parts[0])
    out: dict[str, Any] = {}
    if kind is Fp8Block:
        out["features"] = torch.empty(total, width, dtype=torch.uint8)
        out["feature_scales"] = torch.empty(total, k, dtype=torch.float32)
    elif kind is QBlock:
        g = first.group_scales.shape[1]
        out["features"] = torch.empty(total, width, dtype=torch.int8)
        out["feature_scales"] = torch.empty(total, k, dtype=torch.float32)
        out["feature_group_scales"] = torch.empty(total, k * g, dtype=torch.uint8)
        out["feature_channel_scales"] = torch.empty(len(parts), width, dtype=torch.int8)
    else:
        out["features"] = torch.empty(total, width, dtype=feature_dtype or first.dtype)
    row = 0
    for index, (feats, s) in enumerate(zip(parts, lengths, strict=True)):
        col = 0
        rows = slice(row, row + s)
        for j, f in enumerate(feats):
            cols = slice(col, col + f.shape[1])
            if col + f.shape[1] > width or not isinstance(f, kind):
                raise ValueError(f"features differ between sequences (expected {width} wide {kind.__name__})")
            if kind is Fp8Block:
                out["features"][rows, cols] = f.q
                out["feature_scales"][rows, j] = f.scale
            elif kind is QBlock:
                out["features"][rows, cols] = f.codes
                out["feature_scales"][rows, j] = f.token_scales
                out["feature_group_scales"][rows, j * g : (j + 1) * g] = f.group_scales
                out["feature_channel_scales"][index, cols] = f.channel_scales
            else:
                out["features"][rows, cols] = f
            col += f.shape[1]
        if col != width:
            raise ValueError(f"feature widths differ between sequences ({col} vs {width})")
        row += s
    return out
