"""The drafter's attention mask over one packed row, in two implementations built from ONE rule.

Keys are [T context tokens | N*B block tokens]; queries are the N*B block tokens. A query of block n
(anchor a, sequence s) sees context tokens of sequence s at positions STRICTLY < a and every slot of
block n (both directions); nothing else. Padding blocks (block_seq = -1) see nothing and output 0.

Public API (stable):
    mask_mod_for(batch) -> mask_mod(b, h, q_idx, kv_idx)     the rule, FlexAttention's signature
    dense_mask(batch) -> BoolTensor[N*B, T+N*B]              the rule evaluated densely (CPU, test oracle)
    DenseMask(allowed).attend(q, k, v, scale)               SDPA with a boolean mask
    FlexMask(block_mask).attend(q, k, v, scale)             FlexAttention (compiled on CUDA), no dense S x S
        FlexMask.from_batch(batch)   BlockMask read off the pack layout (`block_mask.py`): no compile, no sync
        FlexMask.from_batch(batch, split=True)   over the context keys only, the own slots apart
        FlexMask.from_rule(batch)    the same BlockMask from create_block_mask over `mask_mod_for` (reference)
    build_attention_mask(batch, backend="auto", split=False) -> DenseMask | FlexMask   (see `choose_backend`)
    choose_backend(batch, backend="auto") -> "dense" | "flex"   the rule "auto" follows
    flex_possible(batch, backend="auto") -> bool           FlexAttention may serve it on a GPU (tiles ahead)
    with flex_scope("walk"): ...   an "auto" fallback inside is the scope's alone (training keeps its kernel)
        visible_pairs(batch) -> int                             allowed (query, key) pairs (for FLOP counts)
    reset_flex(compile_mode=None, forward_tile=FORWARD_TILE)   forget compiled FlexAttention (benchmarks)
    kernel_options(block_mask, device) -> dict | None        the forward tile FlexAttention gets on CUDA
q: [1, Hq, M, D], k/v: [1, Hkv, T+M, D] (GQA handled inside), output [1, Hq, M, D].
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch
import torch.nn.functional as F

from .block_mask import KeyIntervals, layout_block_mask
from .compiled import compile_backward_now
from .config import ATTENTION_CHOICES
from .split_attention import split_attention

if TYPE_CHECKING:
    from .blocks import PackedBatch

log = logging.getLogger(__name__)

# "auto" keeps batches whose dense mask has at most this many (query, key) pairs on SDPA. Such a mask is
# small (1 byte a pair, built once per batch), SDPA needs no compile (FlexAttention's first compile took
# ~35 s on an H200, and every new dynamic shape can recompile), and the FLOPs spent on masked pairs are
# negligible at this size. Kept well below what a GPU could hold because with GQA a masked SDPA may run
# the math kernel, which materializes heads x pairs scores. Large batches (a Qwen3-8B step is ~10^8
# pairs) go to FlexAttention, which skips empty tiles and never builds the mask.
AUTO_DENSE_MAX_PAIRS = 16 * 2**20

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class AttentionMask(Protocol):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor: ...


def mask_mod_for(batch: PackedBatch) -> MaskMod:
    """The visibility rule as a FlexAttention mask_mod; also evaluated with broadcasting for the dense mask."""
    context_seq, context_pos = batch.context_seq, batch.context_pos
    block_seq, anchor_pos = batch.block_seq, batch.anchor_pos
    b = batch.block_size
    # A tensor, not a Python int: compiled kernels would bake an int in and recompile for every new length.
    num_context = torch.tensor(int(context_seq.shape[0]), device=context_seq.device)

    def mask_mod(
        _b: torch.Tensor, _h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor
    ) -> torch.Tensor:
        block = q_idx // b
        seq = block_seq[block]
        ctx = torch.minimum(kv_idx, num_context - 1)  # the index is only used where kv_idx < num_context
        sees_context = (context_seq[ctx] == seq) & (context_pos[ctx] < anchor_pos[block])
        sees_slot = ((kv_idx - num_context) // b == block) & (seq >= 0)
        return torch.where(kv_idx < num_context, sees_context, sees_slot)

    return mask_mod


def dense_mask(batch: PackedBatch) -> torch.Tensor:
    """BoolTensor [M, T+M] (M = N*B): True where a query may attend to a key."""
    m = batch.num_blocks * batch.block_size
    device = batch.block_seq.device
    q_idx = torch.arange(m, device=device)[:, None]
    kv_idx = torch.arange(batch.num_context_tokens + m, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    return mask_mod_for(batch)(zero, zero, q_idx, kv_idx)


@dataclass(slots=True)
class DenseMask:
    """SDPA with a dense boolean mask. Rows with no visible key are computed against their own slot (so no
    NaN reaches the backward) and then zeroed, matching FlexAttention's output for empty rows."""

    allowed: torch.Tensor  # [M, T+M] bool
    empty_rows: torch.Tensor  # [M] bool

    @classmethod
    def from_batch(cls, batch: PackedBatch) -> DenseMask:
        """`dense_mask(batch)` evaluated from the layout's key intervals: the same mask, no host sync."""
        m, t = batch.num_blocks * batch.block_size, batch.num_context_tokens
        device = batch.block_seq.device
        rows = torch.arange(m, device=device)
        zero = torch.zeros((), dtype=torch.long, device=device)
        allowed = KeyIntervals.of(batch).mask_mod()(
            zero, zero, rows[:, None], torch.arange(t + m, device=device)
        )
        empty = ~allowed.any(dim=1)
        allowed[rows, t + rows] |= empty
        return cls(allowed=allowed, empty_rows=empty)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=self.allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.masked_fill(self.empty_rows[None, None, :, None], 0.0)


