"""The q4 codec's GPU paths in tensor operations a batch, and its CPU quantizer in seconds.

    python bench/bench_q_ops.py                  # operations: extraction's quantize, training's decode
    python bench/bench_q_ops.py --cpu-seconds    # + CPU seconds of `quantize_batch` (dflash-shards convert)

On a GPU every tensor operation is a kernel launch, and each launch releases the GIL and may wait to retake it
beside the extractor's encode threads (or the training thread, for the loader's copy thread): for small
batches their count, not their bytes, is the cost. The operations are counted on the `meta` device, which
takes the code's GPU branches (step sizes, one call for all layers, the ratio search) without computing
anything; the host arrays a GPU would pin and copy are moved to `meta` instead (one operation each, where a
GPU makes two). Everything here calls `QCodec.quantize_batch` and `PackedBatch.dequantized` only, so the same
command measures older code for a before / after.

Shapes: the quality benchmark's full size (an extraction batch of 6 layers x 121,600 tokens x 384 in rows of
320; a training batch of 8,192 tokens x 5 layers x 384 from 26 sequences) and the 8B shape (5 layers x 16,384
tokens x 4096 in rows of 2,048; 8 sequences of 2,048 tokens).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import dflash.shards.qcodec as qcodec
from common.dispatch import dispatched_ops
from dflash.shards.codecs import get_codec
from dflash.train.blocks import PackedBatch

# (name, extraction batch [K, N, H], its row length, training batch [tokens, layers], its sequences)
SHAPES = (
    ("quality full size", (6, 121_600, 384), 320, (8192, 5), 26),
    ("8B shape", (5, 16_384, 4096), 2048, (16_384, 5), 8),
)
META = torch.device("meta")


def quantize_ops(shape: tuple[int, int, int], row: int) -> int:
    x = torch.empty(shape, dtype=torch.bfloat16, device=META)
    return dispatched_ops(lambda: get_codec("q4").quantize_batch(x, [row] * (shape[1] // row)))


def decode_ops(tokens: int, layers: int, hidden: int, sequences: int) -> int:
    """`PackedBatch.dequantized` of a q4-packed training batch (the fields it reads; the rest left None)."""
    groups = -(-hidden // qcodec.GROUP)
    batch = PackedBatch(**{f.name: None for f in fields(PackedBatch)} | dict(
        features=torch.empty((tokens, layers * hidden), dtype=torch.int8, device=META),
        feature_scales=torch.empty((tokens, layers), device=META),
        feature_group_scales=torch.empty((tokens, layers * groups), dtype=torch.uint8, device=META),
        feature_channel_scales=torch.empty((sequences, layers * hidden), dtype=torch.int8, device=META),
        context_seq=torch.empty(tokens, dtype=torch.long, device=META),
    ))  # fmt: skip
    return dispatched_ops(batch.dequantized)


def cpu_seconds(shape: tuple[int, int, int], row: int, rounds: int) -> list[float]:
    """CPU seconds of this thread per `quantize_batch` of LLM-like-scaled random states, each of `rounds`."""
    _, n, h = shape
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * torch.rand(h, generator=gen) * 3).bfloat16()
    lengths = [row] * (n // row) + ([n % row] if n % row else [])
    codec = get_codec("q4")
    out = []
    for _ in range(rounds):
        start = time.thread_time()
        codec.quantize_batch(x, lengths)
        out.append(time.thread_time() - start)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-seconds", action="store_true", help="also time the CPU quantizer")
    p.add_argument("--rounds", type=int, default=9, help="timed calls per CPU shape")
    args = p.parse_args(argv)
    # A GPU pins and copies its small host arrays; on `meta` they are moved there (older code: the same name).
    qcodec._to_device = lambda a, device: torch.from_numpy(np.ascontiguousarray(a)).to(device)
    print(
        f"{'batch':<20}{'quantize (extraction)':>24}{'decode (training)':>20}   operations a batch, GPU paths"
    )
    for name, shape, row, (tokens, layers), sequences in SHAPES:
        decode = decode_ops(tokens, layers, shape[2], sequences)
        print(f"{name:<20}{quantize_ops(shape, row):>24}{decode:>20}")
    if args.cpu_seconds:
        torch.set_num_threads(1)
        print(f"CPU seconds of one thread per quantize_batch, median (min) of {args.rounds}:")
        for shape, row in (((6, 12_160, 384), 320), ((5, 2048, 512), 600)):
            t = sorted(cpu_seconds(shape, row, args.rounds))
            print(f"  {list(shape)!s:<20}{1e3 * t[len(t) // 2]:>9.1f} ms ({1e3 * t[0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
