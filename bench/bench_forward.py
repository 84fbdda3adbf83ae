"""The bare truncated forward alone, and what moves it: padding mask, batch size, kernels, torch.compile.

    python bench/bench_forward.py [--arch qwen3_8b|qwen35_27b] [--rows N] [--variants a,b,...] [--json out.json]
    python bench/bench_forward.py --tiny --device cpu --variants masked,unmasked      # CPU smoke test

Same random-weight truncated targets and row lengths as bench/bench_extract.py. Each variant plans the
rows at its token budget, stages every batch on the device first (int64 ids, int64 0/1 mask when used),
runs one untimed pass (kernels, allocator, compilation) and then one timed pass: wall clock over the
whole pass, with the GPU's busy time from CUDA events around each forward, so "busy" near 100% means the
host never starved the GPU. Tokens counted are real tokens (padding excluded). TFLOP/s counts
2 x (decoder-layer weights) per token, i.e. the weight matmuls; attention scores and the convolution
are left out, so it is a lower bound on the work done.

Variants (applied in the order given; compile stays on once applied):
    masked     right-padded rows with an attention mask (what HF users do)
    unmasked   no mask: with right padding and causal layers a real token never sees a pad token, so its
               outputs are the same; SDPA may then take its flash kernel with is_causal
    budget32k  unmasked at a 32768-token budget (fewer, larger batches)
    budget64k  unmasked at a 65536-token budget
    fla_conv   unmasked, hybrid short convolutions on flash-linear-attention's Triton kernel
    compile    + torch.compile(dynamic=True) of each layer's attention, MLP and norms
(fla_conv and compile call `CapturingTarget.speed_up`, exactly what dflash-extract does on CUDA.)
Every variant's captured states on the first batch are compared with those of the first variant at the
same token budget: ||a - b|| / ||b|| over real tokens, per captured layer (bf16 rounding differences
grow with depth in a random-weight network, so the first captured layer is the telling one).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.extract.target import CapturingTarget

from bench.extract_common import ARCHS, MAX_LEN_CLIP, build_target, stage_batches, timed_pass, write_rows

VARIANTS = {
    "masked": dict(mask=True, budget=16384),
    "unmasked": dict(mask=False, budget=16384),
    "budget32k": dict(mask=False, budget=32768),
    "budget64k": dict(mask=False, budget=65536),
    "fla_conv": dict(mask=False, budget=16384, fla_conv=True),
    "compile": dict(mask=False, budget=16384, compile=True),
}
DEFAULT_VARIANTS = {
    "qwen3_8b": "masked,unmasked,budget32k,compile",
    "qwen35_27b": "masked,unmasked,fla_conv,compile",
    "tiny": "masked,unmasked",
}


def first_batch_states(target: CapturingTarget, staged: list) -> list[torch.Tensor]:
    """The captured layers of the first batch's real tokens, fp32 on the host (for the comparison)."""
    ids, am, lengths = staged[0]
    outs = target.capture(ids, am)
    keep = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
    return [o.float().cpu()[keep] for o in outs]


def layer_weight_flops_per_token(target: CapturingTarget) -> float:
    return 2.0 * sum(p.numel() for layer in target.decoder.layers for p in layer.parameters())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["qwen3_8b", "qwen35_27b"], default="qwen3_8b")
    p.add_argument("--rows", type=int, default=None, help="rows (default: 8B 200, 27B 120, tiny 40)")
    p.add_argument("--variants", default=None, help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--max-len", type=int, default=3072)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shape (CPU smoke test of this script)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    arch = "tiny" if args.tiny else args.arch
    spec = ARCHS[arch]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = args.rows or {"qwen3_8b": 200, "qwen35_27b": 120, "tiny": 40}[arch]
    names = (args.variants or DEFAULT_VARIANTS[arch]).split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    workdir = Path(tempfile.mkdtemp(prefix="dflash-bench-forward-"))
    _, target = build_target(arch, workdir, device, dtype)
    vocab = spec["shape"]["vocab_size"]
    dataset = write_rows(workdir / "rows.arrow", rows, vocab, max_clip=MAX_LEN_CLIP if not args.tiny else 200)
    flops_per_token = layer_weight_flops_per_token(target)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"[setup] {arch}: {rows} rows, {len(target.decoder.layers)} layers, {gpu}", flush=True)

    references: dict[int, list[torch.Tensor]] = {}
    results = []
    for name in names:
        v = VARIANTS[name]
        if v.get("fla_conv") or v.get("compile"):
            applied = target.speed_up(compile=bool(v.get("compile")))  # what dflash-extract does on CUDA
            if not applied:
                print(f"[{name}] skipped: nothing to apply on this device/model", flush=True)
                continue
        staged = stage_batches(target, dataset, vocab, args.max_len, v["budget"], v["mask"])
        tokens = int(sum(int(lengths.sum()) for _, _, lengths in staged))
        padded = int(sum(ids.numel() for ids, _, _ in staged))
        t = time.perf_counter()
        timed_pass(target, staged)  # warm-up: kernels, allocator, compilation
        warm_s = time.perf_counter() - t
        timing = timed_pass(target, staged)
        states = first_batch_states(target, staged)
        reference = references.setdefault(v["budget"], states)  # same first batch only at the same budget
        rel = [float((s - r).norm() / r.norm()) for s, r in zip(states, reference, strict=True)]
        tok_s = tokens / timing["seconds"]
        row = {
            "variant": name,
            **v,
            "batches": len(staged),
            "tokens": tokens,
            "padding_frac": 1 - tokens / padded,
            "warmup_seconds": warm_s,
            **timing,
            "tokens_per_s": tok_s,
            "gpu_busy_frac": timing["gpu_busy_seconds"] / timing["seconds"],
            "weight_tflops": tok_s * flops_per_token / 1e12,
            "rel_diff_per_layer": rel,
        }
        results.append(row)
        print(
            f"[{name}] {tok_s:,.0f} tok/s, busy {row['gpu_busy_frac']:.1%}, "
            f"{row['weight_tflops']:.0f} TFLOP/s, rel. diff per layer {' '.join(f'{x:.1e}' for x in rel)} "
            f"(warm-up {warm_s:.0f} s)",
            flush=True,
        )
        del staged

    print(f"\n{arch}: {rows} rows, layers {spec['layers']}, {gpu}, {flops_per_token / 1e9:.1f} GFLOP/token")
    print(
        f"{'variant':<11}{'batches':>8}{'tok/s':>10}{'GPU busy':>10}{'TFLOP/s':>9}{'pad':>7}{'last-layer diff':>16}"
    )
    for r in results:
        print(
            f"{r['variant']:<11}{r['batches']:>8}{r['tokens_per_s']:>10,.0f}{r['gpu_busy_frac']:>10.1%}"
            f"{r['weight_tflops']:>9.0f}{r['padding_frac']:>7.1%}{r['rel_diff_per_layer'][-1]:>16.1e}"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"arch": arch, "rows": rows, "gpu": gpu, "variants": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
