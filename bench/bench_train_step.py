"""DFlash drafter training steps side by side: a plain eager reference, the step before issue 13, the new one.

    python bench/bench_train_step.py [--json out.json]                # on an H200: step, small, agree (~6-8 min)
    python bench/bench_train_step.py --sections first,vary,curve      # second run
    python bench/bench_train_step.py --tiny --device cpu              # CPU smoke run of the defaults (seconds)

Sections (each prints its rows as it finishes; a failing variant prints its error and the rest go on; a
section is skipped once --time-budget seconds have passed; --json is rewritten after every section):
    step   Qwen3-8B-shaped drafter (5 layers, hidden 4096, vocab 151936), 512 anchors x B=16 on one 3072-token
           sequence: per variant s/step, sequence tokens/s, achieved TFLOP/s (`model.flops_per_step`), peak
           memory, then a torch.profiler table of where each step's time goes (`profile_summary.py`).
           Variants are described in `step_variants.py`.
    agree  the same weights and batch through each variant once: loss and gradient differences against the
           reference (bf16 autocast: "before vs reference" is the noise floor the new step should match)
    vary   the new step on other sequence lengths (dynamic-shape recompilation and its steady state)
    small  a ~5M-parameter drafter (hidden 384, 3 layers, vocab 4096), packs of 8192 tokens as the loader
           builds them: steps/s before and after (overhead-bound: launches, host syncs, mask building);
           `--small-budgets 8192,16384 --small-lengths 256,384 --small-layers 5 --small-variants new` is the
           quality benchmark's full size (rows of 256-384 tokens, ~6k blocks a pack) at two pack sizes;
           `--small-variants split,new` compares `--split-own-slots`; `--flex-tiles 64x64` other BlockMask
           tiles (under 128 they need `--flex-compile-mode max-autotune-no-cudagraphs` on sm90: BENCHMARKS.md)
    first  time to the first step of the new step in a fresh process: cold (empty Inductor cache) and warm
    curve  200 steps of the tiny config (1 layer, B=4, 8 anchors, 256-token packs), before vs new, same
           seed: the loss curves and their largest difference
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dataclasses import fields

from dflash.train import block_mask
from dflash.train import mask as mask_module
from dflash.train.block_mask import DEFAULT_TILE
from dflash.train.compiled import CompiledOrEager
from dflash.train.loss import loss_epilogues
from dflash.train.mask import flex_failure, visible_pairs
from dflash.train.model import Regions, flops_per_step

from bench import profile_summary
from bench.shapes import QWEN3_8B, SMALL, TINY
from bench.step_variants import (
    Setup,
    build_model,
    loss_and_backward,
    make_setup,
    make_step,
    packed_lengths,
    sync,
    time_steps,
)
from bench.train_step_args import parse_args

_START = time.perf_counter()


def say(line: str = "") -> None:
    print(line, flush=True)


def save(args: argparse.Namespace, results: dict) -> None:
    """--json rewritten with everything measured so far (a call cut off by its time limit keeps it)."""
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _free() -> None:
    # Every variant and section compiles for itself (from Inductor's on-disk cache when it can): shapes of
    # earlier sections must not use up Dynamo's per-function recompile limit (8), past which it runs eagerly.
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def big_setup(args: argparse.Namespace, device: torch.device) -> Setup:
    target, seq_len, anchors = (TINY, 128, 16) if args.tiny else (QWEN3_8B, args.seq_len, args.anchors)
    return make_setup(
        target, lengths=[[seq_len]], anchors=anchors, block=args.block_size, layers=2 if args.tiny else 5,
        device=device, precision=args.precision,
    )  # fmt: skip


def section_step(args: argparse.Namespace, setup: Setup, results: dict) -> None:
    batch = setup.batches[0]
    flops = flops_per_step(setup.cfg, batch.num_context_tokens, batch.num_blocks, visible_pairs(batch))[
        "total"
    ]
    say(f"\n[step] {batch.num_context_tokens} context tokens, {batch.num_blocks} blocks of {setup.cfg.block_size}, "
        f"{flops / 1e12:.1f} TFLOP/step, precision {setup.precision}")  # fmt: skip
    say(f"{'variant':<10}{'s/step':>9}{'seq tok/s':>11}{'TFLOP/s':>9}{'peak GB':>9}{'first s':>9}"
        f"{'vs ref':>8}{'vs before':>10}")  # fmt: skip
    rows, profiles = results.setdefault("step", {}), {}
    for variant in args.variants:
        try:
            step, model = make_step(variant, setup, args.compile)
            row = time_steps(step, setup, args.warmup, args.steps)
            row["sequence_tokens_per_s"] = batch.num_context_tokens / row["seconds_per_step"]
            row["tflops"] = flops / row["seconds_per_step"] / 1e12
            rows[variant] = row

            def run(step=step) -> None:
                for _ in range(args.profile_steps):
                    step(batch)

            profiles[variant] = profile_summary.profile_steps(run, args.profile_steps, setup.device)
            results.setdefault("profile", {})[variant] = profiles[variant]
            ratio = {
                k: rows[k]["seconds_per_step"] / row["seconds_per_step"]
                for k in ("reference", "before")
                if k in rows
            }
            say(f"{variant:<10}{row['seconds_per_step']:9.4f}{row['sequence_tokens_per_s']:11,.0f}"
                f"{row['tflops']:9.1f}{row.get('peak_memory_gb', 0):9.1f}{row['first_step_s']:9.1f}"
                f"{ratio.get('reference', float('nan')):8.2f}{ratio.get('before', float('nan')):10.2f}")  # fmt: skip
            row["fallbacks"] = fallbacks(model)
            if row["fallbacks"]:
                say(f"  {variant} ran partly eager: {'; '.join(row['fallbacks'])}")
            del step, model
        except Exception as exc:  # one variant failing must not cost the others their numbers
            rows[variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            say(f"{variant:<10}FAILED {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            traceback.print_exc(limit=3)
        _free()
        save(args, results)  # per variant: the new step's number survives a cut-off call
    new = rows.get("new", {}).get("seconds_per_step")
    for other in ("reference", "before"):
        if new and rows.get(other, {}).get("seconds_per_step"):
            results.setdefault("speedup", {})[f"new_vs_{other}"] = rows[other]["seconds_per_step"] / new
            say(f"new vs {other}: {rows[other]['seconds_per_step'] / new:.2f}x")
    say("\nwhere a step's time goes (ms per step; % of the step's wall time)")
    say(profile_summary.header())
    for variant, summary in profiles.items():
        say(profile_summary.format_row(variant, summary))


def fallbacks(model: torch.nn.Module) -> list[str]:
    """What gave up on compiled code in this process (each falls back to eager, same math, slower)."""
    regions = getattr(model, "regions", None)
    found = [
        f"{r.name}: {r.failure}"
        for r in [
            *(getattr(regions, f.name, None) for f in fields(Regions)),
            *loss_epilogues(),
        ]
        if isinstance(r, CompiledOrEager) and r.failure
    ]
    return found + ([f"FlexAttention: {flex_failure()}"] if flex_failure() else [])


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    num = sum(float((a[n] - b[n]).double().square().sum()) for n in b)
    den = sum(float(b[n].double().square().sum()) for n in b)
    return (num / max(den, 1e-30)) ** 0.5


def section_agree(args: argparse.Namespace, setup: Setup, results: dict) -> None:
    """Every variant once on the same weights and batch; differences against the reference."""
    batch = setup.batches[0]
    say("\n[agree] same weights, same batch, one forward + backward each")
    weights = build_model("before", setup).state_dict()
    out: dict[str, Any] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for variant in args.variants:
        try:
            model = build_model(variant, setup, compile_mode=args.compile)
            model.load_state_dict(weights)
            loss = loss_and_backward(variant, model, setup, batch)
            sync(setup.device)
            grads[variant] = _grads(model)
            out[variant] = {"loss": float(loss)}
            del model
        except Exception as exc:
            out[variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            say(f"{variant:<10}FAILED {type(exc).__name__}")
        _free()
    base = "reference" if "reference" in grads else next(iter(grads), None)
    for variant, row in out.items():
        if variant in grads and base in grads:
            row["loss_diff_vs_" + base] = row["loss"] - out[base]["loss"]
            row["grad_rel_err_vs_" + base] = _relative_error(grads[variant], grads[base])
            say(f"{variant:<10} loss {row['loss']:.6f}  diff {row['loss_diff_vs_' + base]:+.2e}  "
                f"grad rel. L2 error vs {base} {row['grad_rel_err_vs_' + base]:.2e}")  # fmt: skip
    if "new" in grads and "before" in grads:
        out["new_vs_before_grad_rel_err"] = _relative_error(grads["new"], grads["before"])
        say(f"new vs before: grad rel. L2 error {out['new_vs_before_grad_rel_err']:.2e}")
    results["agree"] = out


def section_vary(args: argparse.Namespace, results: dict, device: torch.device) -> None:
    """The new step on packs of other lengths: the first of them recompiles (dynamic shapes), then steady."""
    target, base = (TINY, 128) if args.tiny else (QWEN3_8B, args.seq_len)
    gen = torch.Generator().manual_seed(7)
    lengths = [[int(torch.randint(base // 2, base + 1, (1,), generator=gen))] for _ in range(args.vary_steps)]
    setup = make_setup(
        target, lengths=lengths, anchors=16 if args.tiny else args.anchors, block=args.block_size,
        layers=2 if args.tiny else 5, device=device, precision=args.precision,
    )  # fmt: skip
    step, _ = make_step("new", setup, args.compile)
    step(big_setup(args, device).batches[0])  # the static shape first, as a run's first batch
    rows = []
    for batch in setup.batches:
        sync(device)
        start = time.perf_counter()
        step(batch)
        sync(device)
        seconds = time.perf_counter() - start
        rows.append({"context_tokens": batch.num_context_tokens, "seconds": seconds})
        say(f"[vary] {batch.num_context_tokens} tokens: {seconds:.3f} s "
            f"({batch.num_context_tokens / seconds:,.0f} seq tok/s)")  # fmt: skip
    results["vary"] = rows


def section_small(args: argparse.Namespace, results: dict, device: torch.device) -> None:
    low, high = (100, 250) if args.tiny else args.small_lengths
    for tile in args.flex_tiles:
        block_mask.DEFAULT_TILE = tile  # read when each step builds its BlockMask
        # fresh kernels per tile, in the asked mode; a shape that failed must not send the next one to SDPA
        mask_module.reset_flex(args.flex_compile_mode)
        for budget in (512,) if args.tiny else args.small_budgets:
            _small_budget(args, results, device, budget, low, high)
    block_mask.DEFAULT_TILE = DEFAULT_TILE
    mask_module.reset_flex()


def _small_budget(
    args: argparse.Namespace, results: dict, device: torch.device, budget: int, low: int, high: int
) -> None:
    anchors = 16 if args.tiny else 512
    setup = make_setup(
        TINY if args.tiny else SMALL, lengths=packed_lengths(budget, low, high, args.small_packs), anchors=anchors,
        block=args.block_size, layers=args.small_layers, device=device, precision=args.precision,
    )  # fmt: skip
    tokens = sum(b.num_context_tokens for b in setup.batches) / len(setup.batches)
    blocks = sum(b.num_blocks for b in setup.batches) / len(setup.batches)
    key = "small" if budget == 8192 and (low, high) == (1450, 3072) else f"small-{budget}-{low}-{high}"
    tile = block_mask.DEFAULT_TILE
    key += "" if tile == DEFAULT_TILE else f"-tile{tile[0]}x{tile[1]}"
    say(
        f"\n[{key}] {setup.cfg.hidden_size}-wide drafter, {args.small_layers} layers, {len(setup.batches)} packs "
        f"of ~{tokens:.0f} tokens in sequences of {low}-{high}, ~{blocks:.0f} blocks, FlexAttention tiles {tile}"
    )
    out, profiles = results.setdefault(key, {}), {}
    for variant in args.small_variants:
        try:
            step, _ = make_step(variant, setup, args.compile)
            row = time_steps(step, setup, warmup=1 if args.tiny else 2, steps=args.small_steps)
            row["steps_per_s"] = 1 / row["seconds_per_step"]
            row["sequence_tokens_per_s"] = tokens * row["steps_per_s"]
            out[variant] = row
            say(
                f"{variant:<10}{row['steps_per_s']:8.1f} steps/s {row['sequence_tokens_per_s']:12,.0f} seq tok/s"
            )

            def run(step=step) -> None:
                for i in range(args.profile_steps):
                    step(setup.batches[i % len(setup.batches)])

            profiles[variant] = row["profile"] = profile_summary.profile_steps(
                run, args.profile_steps, setup.device
            )
        except Exception as exc:
            out[variant] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            say(f"{variant:<10}FAILED {type(exc).__name__}: {exc}")
        _free()
    if "steps_per_s" in out.get("new", {}) and "steps_per_s" in out.get("before", {}):
        out["speedup"] = out["new"]["steps_per_s"] / out["before"]["steps_per_s"]
        say(f"small drafter speedup: {out['speedup']:.2f}x")
    say(profile_summary.header())
    for variant, summary in profiles.items():
        say(profile_summary.format_row(variant, summary))


def first_step_child(args: argparse.Namespace, device: torch.device) -> None:
    """Run in a fresh process: data built, then model + one new step (compiles included), synced; prints one
    JSON line. `first_step_s` is the training-start cost a run pays (data set-up is the bench's own)."""
    setup = big_setup(args, device)
    sync(device)
    start = time.perf_counter()
    step, _ = make_step("new", setup, args.compile)
    step(setup.batches[0])
    sync(device)
    print(json.dumps({"first_step_s": time.perf_counter() - start}), flush=True)


def section_first(args: argparse.Namespace, results: dict) -> None:
    cache = Path(tempfile.mkdtemp(prefix="dflash_inductor_"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TRITON_CACHE_DIR": str(cache / "triton")}
    command = [
        sys.executable,
        __file__,
        "--first-step-child",
        "--device",
        args.device,
        "--compile",
        args.compile,
    ]
    command += ["--tiny"] if args.tiny else []
    out = results.setdefault("first", {})
    for label in ("cold", "warm"):
        start = time.perf_counter()
        remaining = max(30.0, args.time_budget - (time.perf_counter() - _START))
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=remaining)
            line = [x for x in done.stdout.splitlines() if x.startswith("{")]
            row = json.loads(line[-1]) if line else {"error": done.stderr.strip().splitlines()[-1:]}
        except subprocess.TimeoutExpired:
            row = {"error": f"timed out after {remaining:.0f} s"}
        row["process_s"] = time.perf_counter() - start
        out[label] = row
        say(f"[first] {label}: first step {row.get('first_step_s', float('nan')):.1f} s after start-up "
            f"(process {row['process_s']:.1f} s, imports included) {row.get('error', '')}")  # fmt: skip


def section_curve(args: argparse.Namespace, results: dict, device: torch.device) -> None:
    lengths = packed_lengths(256, 32, 128, packs=args.curve_steps, seed=1)
    setup = make_setup(
        TINY, lengths=lengths, anchors=8, block=4, layers=1, device=device, precision=args.precision,
        learnable=True,
    )  # fmt: skip
    curves = {}
    for variant in ("before", "new"):
        step, _ = make_step(variant, setup, args.compile, lr=1e-3)  # the tiny preset's learning rate
        curves[variant] = [float(step(batch)) for batch in setup.batches]
    diff = max(abs(a - b) for a, b in zip(curves["before"], curves["new"], strict=True))
    results["curve"] = {**curves, "max_abs_diff": diff}
    marks = [0, len(lengths) // 4, len(lengths) // 2, len(lengths) - 1]
    say(f"\n[curve] {len(lengths)} steps, loss at steps {marks}: "
        + "; ".join(f"{v} " + ", ".join(f"{curves[v][i]:.4f}" for i in marks) for v in curves)
        + f"; largest |difference| {diff:.3g}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.splitlines()[0])
    device = torch.device(args.device)
    warnings.filterwarnings("ignore", message=".*flex_attention.*")
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny shapes: thread hand-offs cost more than the math on a shared box
    if args.first_step_child:
        first_step_child(args, device)
        return 0
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "tiny": args.tiny,
        "precision": args.precision,
    }
    say(f"device {results['device']}, torch {results['torch']}, sections {args.sections}")
    setup = big_setup(args, device) if {"step", "agree"} & set(args.sections) else None
    for name in args.sections:
        elapsed = time.perf_counter() - _START
        if elapsed > args.time_budget:
            say(f"\n[{name}] skipped: {elapsed:.0f} s used of the {args.time_budget:.0f} s budget")
            continue
        try:
            if name in ("step", "agree"):
                globals()[f"section_{name}"](args, setup, results)
            elif name == "first":
                section_first(args, results)
            else:
                globals()[f"section_{name}"](args, results, device)
        except Exception as exc:
            say(f"\n[{name}] FAILED {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=5)
            results.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:500]
        _free()
        save(args, results)
    say(f"\ntotal {time.perf_counter() - _START:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
