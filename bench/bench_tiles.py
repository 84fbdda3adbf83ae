"""What FlexAttention's tiles cost a loader thread: `TileLayout.of` on one CPU core for a full-size pack.

    python bench/bench_tiles.py [--repeat 20]

A GPU run's loader builds each batch's tiles on its build threads (`train/block_mask.py`), beside packing; this
times both on the quality benchmark's full-size pack shape (rows of 64-192 prompt tokens and 192 answer tokens
in an 8,192-token budget, every answer position an anchor, B = 16, 128-token tiles), one torch thread as the
loader's threads run.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train.block_mask import TileLayout
from dflash.train.blocks import PackedBatch, SequenceInput, make_packed_batch


def full_size_pack(
    seed: int = 0, budget: int = 8192, answer: int = 192
) -> tuple[list[SequenceInput], PackedBatch]:
    gen = torch.Generator().manual_seed(seed)
    seqs, total = [], 0
    while True:
        prompt = int(torch.randint(64, 193, (1,), generator=gen))
        length = prompt + answer
        if total + length > budget:
            break
        total += length
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt:] = True
        seqs.append(
            SequenceInput(torch.randint(0, 4000, (length,), generator=gen), mask, torch.zeros(length, 8))
        )
    return seqs, make_packed_batch(seqs, block_size=16, mask_token_id=4095, num_anchors=512, generator=gen)


def ms_per_call(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return 1e3 * (time.perf_counter() - start) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(1)
    seqs, batch = full_size_pack()
    layout = TileLayout.of(batch)
    print(f"pack: {len(seqs)} rows, T {batch.num_context_tokens}, N {batch.num_blocks} blocks; "
          f"tiles {layout.kv[1].shape[-2]} x {layout.kv[1].shape[-1]}, "
          f"{sum(t.numel() * t.element_size() for t in layout.tensors()) / 2**20:.1f} MiB to copy")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    pack = ms_per_call(
        lambda: make_packed_batch(seqs, block_size=16, mask_token_id=4095, num_anchors=512, generator=gen),
        args.repeat,
    )
    counts = ms_per_call(lambda: layout.intervals.tile_counts(128, 128), args.repeat)
    tiles = ms_per_call(lambda: TileLayout.of(batch), args.repeat)
    print(
        f"make_packed_batch {pack:.1f} ms | TileLayout.of {tiles:.1f} ms (tile_counts {counts:.1f} ms) per batch"
    )


if __name__ == "__main__":
    main()
