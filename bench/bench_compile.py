"""Compile cost of the drafter's step over packs of different shapes: with the token axes marked dynamic
before the first call (what training does, `compiled.mark_token_axes`) or left to Dynamo's automatic dynamic
(a static compile at step 1, everything again at step 2).

    python bench/bench_compile.py [--backend inductor] [--device cpu] [--no-marks]

Prints, per step, seconds since the first call and Dynamo's graph count. Run it with a fresh
TORCHINDUCTOR_CACHE_DIR for the cold figures, then again with the same one for the warm figures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dflash.train.compiled as compiled
from dflash.train.blocks import SequenceInput, make_packed_batch
from dflash.train.drafter_config import DrafterConfig
from dflash.train.frozen import FrozenTarget
from dflash.train.loss import drafter_loss
from dflash.train.mask import build_attention_mask
from dflash.train.model import DFlashDrafter

from tests.common.tiny_shapes import tiny_target

PACKS = [((30, 12), 5), ((41, 17, 9), 6), ((25, 33), 7), ((50,), 8)]  # other block and context counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-marks", action="store_true", help="leave the token axes to automatic dynamic")
    args = p.parse_args()
    if args.no_marks:
        compiled.mark_token_axes = lambda _args: None
    target, device = tiny_target(), torch.device(args.device)
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target_config(
        target, mask_token_id=63, num_hidden_layers=2, block_size=4, target_layer_ids=[1, 4]
    )
    frozen = FrozenTarget(torch.randn(64, 32), torch.randn(64, 32), target, 63).to(device=device)
    with device:
        model = DFlashDrafter(cfg)
    compiled.speed_up(model, "on", backend=args.backend)
    gen = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for i, (lengths, anchors) in enumerate(PACKS, 1):
        seqs = [
            SequenceInput(
                torch.randint(0, 60, (s,), generator=gen), torch.ones(s, dtype=torch.bool), torch.randn(s, 64)
            )
            for s in lengths
        ]
        batch = make_packed_batch(
            seqs, block_size=4, mask_token_id=63, num_anchors=anchors, generator=gen, pad_blocks_to_multiple=4
        ).to(device)
        model.zero_grad()
        loss, _ = drafter_loss(model, frozen, batch, attn_mask=build_attention_mask(batch), normalizer=7.5)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(
            f"step {i}: {time.perf_counter() - start:.1f} s, {graphs} graphs "
            f"(blocks {batch.num_blocks}, context tokens {batch.num_context_tokens})"
        )


if __name__ == "__main__":
    main()
