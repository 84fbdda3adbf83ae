"""Weighted cross-entropy through the frozen lm_head without holding all logits, plus training statistics.

Public API (stable):
    linear_cross_entropy(hidden[R, H], lm_head_weight[V, H], labels[R], weights[R], *, chunk_rows=None,
                         normalizer=None, compile_backend=None) -> (loss, argmax[R])
        loss = sum_r weights[r] * CE(hidden[r] @ W.T, labels[r]) / normalizer (default: sum of weights).
        Logits exist for one chunk of rows at a time (`chunk_rows`, or None: equal chunks of at most
        LOGIT_CHUNK_ELEMENTS logits). The gradient w.r.t. `hidden` is computed in the same chunk pass (the
        lm_head is frozen, so it is the only gradient) and kept ([R, H], small); backward only scales it.
        Per chunk the CE terms (`chunk_terms`) run eagerly in place (peak ~ chunk x V x 6 bytes) or, with
        `compile_backend`, compiled into two fused passes over the bf16 logits.
    drafter_loss(model, frozen, batch, *, chunk_rows=None, attn_mask=None, normalizer=None,
                 slot_scale=None, feature_noise_std=0.0, generator=None, distill=None) -> (loss, LossStats)
        the loss epilogue is compiled when the model's regions are (`compiled.speed_up`); `slot_scale` [B]
        multiplies the batch's weights slot by slot (`slot_weights.ReachWeights`).
    Distill(alpha, feature_index): distillation from the target's own next-token distribution. The label of
        each drafted slot becomes (1 - alpha) * onehot(token) + alpha * softmax(target logits), the target's
        logits computed from its cached last layer (the `feature_index`-th layer of the batch) through its
        final norm and lm_head: slot k of the block at anchor a reads the target's state at a + k - 1, the
        position whose output token is x[a + k]. alpha = 1 is soft cross-entropy (KL to the target plus its
        entropy, so its loss is not comparable with hard CE); statistics stay those of the hard labels.
    teacher_rows(batch) -> LongTensor[N, B-1]: the context row of the target state that predicts each slot.
    LossStats: per-slot accuracy counts and acceptance tallies as device tensors (no host sync);
        `.merge(other)`, `.tensors()` for all-reduce, `.summary() -> dict[str, float]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from .acceptance import accepted_lengths
from .compiled import CompiledOrEager, regions_backend

if TYPE_CHECKING:
    from .blocks import PackedBatch
    from .frozen import FrozenTarget
    from .mask import AttentionMask
    from .model import DFlashDrafter


# Auto chunking keeps a chunk's logits at or under this many elements (Qwen3's 151,936-entry vocab: 1,766 rows,
# 512 MiB of bf16 logits) in near-equal chunks, so a compiled epilogue sees one or two shapes (a Qwen3-8B step's
# 7,680 rows: five of 1,536), not a remainder of every size; a small vocabulary is a single chunk.
LOGIT_CHUNK_ELEMENTS = 2**28


def chunk_bounds(rows: int, vocab: int, chunk_rows: int | None) -> list[tuple[int, int]]:
    """(start, end) row ranges: `chunk_rows` at a time, or (None) equal chunks of at most
    LOGIT_CHUNK_ELEMENTS logits each."""
    if chunk_rows is None:
        count = max(1, -(-rows * vocab // LOGIT_CHUNK_ELEMENTS))
        chunk_rows = max(1, -(-rows // count))
    return [(start, min(start + chunk_rows, rows)) for start in range(0, rows, chunk_rows)]


def _row_terms(
    x: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp per row, sum of scale * CE, argmax) of fp32 logits x."""
    lse = torch.logsumexp(x, dim=-1)
    target = x.gather(1, labels[:, None]).squeeze(1)
    return lse, ((lse - target) * scale).sum(), x.argmax(dim=-1)