# FlexAttention's functions compiled in this process (on CUDA), and the torch.compile mode they get.
_compiled: dict[Callable[..., torch.Tensor], Callable[..., torch.Tensor]] = {}
_compile_mode: str | None = None
# The forward kernel's tile (query rows, keys) on CUDA, a part of the BlockMask's tile. Inductor's default for
# head dim 64 on an H200 (128 x 128, 4 warps) took 2.72 ms a layer forward on the full size's pack, 64 x 128
# (max-autotune's pick) 0.99 ms (`bench/bench_attention.py`, BENCHMARKS.md): a query here sees ~200 keys, so
# each program's loop over key tiles is short, and halving its rows doubles the programs that share the GPU.
# The backward's default was within 15% of its autotuned best and is left alone.
FORWARD_TILE: tuple[int, int] = (64, 128)
_forward_tile = FORWARD_TILE
# Why FlexAttention failed in this process, per scope ("auto" then uses SDPA there for the rest of the run).
# Scopes keep a failure where it happened: the decode walk's masks change shape with every sample, and
# Inductor has failed to lower some of them (H200, torch 2.11) while training's shapes compiled fine; a walk
# failure must not cost training its kernel (dense SDPA needs more memory on long batches).
_flex_failures: dict[str, str] = {}
_scope: contextvars.ContextVar[str] = contextvars.ContextVar("dflash_flex_scope", default="train")


@contextlib.contextmanager
def flex_scope(name: str) -> Iterator[None]:
    """Masks built and run inside fall back to dense SDPA on their own: a FlexAttention failure here leaves
    other scopes (training's is "train") on FlexAttention, and one elsewhere does not reach this one."""
    token = _scope.set(name)
    try:
        yield
    finally:
        _scope.reset(token)


def _on_device(
    fn: Callable[..., torch.Tensor], device: torch.device, what: str
) -> Callable[..., torch.Tensor]:
    """`fn` compiled once per process on CUDA; eager elsewhere (the reference path of the CPU tests)."""
    if device.type != "cuda":
        return fn
    if fn not in _compiled:
        log.info("compiling %s (the first steps take longer)", what)
        _compiled[fn] = torch.compile(fn, mode=_compile_mode)
    return _compiled[fn]


def _flex_attention(device: torch.device) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return _on_device(flex_attention, device, "FlexAttention")


def _split_eager(*args: object) -> torch.Tensor:
    """`split_attention` with FlexAttention: compiled as one function, the slots and merge fuse around it."""
    from torch.nn.attention.flex_attention import flex_attention

    return split_attention(flex_attention, *args)  # type: ignore[arg-type]


