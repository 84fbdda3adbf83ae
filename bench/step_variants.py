"""The training steps `bench_train_step.py` compares, the batches they run on, and how they are timed.

    reference  `reference_step.py`: a plain eager step written outside the project (the floor)
    before     the project's step as it was before issue 13: eager drafter, BlockMask from create_block_mask
               (`FlexMask.from_rule`), loss terms eager in 2048-row chunks
    new        `compiled.speed_up` (compiled regions and loss epilogue), the layout BlockMask, auto chunks
    split      new, FlexAttention over the context keys only and each block's own slots apart
               (`dflash-train --split-own-slots`, `train/split_attention.py`)
All three: fp32 master weights under bf16 autocast ("amp", the trainer's recipe) or bf16 weights ("bf16"),
fused AdamW on CUDA, clipping at 1.0, one optimizer step per call, no host sync inside the step.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from dflash.train.blocks import PackedBatch, SequenceInput, make_packed_batch
from dflash.train.compiled import speed_up
from dflash.train.drafter_config import DrafterConfig
from dflash.train.frozen import FrozenTarget
from dflash.train.loss import drafter_loss
from dflash.train.mask import DenseMask, FlexMask, build_attention_mask, choose_backend
from dflash.train.model import DFlashDrafter

from bench.reference_step import ReferenceDrafter, reference_loss_and_backward

# The new step first: on a fresh machine each variant compiles its own FlexAttention kernels (the
# reference took 229 s cold on an H200), and a call cut off by its time limit should still have its number.
VARIANTS = ("new", "split", "reference", "before")
Step = Callable[[PackedBatch], torch.Tensor]


@dataclass
class Setup:
    cfg: DrafterConfig
    frozen: FrozenTarget
    batches: list[PackedBatch]
    device: torch.device
    precision: str  # "amp" or "bf16"

    @property
    def param_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.precision != "amp" or self.device.type != "cuda":
            return contextlib.nullcontext()
        return torch.autocast("cuda", dtype=torch.bfloat16)


def make_setup(
    target: dict,
    *,
    lengths: list[list[int]],
    anchors: int,
    block: int,
    layers: int,
    device: torch.device,
    precision: str,
    seed: int = 0,
    learnable: bool = False,
) -> Setup:
    """A drafter config, random frozen embed/lm_head and one packed batch per entry of `lengths` (the
    sequence lengths of that pack; the first fifth of each sequence is prompt). `learnable`: token ids
    follow x' = (5x + 3) mod 97 so a loss curve goes down."""
    cfg = DrafterConfig.from_target_config(
        target, mask_token_id=target["vocab_size"] - 1, num_hidden_layers=layers, block_size=block
    )
    h, v = cfg.hidden_size, cfg.vocab_size
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    on_device = torch.Generator(device=device).manual_seed(seed)  # 1.2 G values for Qwen3-8B: not on the host
    embed, head = (torch.randn(v, h, generator=on_device, device=device) * 0.02 for _ in range(2))
    frozen = FrozenTarget(embed, head, target).to(dtype=dtype)
    batches = []
    for pack in lengths:
        seqs = []
        for s in pack:
            if learnable:
                ids = torch.empty(s, dtype=torch.long)
                ids[0] = int(torch.randint(0, 97, (1,), generator=gen))
                for i in range(1, s):
                    ids[i] = (5 * ids[i - 1] + 3) % 97
            else:
                ids = torch.randint(0, v - 1, (s,), generator=gen)
            features = torch.randn(s, cfg.num_features * h, generator=gen).to(dtype)
            seqs.append(SequenceInput(ids, torch.arange(s) >= s // 5, features))
        batch = make_packed_batch(
            seqs, block_size=block, mask_token_id=cfg.mask_token_id, num_anchors=anchors, generator=gen
        )
        batches.append(batch.to(device))
    return Setup(cfg, frozen, batches, device, precision)


def packed_lengths(budget: int, low: int, high: int, packs: int, seed: int = 0) -> list[list[int]]:
    """Sequence lengths of `packs` packs filled greedily up to `budget` tokens, as the loader packs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(packs):
        pack: list[int] = []
        while True:
            s = int(torch.randint(low, high + 1, (1,), generator=gen))
            if sum(pack) + s > budget:
                break
            pack.append(s)
        out.append(pack or [budget])
    return out


def legacy_attention_mask(batch: PackedBatch) -> DenseMask | FlexMask:
    """`mask.build_attention_mask(batch, "auto")` as it was before issue 13 (create_block_mask)."""
    if choose_backend(batch, "auto") == "dense":
        return DenseMask.from_batch(batch)
    return FlexMask.from_rule(batch, fallback_to_dense=True)


def _optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with torch.profiler.record_function("dflash::optimizer"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def build_model(variant: str, setup: Setup, seed: int = 0, compile_mode: str = "auto") -> torch.nn.Module:
    torch.manual_seed(seed)
    with setup.device:
        model = ReferenceDrafter(setup.cfg) if variant == "reference" else DFlashDrafter(setup.cfg)
    model = model.to(dtype=setup.param_dtype)
    if variant in ("new", "split"):
        speed_up(model, compile_mode)
    return model


def loss_and_backward(variant: str, model: torch.nn.Module, setup: Setup, batch: PackedBatch) -> torch.Tensor:
    """One forward + backward of `variant` (gradients accumulate in the model); the detached loss."""
    if variant == "reference":
        return reference_loss_and_backward(model, setup.frozen, batch, setup.autocast())
    with setup.autocast():
        if variant in ("new", "split"):
            mask = build_attention_mask(batch, split=variant == "split")
            loss, _ = drafter_loss(model, setup.frozen, batch, attn_mask=mask)
        else:
            mask = legacy_attention_mask(batch)
            loss, _ = drafter_loss(model, setup.frozen, batch, attn_mask=mask, chunk_rows=2048)
    loss.backward()
    return loss.detach()


def make_step(
    variant: str, setup: Setup, compile_mode: str = "auto", lr: float = 6e-4
) -> tuple[Step, torch.nn.Module]:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    model = build_model(variant, setup, compile_mode=compile_mode)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=setup.device.type == "cuda")

    def step(batch: PackedBatch) -> torch.Tensor:
        loss = loss_and_backward(variant, model, setup, batch)
        _optimizer_step(model, opt)
        return loss

    return step, model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Step, setup: Setup, warmup: int, steps: int) -> dict[str, float]:
    """Median seconds per step over `steps` (cycling through the setup's batches) after `warmup` cycles."""
    batches, device = setup.batches, setup.device
    first = time.perf_counter()
    step(batches[0])
    sync(device)
    first_step_s = time.perf_counter() - first
    for _ in range(warmup):
        for batch in batches:
            step(batch)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], torch.zeros(())
    for i in range(steps):
        start = time.perf_counter()
        loss = step(batches[i % len(batches)])
        sync(device)
        times.append(time.perf_counter() - start)
    out = {
        "seconds_per_step": statistics.median(times),
        "seconds_min": min(times),
        "first_step_s": first_step_s,
        "loss": float(loss),
    }
    if device.type == "cuda":
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out
