"""One DFlash drafter training step: time, achieved TFLOP/s, peak memory; FlexAttention vs dense agreement.

    python bench/bench_train_step.py [--quick] [--json out.json]         # Qwen3-8B-shaped drafter on CUDA
    python bench/bench_train_step.py --tiny --device cpu                  # exercises the code path on a CPU

Default shape: 5 layers, hidden 4096, 32/8 heads, head_dim 128, intermediate 12288, vocab 151936, B = 16,
512 anchors on one 3072-token sequence (K = 5 target layers), FlexAttention block mask, chunked lm_head loss,
fused AdamW. `--precision amp` (default, the trainer's recipe): fp32 master weights and optimizer state, bf16
autocast; `bf16`: bf16 weights and optimizer state.
FLOPs: `dflash.train.model.flops_per_step` (model FLOPs: matmuls only, attention over the pairs the mask
allows; see its docstring), divided by the measured step time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train.blocks import PackedBatch, SequenceInput, make_packed_batch
from dflash.train.frozen import FrozenTarget
from dflash.train.loss import drafter_loss
from dflash.train.mask import build_attention_mask, visible_pairs
from dflash.train.model import DFlashDrafter, DrafterConfig, flops_per_step

from bench.shapes import QWEN3_8B, TINY


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _make(
    target: dict,
    seq_len: int,
    anchors: int,
    block: int,
    device: torch.device,
    dtype: torch.dtype,
    layers: int = 5,
    seed: int = 0,
):
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target_config(
        target, mask_token_id=target["vocab_size"] - 1, num_hidden_layers=layers, block_size=block
    )
    h, v = cfg.hidden_size, cfg.vocab_size
    frozen = FrozenTarget(torch.randn(v, h) * 0.02, torch.randn(v, h) * 0.02, target).to(
        device=device, dtype=dtype
    )
    prompt = seq_len // 8
    seq = SequenceInput(
        torch.randint(0, v - 1, (seq_len,)),
        torch.arange(seq_len) >= prompt,
        torch.randn(seq_len, cfg.num_features * h).to(dtype),
    )
    batch = make_packed_batch(
        [seq],
        block_size=block,
        mask_token_id=cfg.mask_token_id,
        num_anchors=anchors,
        generator=torch.Generator().manual_seed(seed),
    ).to(device)
    return cfg, frozen, batch


def check_flex_vs_dense(device: torch.device) -> dict[str, float]:
    """Small drafter in fp32: forward outputs (and, on CUDA, parameter gradients) through both mask paths."""
    cfg, frozen, batch = _make(TINY, 384, 48, 16, device, torch.float32, layers=2, seed=1)
    model = DFlashDrafter(cfg).to(device)
    outs, grads = [], []
    for backend in ("dense", "flex"):
        mask = build_attention_mask(batch, backend)
        with torch.no_grad():
            outs.append(model(batch, frozen.embed(batch.block_ids), mask))
        if device.type == "cuda":  # FlexAttention has no backward on CPU
            model.zero_grad()
            loss, _ = drafter_loss(model, frozen, batch, attn_mask=mask, chunk_rows=256)
            loss.backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    result = {
        "flex_vs_dense_max_abs_diff_hidden": float((outs[0] - outs[1]).abs().max()),
        "hidden_max_abs": float(outs[0].abs().max()),
    }
    if grads:
        result["flex_vs_dense_max_abs_diff_grad"] = float((grads[0] - grads[1]).abs().max())
        result["grad_max_abs"] = float(grads[0].abs().max())
    return result


def bench_step(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    target = TINY if args.tiny else QWEN3_8B
    seq_len, anchors = (256, 32) if args.tiny else (args.seq_len, args.anchors)
    param_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    cfg, frozen, batch = _make(target, seq_len, anchors, args.block_size, device, torch.bfloat16)
    model = DFlashDrafter(cfg).to(device=device, dtype=param_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=device.type == "cuda")
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.precision == "amp"
        else contextlib.nullcontext()
    )

    def step(batch: PackedBatch = batch) -> float:
        mask = build_attention_mask(batch, args.attention)
        with autocast:
            loss, _ = drafter_loss(model, frozen, batch, attn_mask=mask, chunk_rows=args.chunk_rows)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(args.warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        _sync(device)
        start = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    flops = flops_per_step(cfg, batch.num_context_tokens, batch.num_blocks, visible_pairs(batch))
    mask = build_attention_mask(batch, args.attention)
    result = {
        "seconds_per_step": seconds,
        "seconds_min": min(times),
        "tflops": flops["total"] / seconds / 1e12,
        "tflop_per_step": flops["total"] / 1e12,
        "attention_share": flops["attention"] / flops["total"],
        "lm_head_share": flops["lm_head"] / flops["total"],
        "loss": loss,
        "sequence_tokens_per_s": batch.num_context_tokens / seconds,
        "block_tokens_per_s": batch.num_blocks * cfg.block_size / seconds,
        "params": model.num_parameters(),
        "blocks": batch.num_blocks,
        "context_tokens": batch.num_context_tokens,
        "mask_pair_density": visible_pairs(batch)
        / (
            batch.num_blocks * cfg.block_size * (batch.num_context_tokens + batch.num_blocks * cfg.block_size)
        ),
        "logits_if_materialized_gb": batch.num_blocks * (cfg.block_size - 1) * cfg.vocab_size * 4 / 1e9,
    }
    if hasattr(mask, "tile_density"):
        result["flex_tile_density"] = mask.tile_density()
    if device.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    # Training batches change shape every step: time a few new lengths to expose recompilation costs.
    gen = torch.Generator().manual_seed(7)
    varied = []
    for _ in range(args.vary_steps):
        length = int(torch.randint(seq_len // 2, seq_len + 1, (1,), generator=gen))
        _, _, other = _make(target, length, anchors, args.block_size, device, torch.bfloat16, seed=length)
        _sync(device)
        start = time.perf_counter()
        step(other)
        _sync(device)
        varied.append((time.perf_counter() - start) / other.num_context_tokens * batch.num_context_tokens)
    if varied:
        result["varied_shapes_seconds_per_step_scaled_max"] = max(varied)
        result["varied_shapes_seconds_per_step_scaled_median"] = statistics.median(varied)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--quick", action="store_true", help="fewer timed steps")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk-rows", type=int, default=2048)
    parser.add_argument("--precision", choices=("bf16", "amp"), default="amp")
    parser.add_argument("--attention", choices=("auto", "flex", "dense"), default="auto")
    parser.add_argument("--vary-steps", type=int, default=None, help="steps at other lengths (recompiles)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    args.steps = args.steps or (3 if args.quick or args.tiny else 10)
    args.vary_steps = args.vary_steps if args.vary_steps is not None else (2 if args.tiny else 6)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 agreement check: no TF32 rounding

    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tiny": args.tiny,
        "precision": args.precision,
    }
    results.update(check_flex_vs_dense(device))
    results.update(bench_step(args, device))
    width = max(len(k) for k in results)
    for key, value in results.items():
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
