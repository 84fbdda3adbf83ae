"""Codec benchmark on LLM-like synthetic hidden states: ratio, error, encode/decode GB/s per core, scaling,
and the training-side decode on a device.

    python bench/bench_codecs.py [--quick] [--json out.json]
    python bench/bench_codecs.py --device cuda [--device-only]   # + the GPU decode of packed fp8/q6/q4 batches
                                                                 # and the extractor's GPU quantization

GB/s count raw bf16 bytes (S*H*2) on both sides, per CPU-second of the calling thread (so a busy
machine does not distort them); the scaling columns are wall-clock ratios 1 thread / N threads. `fp8` and
`q6`/`q4` encode start from blocks quantized beforehand (the extractor quantizes on the GPU); `+quant`
rows add the CPU quantization (what `dflash-shards convert` pays on a CPU). `-undecoded` rows decode
what the training loader's CPU threads do for these codecs (zstd only; the GPU decodes the rest).
`rel_error`: ||decoded - x|| / ||x||; `typical_error`: the same over all but the 1% largest channels
(massive channels would hide the error of every other one).

The device section packs 8 sequences x 2048 tokens x 5 layers x 4096 (a training batch of the 8B shape)
as the loader does and times `PackedBatch.dequantized()` on --device (plain torch ops: the GPU decode in
the loader's copy thread), against the training consumption rate (~0.65 GB/s of bf16 per GPU,
DESIGN.md; target >= 3x).

The quantize section times the extractor's side on --device: `codec.quantize_batch(packed, lengths)` on
one forward batch ([5, 16384, 4096] bf16, rows of ~600 tokens), ms per batch and GB/s of bf16 in; for fp8
also the code before issue 14 (`fp8:before`) beside the current one, and whether their q and scale bytes
are equal; `ops`, the tensor operations one batch dispatches (about its kernel launches on a GPU: each hands
the GIL to the extractor's other threads, so on a small target their count, not their bytes, sets the cost).

Targets (issues 2, 14): lossless >= 1.38x, encode >= 0.5, decode >= 1.0 GB/s/core; fp8 >= 2.2x with
relative error <= 3%; q4 <= 10 KB/token for 5 x 4096 (ratio >= 4.1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common.dispatch import dispatched_ops
from common.fp8_reference import reference_quantize_fp8
from common.synth import llm_like_layers, relative_error
from dflash.shards.codecs import Codec, LosslessCodec, get_codec, quantize_fp8
from dflash.shards.qcodec import QBlock, quantize_q
from dflash.train.blocks import make_packed_batch

TRAINING_GBS = 0.65  # decoded bf16 one H200 consumes while training the 8B-shaped drafter (DESIGN.md)


class _AlwaysZstd(LosslessCodec):
    """Ablation: no 64 KiB probe, every plane goes through zstd (still stored raw if it grew)."""

    probe = False


def _best_time(fn: Callable[[], object], repeat: int) -> float:
    """Best CPU seconds of this thread over `repeat` runs: per-core speed even on a busy machine
    (zstd, numpy and torch with one intra-op thread all run on the calling thread)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def _threaded(fn: Callable[[int], object], n_items: int, threads: int) -> float:
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fn, range(n_items)))  # warm the per-thread compressors
        t0 = time.perf_counter()
        list(pool.map(fn, range(n_items)))
        return time.perf_counter() - t0


def _typical_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    rms = exact.float().pow(2).mean(0)
    keep = rms <= rms.quantile(0.99)
    return relative_error(approx[:, keep], exact[:, keep])


def _q_blocks(layers: list[torch.Tensor], levels: int) -> list[QBlock]:
    out = []
    for x in layers:
        codes, groups, scales, channel = quantize_q(x, levels)
        out.append(QBlock(codes, groups, scales, channel[0]))
    return out