def reset_flex(compile_mode: str | None = None, forward_tile: tuple[int, int] | None = FORWARD_TILE) -> None:
    """Forget this process's compiled FlexAttention functions and failures; later ones compile in
    `compile_mode` (None: torch.compile's default) with `forward_tile` (None: Inductor's). For benchmarks
    comparing kernels and tiles in one process."""
    global _compile_mode, _forward_tile
    _compiled.clear()
    _flex_failures.clear()
    _compile_mode, _forward_tile = compile_mode, forward_tile


def kernel_options(block_mask: object, device: torch.device) -> dict[str, int] | None:
    """FlexAttention's kernel_options for `block_mask` on `device`: `FORWARD_TILE` on CUDA where it divides
    the mask's tile (a kernel tile must), else None (the defaults)."""
    if device.type != "cuda" or _forward_tile is None:
        return None
    (rows, keys), (q_tile, kv_tile) = _forward_tile, block_mask.BLOCK_SIZE  # type: ignore[attr-defined]
    if q_tile % rows or kv_tile % keys:
        return None
    return {"BLOCK_M": rows, "BLOCK_N": keys}


@dataclass(frozen=True, slots=True)
class OwnSlots:
    """What the split needs beside the context's BlockMask: where the slots start in k/v (T), B, and which
    query rows belong to real blocks."""

    num_context: int
    block_size: int
    real_rows: torch.Tensor  # [M] bool

    @classmethod
    def of(cls, batch: PackedBatch) -> OwnSlots:
        real = (batch.block_seq >= 0).repeat_interleave(batch.block_size)
        return cls(batch.num_context_tokens, batch.block_size, real)


def _disable_flex(exc: BaseException) -> None:
    detail = (str(exc).strip().splitlines() or [""])[0][:300]
    scope = _scope.get()
    _flex_failures[scope] = f"{type(exc).__name__}: {detail}"
    log.warning(
        "FlexAttention failed in %s (%s); attention = auto falls back to dense SDPA there for the rest of "
        "this run (same results, more memory on long batches; --attention flex makes this an error)",
        "training" if scope == "train" else f"the {scope}",
        _flex_failures[scope],
    )


def flex_failure(scope: str | None = None) -> str | None:
    """Why FlexAttention was given up in this process, in `scope` (default: the current one; None if not)."""
    return _flex_failures.get(_scope.get() if scope is None else scope)


