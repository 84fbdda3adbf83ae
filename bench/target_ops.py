"""How many aten ops one training step of a quality-benchmark target runs: a launch-bound step's cost.

    python bench/target_ops.py [--size full] [--batch 2]     # CPU, seconds

One forward and backward of each target kind's shape (the size's, `--batch` rows of its sequence length) under
the torch profiler, the hybrid through the torch delta rule its GPU build trains with; prints the aten ops and
the leaf ones (no aten op below them: roughly the kernels a GPU would launch) per kind. The count does not depend
on the batch. Why it matters: the H200 builds these targets at ~100 ms (Qwen3) and ~220 ms (hybrid) a step for a
few ms of math (BENCHMARKS.md), so ops, not FLOPs, set the build's time.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_sizes import SIZES
from bench.quality_target import SizedVocab, target_config, target_model, torch_delta_rule_for_training


def count_ops(kind: str, size: str, batch: int) -> tuple[int, int]:
    """(aten ops, leaf aten ops) of one training step of `kind`'s target, after one warm-up step."""
    spec = replace(SIZES[size].target, kind=kind)
    model = target_model(target_config(spec, SizedVocab(spec.vocab)))
    model.train()
    ids = torch.randint(1, spec.vocab, (batch, spec.seq_len))

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    with torch_delta_rule_for_training(model):
        step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
    aten = [e for e in prof.events() if e.name.startswith("aten::")]
    leaves = [e for e in aten if not any(c.name.startswith("aten::") for c in e.cpu_children)]
    return len(aten), len(leaves)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="full", choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    print(f"{'target':<8}{'aten ops':>10}{'leaf ops':>10}")
    for kind in ("code", "hybrid"):
        total, leaves = count_ops(kind, args.size, args.batch)
        print(f"{kind:<8}{total:>10}{leaves:>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