def bench(args: argparse.Namespace) -> list[dict]:
    layers = llm_like_layers(args.tokens, args.hidden, args.layers, seed=args.seed)
    raw = sum(x.numel() * 2 for x in layers)
    shape = (args.tokens, args.hidden)
    fp8, q6, q4 = (get_codec(n) for n in ("fp8", "q6", "q4"))

    def full(codec: Codec) -> Callable[[bytes], torch.Tensor]:
        return lambda b: codec.decode(b, shape, "bfloat16")

    def undecoded(codec: Codec) -> Callable[[bytes], object]:
        return lambda b: codec.decode_block(b, shape)  # the loader's CPU share on CUDA

    cases = [
        ("lossless", get_codec("lossless"), layers, None),
        ("lossless-nozraw", _AlwaysZstd(), layers, None),
        ("fp8", fp8, [quantize_fp8(x) for x in layers], None),
        ("fp8+quant", fp8, layers, None),
        ("fp8-undecoded", fp8, [quantize_fp8(x) for x in layers], undecoded(fp8)),
    ]
    for codec in (q6, q4):
        blocks = _q_blocks(layers, codec.levels)
        cases += [
            (codec.name, codec, blocks, None),
            (f"{codec.name}+quant", codec, layers, None),
            (f"{codec.name}-undecoded", codec, blocks, undecoded(codec)),
        ]
    results = []
    for name, codec, inputs, decode in cases:
        decode = decode or full(codec)
        frames = [codec.encode(x) for x in inputs]
        enc_s = _best_time(lambda c=codec, i=inputs: [c.encode(x) for x in i], args.repeat)
        dec_s = _best_time(lambda d=decode, f=frames: [d(b) for b in f], args.repeat)
        decoded = [full(codec)(b) for b in frames]
        stored = sum(len(f) for f in frames)
        row = {
            "codec": name,
            "ratio": raw / stored,
            "kb_per_token_5x4096": stored / (args.tokens * args.layers) * 5 * 4096 / args.hidden / 1e3,
            "encode_gbs": raw / enc_s / 1e9,
            "decode_gbs": raw / dec_s / 1e9,
            "rel_error": max(relative_error(d, x) for d, x in zip(decoded, layers, strict=True)),
            "typical_error": max(_typical_error(d, x) for d, x in zip(decoded, layers, strict=True)),
        }
        if args.threads > 1:
            work = inputs * args.threads
            wframes = frames * args.threads
            enc1 = _threaded(lambda i, c=codec, w=work: c.encode(w[i]), len(work), 1)
            encn = _threaded(lambda i, c=codec, w=work: c.encode(w[i]), len(work), args.threads)
            dec1 = _threaded(lambda i, d=decode, w=wframes: d(w[i]), len(work), 1)
            decn = _threaded(lambda i, d=decode, w=wframes: d(w[i]), len(work), args.threads)
            row[f"encode_scaling_{args.threads}t"] = enc1 / encn
            row[f"decode_scaling_{args.threads}t"] = dec1 / decn
        results.append(row)
    return results


def device_decode(args: argparse.Namespace) -> list[dict]:
    """`PackedBatch.dequantized()` on args.device for a packed training batch of each quantized codec."""
    device = torch.device(args.device)
    seqs, tokens, hidden, k = (2, 256, 512, 5) if args.quick else (8, 2048, 4096, 5)
    layer_ids = list(range(k))
    results = []
    for name in ("fp8", "q6", "q4"):
        codec = get_codec(name)
        samples = []
        for i in range(seqs):
            xs = llm_like_layers(tokens, hidden, k, seed=100 + i)
            hidden_blocks = {
                j: codec.decode_block(codec.encode(x), (tokens, hidden)) for j, x in enumerate(xs)
            }
            samples.append(
                SimpleNamespace(
                    input_ids=torch.zeros(tokens, dtype=torch.long),
                    loss_mask=torch.ones(tokens, dtype=torch.bool),
                    hidden=hidden_blocks,
                )
            )
        batch = make_packed_batch(samples, block_size=16, mask_token_id=0, num_anchors=8, layer_ids=layer_ids)
        batch = batch.to(device)
        batch.dequantized()  # warm-up (kernels, the device's ratio table)
        best = float("inf")
        for _ in range(args.repeat + 2):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            batch.dequantized()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        out_bytes = seqs * tokens * hidden * k * 2
        gbs = out_bytes / best / 1e9
        results.append(
            {"codec": name, "device": str(device), "decode_gbs": gbs, "x_training": gbs / TRAINING_GBS}
        )
    return results


