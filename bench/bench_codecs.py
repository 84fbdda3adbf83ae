"""Codec benchmark on LLM-like synthetic hidden states: ratio, encode/decode GB/s per core, 2-thread scaling.

    python bench/bench_codecs.py [--quick] [--json out.json]

GB/s count raw bf16 bytes (S*H*2) on both sides, per CPU-second of the calling thread (so a busy
machine does not distort them); the scaling columns are wall-clock ratios 1 thread / N threads. `fp8` encode starts from an Fp8Block (the extractor
quantizes on the GPU); `fp8+quant` adds CPU quantization for reference. Targets (issue 2): lossless
>= 1.38x, encode >= 0.5, decode >= 1.0 GB/s/core; fp8 >= 2.2x with relative error <= 3%.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common.synth import llm_like_layers, relative_error
from dflash.shards.codecs import Codec, LosslessCodec, get_codec, quantize_fp8


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


def bench(args: argparse.Namespace) -> list[dict]:
    layers = llm_like_layers(args.tokens, args.hidden, args.layers, seed=args.seed)
    raw = sum(x.numel() * 2 for x in layers)
    shape = (args.tokens, args.hidden)
    blocks = [quantize_fp8(x) for x in layers]
    fp8 = get_codec("fp8")

    def full(codec: Codec) -> Callable[[bytes], torch.Tensor]:
        return lambda b: codec.decode(b, shape, "bfloat16")

    def undecoded(b: bytes) -> torch.Tensor:
        return fp8.decode_block(b, shape)  # what the trainer does on CUDA (it dequantizes on the GPU)

    cases = [
        ("lossless", get_codec("lossless"), layers, None),
        ("lossless-nozraw", _AlwaysZstd(), layers, None),
        ("fp8", fp8, blocks, None),
        ("fp8+quant", fp8, layers, None),
        ("fp8-undecoded", fp8, blocks, undecoded),
    ]
    results = []
    for name, codec, inputs, decode in cases:
        decode = decode or full(codec)
        frames = [codec.encode(x) for x in inputs]
        enc_s = _best_time(lambda c=codec, i=inputs: [c.encode(x) for x in i], args.repeat)
        dec_s = _best_time(lambda d=decode, f=frames: [d(b) for b in f], args.repeat)
        decoded = [full(codec)(b) for b in frames]
        err = max(relative_error(d, x) for d, x in zip(decoded, layers, strict=True))
        row = {
            "codec": name,
            "ratio": raw / sum(len(f) for f in frames),
            "encode_gbs": raw / enc_s / 1e9,
            "decode_gbs": raw / dec_s / 1e9,
            "rel_error": err,
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per layer frame")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3, help="best of N timings")
    p.add_argument("--threads", type=int, default=2, help="thread count for the scaling column (1: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.layers, args.repeat = 256, 512, 3, 1
    torch.set_num_threads(1)  # per-core numbers: torch's own pool must not hide the codec's cost
    results = bench(args)
    mb = args.tokens * args.hidden * args.layers * 2 / 1e6
    print(f"LLM-like bf16 states: {args.layers} layers x [{args.tokens}, {args.hidden}] = {mb:.0f} MB raw")
    cols = [k for k in results[0] if k != "codec"]
    print(f"{'codec':<16}" + "".join(f"{c:>20}" for c in cols))
    for r in results:
        print(f"{r['codec']:<16}" + "".join(f"{r[c]:>20.4f}" for c in cols))
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