def soft_chunk_terms(
    logits: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    need_grad: bool,
    teacher_logits: torch.Tensor,
    alpha: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`chunk_terms` against soft labels q = (1 - alpha) * onehot(labels) + alpha * softmax(teacher_logits):
    per row lse(x) - q . x, whose gradient is softmax(x) - q."""
    x = logits.float()
    q = torch.softmax(teacher_logits.float(), dim=-1).mul_(alpha)
    q.scatter_add_(1, labels[:, None], torch.full_like(x[:, :1], 1.0 - alpha))
    lse = torch.logsumexp(x, dim=-1)
    loss_sum = ((lse - (q * x).sum(-1)) * scale).sum()
    preds = x.argmax(dim=-1)
    if not need_grad:
        return loss_sum, preds, None
    grad = x.sub_(lse[:, None]).exp_().sub_(q).mul_(scale[:, None])
    return loss_sum, preds, grad.to(logits.dtype)


def chunk_terms(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk's (sum of scale * CE, argmax, d loss / d logits in the logits' dtype or None).

    Written out of place for torch.compile (`loss_epilogue`), which fuses it into two passes over
    the logits; eagerly it computes exactly what `_chunk_terms_in_place` does, in more memory."""
    x = logits.float()
    lse, loss_sum, preds = _row_terms(x, labels, scale)
    if not need_grad:
        return loss_sum, preds, None
    probs = torch.exp(x - lse[:, None])
    is_label = torch.arange(x.shape[1], device=x.device) == labels[:, None]
    grad = torch.where(is_label, probs - 1.0, probs) * scale[:, None]  # softmax - onehot, weighted
    return loss_sum, preds, grad.to(logits.dtype)


_epilogues: dict[str, CompiledOrEager] = {}


def loss_epilogue(backend: str) -> CompiledOrEager:
    """One compiled `chunk_terms` per backend for the process (its compiled graphs are shared)."""
    if backend not in _epilogues:
        _epilogues[backend] = CompiledOrEager(chunk_terms, "loss epilogue", backend)
    return _epilogues[backend]


def loss_epilogues() -> list[CompiledOrEager]:
    """The epilogues this process compiled (a bench reports which fell back to eager)."""
    return list(_epilogues.values())


def _chunk_terms_in_place(
    logits: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`chunk_terms` for eager runs: one fp32 copy of the logits, reused for the gradient."""
    x = logits.float()
    lse, loss_sum, preds = _row_terms(x, labels, scale)
    if not need_grad:
        return loss_sum, preds, None
    probs = x.sub_(lse[:, None]).exp_()
    probs.scatter_add_(1, labels[:, None], -torch.ones_like(lse[:, None]))
    probs.mul_(scale[:, None])
    return loss_sum, preds, probs.to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        row_weights: torch.Tensor,
        normalizer: torch.Tensor | float,
        chunk_rows: int | None,
        need_grad: bool,
        terms: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
        teacher: torch.Tensor | None,
        alpha: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        hidden_c = hidden.to(weight.dtype)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        preds = torch.empty(rows, dtype=torch.long, device=hidden.device)
        grad = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_grad else None
        scale = row_weights.float() / normalizer
        for start, end in chunk_bounds(rows, weight.shape[0], chunk_rows):
            # The lm_head is frozen: d loss / d hidden is the only gradient, computed here while the chunk's
            # logits exist (no recomputation in backward).
            logits = hidden_c[start:end] @ weight.t()
            if teacher is None:
                loss_sum, preds[start:end], grad_logits = terms(
                    logits, labels[start:end], scale[start:end], grad is not None
                )
            else:
                teacher_logits = teacher[start:end].to(weight.dtype) @ weight.t()
                loss_sum, preds[start:end], grad_logits = soft_chunk_terms(
                    logits, labels[start:end], scale[start:end], grad is not None, teacher_logits, alpha
                )
                del teacher_logits
            total += loss_sum
            if grad is not None:
                grad[start:end] = grad_logits @ weight
            del logits, grad_logits
        ctx.mark_non_differentiable(preds)
        ctx.save_for_backward(grad if grad is not None else torch.empty(0))
        ctx.hidden_dtype = hidden.dtype
        return total, preds

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_preds: torch.Tensor | None) -> tuple[Any, ...]:
        (grad,) = ctx.saved_tensors
        if grad.numel() == 0 and ctx.needs_input_grad[0]:
            raise RuntimeError("linear_cross_entropy: the gradient was not computed in forward")
        grad_hidden = (grad * grad_loss).to(ctx.hidden_dtype) if ctx.needs_input_grad[0] else None
        return grad_hidden, None, None, None, None, None, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_rows: int | None = None,
    normalizer: torch.Tensor | float | None = None,
    compile_backend: str | None = None,
    teacher: torch.Tensor | None = None,
    alpha: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean CE, argmax per row); see the module docstring. `lm_head_weight` gets no gradient.
    `teacher` [R, H] (the target's final-normed states for the same rows) mixes `alpha` of its distribution
    into the labels (eager epilogue)."""
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if hidden.ndim != 2 or lm_head_weight.ndim != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and lm_head {tuple(lm_head_weight.shape)} do not match"
        )
    # A float stays a float: a device tensor made from it would be a host-to-device copy that waits for the
    # GPU to drain (one sync per step).
    if normalizer is None:
        normalizer = weights.float().sum()
    norm = (
        normalizer.float().clamp_min(1e-12) if torch.is_tensor(normalizer) else max(float(normalizer), 1e-12)
    )
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    terms = _chunk_terms_in_place if compile_backend is None else loss_epilogue(compile_backend)
    with torch.profiler.record_function("dflash::lm_head_loss"):  # a name for profiles (bench_train_step)
        return _LinearCrossEntropy.apply(
            hidden, lm_head_weight.detach(), labels.long(), weights, norm, chunk_rows, need_grad, terms,
            None if teacher is None else teacher.detach(), float(alpha),
        )  # fmt: skip


@dataclass(slots=True)
class LossStats:
    """Sums over one or more batches (device tensors: add across steps/ranks, sync only in `summary`)."""

    loss_sum: torch.Tensor  # sum over batches of (weighted mean loss x weight_sum)
    weight_sum: torch.Tensor
    slot_correct: torch.Tensor  # [B] argmax == label at valid slots
    slot_valid: torch.Tensor  # [B] valid (weight > 0) slots
    accept_at_least: torch.Tensor  # [B] blocks whose accepted prefix A >= k (index k; k = 0 counts blocks)
    accept_len_sum: torch.Tensor  # sum of A + 1 over real blocks

    def merge(self, other: LossStats) -> LossStats:
        return LossStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def summary(self) -> dict[str, float]:
        blocks = max(float(self.accept_at_least[0]), 1.0)
        out = {
            "loss": float(self.loss_sum / self.weight_sum.clamp_min(1e-12)),
            "tau": float(self.accept_len_sum) / blocks,
            "blocks": float(self.accept_at_least[0]),
            "acc": float(self.slot_correct[1:].sum() / self.slot_valid[1:].sum().clamp_min(1)),
        }
        acc = self.slot_correct / self.slot_valid.clamp_min(1)
        for k in range(1, self.slot_valid.shape[0]):
            out[f"acc_{k}"] = float(acc[k])
            out[f"accept_{k}"] = float(self.accept_at_least[k]) / blocks
        return out


@dataclass(frozen=True, slots=True)
class Distill:
    """Distillation from the target's distribution: `alpha` of it in each label (see the module docstring);
    the target's last layer is feature `feature_index` of the batch (its place in the data spec's layer_ids,
    after the drafter's own features when it is not one of them)."""

    alpha: float
    feature_index: int


def teacher_rows(batch: PackedBatch) -> torch.Tensor:
    """[N, B-1] context rows holding the target state at a + k - 1 for slot k >= 1 of each block (clamped
    into the sequence for padding blocks and slots past its end, whose weights are 0). Sequences' rows are
    contiguous and sorted (`PackedBatch`), so each block's sequence bounds are two binary searches: no host
    sync."""
    seq = batch.block_seq.clamp_min(0)
    start = torch.searchsorted(batch.context_seq, seq)
    last = torch.searchsorted(batch.context_seq, seq, right=True) - 1
    slots = torch.arange(batch.block_size - 1, device=seq.device)
    return torch.minimum((start + batch.anchor_pos)[:, None] + slots, last[:, None])


def drafter_loss(
    model: DFlashDrafter,
    frozen: FrozenTarget,
    batch: PackedBatch,
    *,
    chunk_rows: int | None = None,
    attn_mask: AttentionMask | None = None,
    normalizer: torch.Tensor | float | None = None,
    slot_scale: torch.Tensor | None = None,
    feature_noise_std: float = 0.0,
    generator: torch.Generator | None = None,
    distill: Distill | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Forward + weighted CE for one packed batch. `normalizer` (e.g. the global weight sum across ranks and
    micro-batches) replaces this batch's weight sum so that summed losses equal the global mean."""
    teacher = None
    if distill is not None and distill.alpha > 0:  # the clean states: noise is the student's regulariser
        h = frozen.hidden_size
        last = batch.features[:, distill.feature_index * h : (distill.feature_index + 1) * h]
        teacher = frozen.final_norm(last[teacher_rows(batch).reshape(-1)])
    if feature_noise_std > 0:
        noise = torch.randn(batch.features.shape, generator=generator, device=batch.features.device)
        batch = replace(batch, features=batch.features + (noise * feature_noise_std).to(batch.features.dtype))
    hidden = model(batch, frozen.embed(batch.block_ids), attn_mask)  # [N, B, H]
    n, b, h = hidden.shape
    # Slot 0 always has weight 0 (the anchor is given): never spend lm_head FLOPs on it.
    drafted = hidden[:, 1:].reshape(n * (b - 1), h)
    labels = batch.labels[:, 1:].reshape(-1)
    weights = batch.weights[:, 1:] if slot_scale is None else batch.weights[:, 1:] * slot_scale[1:]
    weights = weights.reshape(-1)
    weight_sum = weights.float().sum()
    loss, preds = linear_cross_entropy(
        drafted,
        frozen.lm_head_weight,
        labels,
        weights,
        chunk_rows=chunk_rows,
        normalizer=weight_sum if normalizer is None else normalizer,
        compile_backend=regions_backend(model),
        teacher=teacher,
        alpha=0.0 if distill is None else distill.alpha,
    )
    with torch.no_grad():
        preds = preds.view(n, b - 1)
        valid = batch.weights[:, 1:] > 0
        correct = (preds == batch.labels[:, 1:]) & valid
        zero = torch.zeros(1, device=hidden.device)
        slot_correct = torch.cat([zero, correct.float().sum(0)])
        slot_valid = torch.cat([zero, valid.float().sum(0)])
        # Padding blocks are weighted out, not indexed out: boolean indexing would wait for the GPU.
        real = (batch.block_seq >= 0).float()
        accepted = accepted_lengths(preds, batch.labels[:, 1:], valid)
        ks = torch.arange(b, device=hidden.device)
        accept_at_least = ((accepted[:, None] >= ks).float() * real[:, None]).sum(0)
        norm_used = weight_sum if normalizer is None else normalizer
        stats = LossStats(
            loss_sum=loss.detach().float() * norm_used,
            weight_sum=weight_sum,
            slot_correct=slot_correct,
            slot_valid=slot_valid,
            accept_at_least=accept_at_least,
            accept_len_sum=((accepted + 1).float() * real).sum(),
        )
    return loss, stats