def _time_on(device: torch.device, fn: Callable[[], object], repeat: int) -> float:
    """Best seconds of `fn` on `device` (CUDA events there, so only the device's time counts)."""
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def device_quantize(args: argparse.Namespace) -> list[dict]:
    """The extractor's GPU stage after the forward: `quantize_batch` of one packed batch on args.device."""
    device = torch.device(args.device)
    k, tokens, hidden = (5, 2048, 512) if args.quick else (5, 16384, 4096)
    # 4096 distinct tokens per layer, tiled: quantization is per token, and generating all 16384 on a CPU
    # would take longer than the whole GPU section
    base = min(tokens, 4096)
    layers = llm_like_layers(base, hidden, k, seed=args.seed)
    packed = torch.stack([x.repeat(tokens // base, 1) for x in layers]).to(device)
    lengths = [600] * (tokens // 600) + ([tokens % 600] if tokens % 600 else [])
    rows = packed.reshape(-1, hidden)
    gb = packed.numel() * 2 / 1e9
    repeat = args.repeat + 2
    before_q, before_scale = reference_quantize_fp8(rows)

    def row(name: str, fn: Callable[[], tuple[torch.Tensor, ...]], check: bool) -> dict:
        out = {"codec": name, "device": str(device), "shape": list(packed.shape)}
        t0 = time.perf_counter()
        try:
            parts = fn()  # warm-up
        except Exception as exc:  # a failure is a line of this table, not a crash
            return {**out, "error": f"{type(exc).__name__}: {exc}"[:200]}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out["first_s"] = time.perf_counter() - t0
        if check:
            q, scale = parts[0].reshape(before_q.shape), parts[1].reshape(before_scale.shape)
            out["differing_bytes"] = int((q != before_q).sum()) + 4 * int(
                (scale.view(torch.int32) != before_scale.view(torch.int32)).sum()
            )
            out["identical"] = out["differing_bytes"] == 0
        del parts
        sec = _time_on(device, fn, repeat)
        return {**out, "ms": sec * 1e3, "gbs": gb / sec, "ops": dispatched_ops(fn)}

    def batch(name: str) -> Callable[[], tuple[torch.Tensor, ...]]:
        codec = get_codec(name)
        return lambda: codec.quantize_batch(packed, lengths)

    results = [
        row("fp8", batch("fp8"), True),  # what the extractor runs
        row("fp8:before", lambda: reference_quantize_fp8(rows), True),
    ]
    return results + [row(name, batch(name), False) for name in ("q6", "q4")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per layer frame")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3, help="best of N timings")
    p.add_argument("--threads", type=int, default=2, help="thread count for the scaling column (1: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where to time the training-side decode and the extractor's quantize (e.g. cuda)",
    )
    p.add_argument(
        "--device-only",
        action="store_true",
        help="only the device sections: training-side decode, extractor-side quantize (skip the CPU table)",
    )
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.layers, args.repeat = 256, 512, 3, 1
    torch.set_num_threads(1)  # per-core numbers: torch's own pool must not hide the codec's cost
    results = [] if args.device_only else bench(args)
    if results:
        mb = args.tokens * args.hidden * args.layers * 2 / 1e6
        print(
            f"LLM-like bf16 states: {args.layers} layers x [{args.tokens}, {args.hidden}] = {mb:.0f} MB raw"
        )
        cols = [k for k in results[0] if k != "codec"]
        print(f"{'codec':<16}" + "".join(f"{c:>20}" for c in cols))
        for r in results:
            print(f"{r['codec']:<16}" + "".join(f"{r[c]:>20.4f}" for c in cols))
    on_device = device_decode(args)
    print(f"training-side decode (PackedBatch.dequantized) on {args.device}, GB/s of bf16 out:")
    for r in on_device:
        print(
            f"  {r['codec']:<6}{r['decode_gbs']:>10.2f} GB/s = {r['x_training']:.1f}x one GPU's training rate"
        )
    t0 = time.perf_counter()
    quantize = device_quantize(args)
    print(
        f"extractor-side quantize_batch on {args.device} of one {quantize[0]['shape']} bf16 batch"
        f" (section: {time.perf_counter() - t0:.0f} s):"
    )
    print(f"  {'codec':<14}{'ms/batch':>10}{'GB/s in':>10}{'first s':>9}{'ops':>6}  bytes = fp8:before")
    for r in quantize:
        if "error" in r:
            print(f"  {r['codec']:<14}  failed: {r['error']}")
            continue
        same = {True: "yes", False: f"NO: {r.get('differing_bytes')} bytes differ"}.get(
            r.get("identical"), ""
        )
        print(f"  {r['codec']:<14}{r['ms']:>10.2f}{r['gbs']:>10.1f}{r['first_s']:>9.2f}{r['ops']:>6}  {same}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "results": results,
                    "device": on_device,
                    "quantize": quantize,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