@dataclass(slots=True)
class FlexMask:
    """FlexAttention over a BlockMask. With `fallback_batch` set ("auto"), a failure to compile or run the
    kernel is logged once and this and every later mask of the process attend through `DenseMask`
    instead; without it ("flex") the error propagates."""

    block_mask: object  # torch.nn.attention.flex_attention.BlockMask
    fallback_batch: PackedBatch | None = None
    own_slots: OwnSlots | None = None  # set: `block_mask` covers the context keys only (the split)
    _dense: DenseMask | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_batch(
        cls,
        batch: PackedBatch,
        block: int | tuple[int, int] | None = None,
        *,
        fallback_to_dense: bool = False,
        split: bool = False,
    ) -> FlexMask:
        """The BlockMask from the pack's layout: the tiles the batch carries (`PackedBatch.tile_layout`), else
        built here (a few small kernels on the batch's device). `split`: over the context keys only, the own
        slots attended apart (`split_attention.py`)."""
        return cls(
            block_mask=layout_block_mask(batch, block, context_only=split),
            fallback_batch=batch if fallback_to_dense else None,
            own_slots=OwnSlots.of(batch) if split else None,
        )

    @classmethod
    def from_rule(
        cls, batch: PackedBatch, block: int | tuple[int, int] = 128, *, fallback_to_dense: bool = False
    ) -> FlexMask:
        """The BlockMask from create_block_mask evaluating `mask_mod_for` on every pair (compiled on CUDA)."""
        from torch.nn.attention.flex_attention import create_block_mask

        m = batch.num_blocks * batch.block_size
        device = batch.block_seq.device
        block_mask = create_block_mask(
            mask_mod_for(batch),
            B=None,
            H=None,
            Q_LEN=m,
            KV_LEN=batch.num_context_tokens + m,
            device=device,
            BLOCK_SIZE=block,
            _compile=device.type == "cuda",
        )
        return cls(block_mask=block_mask, fallback_batch=batch if fallback_to_dense else None)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fallback_batch is None:
            return self._flex(q, k, v, scale)
        if flex_failure() is None:
            try:
                with compile_backward_now():
                    return self._flex(q, k, v, scale)
            except torch.OutOfMemoryError:
                raise  # the dense path needs more memory, not less
            except Exception as exc:
                # Any class: compile and lowering errors come from Dynamo, Inductor and Triton alike.
                _disable_flex(exc)
        if self._dense is None:
            self._dense = DenseMask.from_batch(self.fallback_batch)
        return self._dense.attend(q, k, v, scale)

    def _flex(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        own, options = self.own_slots, kernel_options(self.block_mask, q.device)
        if own is not None:
            t = own.num_context
            return _on_device(_split_eager, q.device, "FlexAttention with the own slots apart")(
                q, k[:, :, :t], v[:, :, :t], k[:, :, t:], v[:, :, t:], self.block_mask, scale, own.block_size,
                own.real_rows, options,
            )  # fmt: skip
        fn = _flex_attention(q.device)
        return fn(
            q, k, v, block_mask=self.block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
            kernel_options=options,
        )  # fmt: skip

    def tile_density(self) -> float:
        """Fraction of (query tile, key tile) pairs the kernel visits (BlockMask.sparsity() is the rest)."""
        return 1.0 - float(self.block_mask.sparsity()) / 100.0


def visible_pairs(batch: PackedBatch) -> int:
    """Number of (query, key) pairs the rule allows, without building a mask: a block at anchor a sees the
    a context tokens before it (its sequence starts at position 0) and its own B slots."""
    real = batch.block_seq >= 0
    return int(((batch.anchor_pos[real] + batch.block_size) * batch.block_size).sum())


def choose_backend(
    batch: PackedBatch, backend: Literal["auto", "dense", "flex"] = "auto"
) -> Literal["dense", "flex"]:
    """The implementation `build_attention_mask` uses. "dense"/"flex" are taken as given; "auto" picks
    dense SDPA off CUDA, for batches of at most `AUTO_DENSE_MAX_PAIRS` (query, key) pairs, and after
    FlexAttention failed in this process's current `flex_scope`; FlexAttention otherwise."""
    if backend not in ATTENTION_CHOICES:
        raise ValueError(f"attention backend must be 'auto', 'dense' or 'flex', got {backend!r}")
    if backend != "auto":
        return backend
    if batch.block_seq.device.type != "cuda" or not flex_possible(batch) or flex_failure() is not None:
        return "dense"
    return "flex"


def flex_possible(batch: PackedBatch, backend: Literal["auto", "dense", "flex"] = "auto") -> bool:
    """Whether FlexAttention may serve `batch` on a GPU: "flex", or "auto" past the dense size. A GPU run's
    loader builds such batches' tiles ahead (`PackedBatch.with_tile_layout`), on its CPU threads."""
    if backend != "auto":
        return backend == "flex"
    m = batch.num_blocks * batch.block_size
    return m * (batch.num_context_tokens + m) > AUTO_DENSE_MAX_PAIRS


def build_attention_mask(
    batch: PackedBatch, backend: Literal["auto", "dense", "flex"] = "auto", *, split: bool = False
) -> DenseMask | FlexMask:
    """One mask per batch, shared by every layer and head. "flex" is strict (errors propagate); FlexAttention
    chosen by "auto" falls back to dense SDPA, once and with a warning, if it fails to compile or run.
    `split`: FlexAttention over the context keys only, the own slots apart (`split_attention.py`)."""
    if choose_backend(batch, backend) == "dense":
        return DenseMask.from_batch(batch)
    if backend == "flex":
        return FlexMask.from_batch(batch, split=split)
    try:  # on CUDA the BlockMask is built by a compiled function too
        return FlexMask.from_batch(batch, fallback_to_dense=True, split=split)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        _disable_flex(exc)
        return DenseMask.from_batch(batch)
