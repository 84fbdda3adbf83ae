"""`dflash-train` end to end on one GPU: a cache written here, the loader alone, then real training.

    python bench/bench_train.py [--quick] [--json out.json]          # Qwen3-8B-shaped drafter on CUDA
    python bench/bench_train.py --small [--quick]                      # the small drafter: per-step overhead
    python bench/bench_train.py --tiny --device cpu                   # exercises every code path on a CPU

Per codec (lossless, fp8):
1. write a synthetic cache (`synthetic_cache.write_cache`: the shards writer, LLM-like features: log-normal channel scales, massive
   channels; windows of a per-layer pool so writing is fast), target config Qwen3-8B, random frozen
   embed/lm_head; fp8 quantized on the GPU as the extractor does;
2. the loader alone (decode -> blocks -> pin -> H2D on the side stream, no model) for several thread
   counts: the ceiling of the data path in sequence tokens/s;
3. `train()` for ~`--train-seconds` with the loader at `--train-threads`: tokens/s and data-wait fraction
   from metrics.jsonl (first windows skipped: compilation), time to the first optimizer step and the
   trainer's own breakdown of it (`startup` in the first record: process group, cache, frozen target
   read / to device / NaN check, drafter, logger, first batch, first step), peak GPU memory, achieved
   TFLOP/s (`model.flops_per_step` on the loader phase's batch statistics).
"Threads needed" = fewest loader threads whose ceiling is >= 1.5x what training consumed.
The cache sits in the page cache (it is smaller than RAM), so disk read speed is not what is measured.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train import trainer as trainer_mod
from dflash.train.config import paper_recipe
from dflash.train.data_spec import DataSpec
from dflash.train.drafter_config import DrafterConfig
from dflash.train.loader_procs import streaming_loader
from dflash.train.loop import train
from dflash.train.mask import visible_pairs
from dflash.train.metrics import read_metrics
from dflash.train.model import flops_per_step
from dflash.train.schedule import Schedule
from dflash.train.startup import describe

from bench.shapes import QWEN3_8B, SMALL, TINY
from bench.synthetic_cache import write_cache


class _StopBench(Exception):
    pass


def train_config(
    cache: str,
    out: str,
    target: dict[str, Any],
    *,
    shape: str,
    device: torch.device,
    budget: int,
    max_len: int,
    threads: int,
    compile: bool,
    **extra: Any,
) -> tuple[Any, DrafterConfig]:
    """The bench's training config (no eval, no checkpoints, epochs without end) and its drafter; `shape` is
    tiny, small or qwen3_8b; `extra` overrides any field (e.g. shard_cache_dir)."""
    overrides = dict(
        device=device.type,
        token_budget=budget,
        max_length=max_len,
        eval_every=0,
        save_every=0,
        log_every=1 if shape == "tiny" else 10,
        progress=False,
        tensorboard=False,
        plots=False,
        mask_token_id=target["vocab_size"] - 1,  # the synthetic target has no tokenizer
        loader_threads=threads,
        compile=compile,
        eval_fraction=0.0,
        epochs=1000,
    )
    if shape == "tiny":
        overrides.update(num_draft_layers=2, num_anchors=32)
    elif shape == "small":
        overrides.update(num_draft_layers=3)
    cfg = paper_recipe(cache, out, **{**overrides, **extra})
    drafter = DrafterConfig.from_target_config(
        target,
        mask_token_id=target["vocab_size"] - 1,
        num_hidden_layers=cfg.drafter.num_draft_layers,
        block_size=cfg.drafter.block_size,
        target_layer_ids=cfg.drafter.target_layer_ids,
    )
    return cfg, drafter


def loader_ceiling(
    cfg: Any, drafter: DrafterConfig, device: torch.device, threads: int, seconds: float
) -> dict:
    """Loader alone (no model): sequence tokens/s delivered on the device, plus batch statistics."""
    from dflash.shards import Cache

    spec = DataSpec.for_run(
        cfg,
        drafter,
        loader_threads=threads,
        prefetch_batches=max(cfg.data.prefetch_batches, 2 * threads),
        on_corrupt="fail",
        epochs=1000,
    )
    loader = streaming_loader(Cache.open(cfg.cache), spec, device=device)
    tokens = batches = 0
    stats = {"context": 0, "blocks": 0, "pairs": 0}
    t0 = time.perf_counter()
    first = None
    gen = loader.iterate()
    for loaded, _ in gen:
        batch = loaded.wait()
        if first is None:
            first = time.perf_counter() - t0
            t0 = time.perf_counter()  # the steady state excludes the pipeline fill
            continue
        tokens += loaded.tokens
        batches += 1
        stats["context"] += batch.num_context_tokens
        stats["blocks"] += int((batch.block_seq >= 0).sum())
        stats["pairs"] += visible_pairs(batch)
        if time.perf_counter() - t0 > seconds:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    gen.close()
    n = max(batches, 1)
    return {
        "threads": threads,
        "tokens_per_s": tokens / elapsed,
        "batches_per_s": batches / elapsed,
        "first_batch_s": first,
        "mean_context": stats["context"] / n,
        "mean_blocks": stats["blocks"] / n,
        "mean_visible_keys": stats["pairs"] / max(stats["blocks"] * drafter.block_size, 1),
    }


def train_phase(cfg: Any, seconds: float) -> dict[str, Any]:
    """`train()` until `seconds` after its first step; checkpoint writes are skipped (they are not the loop)."""
    marks: dict[str, float] = {}
    real_lr, real_save = Schedule.lr, trainer_mod.ckpt.save_checkpoint
    device = torch.device(
        cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )

    def lr(schedule: Schedule, step: int, optim: Any) -> float:
        # Called in each step after its forward and backward: the second call follows the whole first step
        # (compilation included) and step 2's forward and backward (a recompile for new shapes included),
        # so the timed window starts after them, however long compiling took.
        marks["calls"] = marks.get("calls", 0) + 1
        if marks["calls"] == 2:
            if device.type == "cuda":
                torch.cuda.synchronize()
            marks["second_step"] = time.perf_counter() - marks["start"]
        elif "second_step" in marks and time.perf_counter() - marks["start"] - marks["second_step"] > seconds:
            raise _StopBench
        return real_lr(schedule, step, optim)

    Schedule.lr = lr  # type: ignore[method-assign]
    trainer_mod.ckpt.save_checkpoint = lambda final, *a, **k: Path(final)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    marks["start"] = time.perf_counter()
    try:
        train(cfg)
    except _StopBench:
        pass
    finally:
        Schedule.lr, trainer_mod.ckpt.save_checkpoint = real_lr, real_save  # type: ignore[method-assign]
    logged = read_metrics(cfg.out)
    records = [r for r in logged if "tokens_per_s" in r]
    # The first window runs from the loop's start: step 1's compile and step 2's recompile are in it, so it
    # never counts (with --quick's three windows, it once made a third of the mean: 12.9k for ~16.9k).
    steady = records[max(1, len(records) // 4) :] or records
    startup = next((r["startup"] for r in logged if "startup" in r), None)
    return {
        # the trainer's own clock, from `train()` to the end of step 1 (the "time to first step")
        "time_to_first_step_s": startup["total_s"] if startup else None,
        # to step 2's backward: what this key meant before the breakdown existed (BENCHMARKS.md up to
        # 2026-12-01), and where a run that recompiles for new shapes would pay for it
        "time_to_second_step_s": marks.get("second_step"),
        "startup": startup,
        "steps": records[-1]["step"] if records else 0,
        "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in steady])) if steady else 0.0,
        "data_wait_frac": float(np.mean([r["data_wait_frac"] for r in steady])) if steady else 1.0,
        "final_loss": records[-1]["loss"] if records else None,
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny target and cache (CPU smoke run)")
    p.add_argument("--quick", action="store_true", help="shorter phases and a smaller cache")
    p.add_argument(
        "--small",
        action="store_true",
        help="the small drafter (hidden 384, 3 layers, vocab 4096) on short rows: per-step overhead, not FLOPs",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--draft-layers", type=int, help="drafter layers (default: the shape's; 5, 3 for --small)")
    p.add_argument(
        "--feature-layers",
        help="target layers cached and read, e.g. 0,1,2,3,4,5,6,7 as the quality benchmark (default: DFlash's rule)",
    )
    p.add_argument("--codecs", default="lossless,fp8")
    p.add_argument("--samples", type=int, default=None)
    p.add_argument("--threads-sweep", default="1,2,4,8")
    p.add_argument("--train-threads", type=int, default=8)
    p.add_argument(
        "--loader-workers",
        type=int,
        help="loader processes, loader alone and training (0: threads; default: dflash-train's, 4 on CUDA)",
    )
    p.add_argument("--train-seconds", type=float, default=None)
    p.add_argument("--loader-seconds", type=float, default=None)
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TrainConfig.compile (the drafter's compiled regions on CUDA); run twice for a warm Inductor cache",
    )
    p.add_argument("--workdir", default=None, help="where caches and runs go (default: a temp dir, removed)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    shape = "tiny" if args.tiny else "small" if args.small else "qwen3_8b"
    target = TINY if args.tiny else (SMALL if args.small else QWEN3_8B)
    samples = args.samples or (48 if args.tiny else 2000 if args.small else (160 if args.quick else 320))
    # --small: rows like bench_quality's greedy continuations (~25 to a pack, every eligible anchor trained)
    min_len, max_len = (100, 200) if args.tiny else (200, 450) if args.small else (1450, 3072)
    train_s = args.train_seconds or (3.0 if args.tiny else (30.0 if args.quick else 60.0))
    loader_s = args.loader_seconds or (1.0 if args.tiny else (5.0 if args.quick else 10.0))
    budget = args.token_budget or (512 if args.tiny else 8192)
    threads_sweep = [int(t) for t in args.threads_sweep.split(",")]
    recipe: dict[str, Any] = {"loader_workers": args.loader_workers}
    if args.draft_layers:
        recipe["num_draft_layers"] = args.draft_layers
    if args.feature_layers:
        recipe["target_layer_ids"] = args.feature_layers
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_train_"))
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "target": "tiny" if args.tiny else "small" if args.small else "Qwen3-8B",
        "codecs": {},
    }
    try:
        for codec in args.codecs.split(","):
            cache = work / f"cache_{codec}"
            shutil.rmtree(cache, ignore_errors=True)
            written = write_cache(
                cache,
                target,
                codec_name=codec,
                samples=samples,
                min_len=min_len,
                max_len=max_len,
                per_shard=32,
                device=device,
                threads=16,
                layers=[int(x) for x in args.feature_layers.split(",")] if args.feature_layers else None,
            )
            cfg, drafter = train_config(
                str(cache), str(work / f"run_{codec}"), target, shape=shape, device=device, budget=budget,
                max_len=max_len, threads=args.train_threads, compile=args.compile, **recipe,
            )  # fmt: skip
            ceilings = [loader_ceiling(cfg, drafter, device, t, loader_s) for t in threads_sweep]
            shutil.rmtree(cfg.out, ignore_errors=True)
            trained = train_phase(cfg, train_s)
            stats = max(ceilings, key=lambda c: c["threads"])
            flops = flops_per_step(
                drafter, round(stats["mean_context"]), round(stats["mean_blocks"]), stats["mean_visible_keys"]
            )["total"]
            steps_per_s = trained["tokens_per_s"] / max(stats["mean_context"], 1)
            consumed = trained["tokens_per_s"]
            enough = [c["threads"] for c in ceilings if c["tokens_per_s"] >= 1.5 * consumed]
            results["codecs"][codec] = {
                "cache": written,
                "loader": ceilings,
                "train": trained,
                "achieved_tflops": flops * steps_per_s / 1e12,
                "loader_threads_needed": min(enough) if enough else None,
                "loader_ceiling_multiple": max(c["tokens_per_s"] for c in ceilings) / max(consumed, 1e-9),
            }
            if not args.workdir:
                shutil.rmtree(cache, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    _print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _print_table(results: dict[str, Any]) -> None:
    print(f"device: {results['device']}, target: {results['target']}")
    for codec, r in results["codecs"].items():
        c, t = r["cache"], r["train"]
        print(
            f"\n[{codec}] cache {c['samples']} samples / {c['tokens']} tokens, {c['stored_gb']:.2f} GB stored "
            f"(ratio {c['ratio']:.2f}x), written at {c['write_raw_gbps']:.2f} GB/s raw"
        )
        print(
            "  loader alone: "
            + ", ".join(f"{x['threads']}t {x['tokens_per_s']:,.0f} tok/s" for x in r["loader"])
        )
        print(
            f"  train: {t['tokens_per_s']:,.0f} tok/s, data wait {100 * t['data_wait_frac']:.2f}%, "
            f"{r['achieved_tflops']:.1f} TFLOP/s, first step {t['time_to_first_step_s'] or 0:.1f} s "
            f"(second {t['time_to_second_step_s'] or 0:.1f} s), "
            f"peak {t['peak_gpu_gb'] or 0:.1f} GiB, {t['steps']} steps, loss {t['final_loss']}"
        )
        if t.get("startup"):
            print(f"  {describe(t['startup'])}")
        print(
            f"  loader ceiling {r['loader_ceiling_multiple']:.1f}x consumption; threads needed "
            f"(>= 1.5x): {r['loader_threads_needed']}"
        )


if __name__ == "__main__":
    main()
