"""Does the quality benchmark build the same target twice? Trains a size's target shape several times from one
seed on the same tokens and compares the saved weights' sha256 (the digest `bench_target.json` records):

    python bench/bench_target_determinism.py --size full --steps 300 --control     # one GPU, about a minute

A benchmark's prompt-lookup baseline belongs to one target: if builds agree, seeds and codecs of one target can
be run in different sessions, each rebuilding it. `--control` builds the same number again with determinism
only warned about (how targets were built before it was strict). The tokens are random
(the corpus is not the question, and skipping it keeps this quick); the shape, optimizer and schedule are the
size's, with `--steps` of them.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_data import COMPILE_MODES, SizedVocab, TargetSpec, train_target
from bench.quality_sizes import SIZES


def build_digests(
    spec: TargetSpec, device: str, builds: int, strict: bool, root: Path
) -> list[tuple[str, float]]:
    files = [np.random.default_rng(0).integers(1, spec.vocab, 64 * spec.seq_len)]
    out = []
    for i in range(builds):
        folder = root / f"{'strict' if strict else 'warn-only'}-{i}"
        folder.mkdir()
        start = time.perf_counter()
        info = train_target(spec, SizedVocab(spec.vocab), files, folder, device, seed=0, strict=strict)
        out.append((info["weights_sha256"], time.perf_counter() - start))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="full", choices=sorted(SIZES))
    p.add_argument("--target", default="code", choices=("code", "prose", "hybrid"))
    p.add_argument("--steps", type=int, default=300, help="target training steps per build")
    p.add_argument("--builds", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--control", action="store_true", help="also build with determinism only warned about")
    p.add_argument("--compile", choices=COMPILE_MODES, help="torch.compile the training step in this mode")
    args = p.parse_args(argv)
    spec = replace(SIZES[args.size].target, steps=args.steps, kind=args.target, compile=args.compile)
    print(
        f"{args.target} target of the {args.size} size, {args.steps} steps, {args.builds} builds, {args.device}, "
        f"compile {args.compile or 'off'}"
    )
    print(f"{'determinism':<12} {'same weights':<13} {'s per build':<12} sha256 per build")
    with tempfile.TemporaryDirectory() as tmp:
        for strict in (True, False) if args.control else (True,):
            got = build_digests(spec, args.device, args.builds, strict, Path(tmp))
            digests = [d for d, _ in got]
            seconds = " / ".join(f"{s:.0f}" for _, s in got)
            same = "yes" if len(set(digests)) == 1 else "NO"
            name = "strict" if strict else "warn-only"
            print(f"{name:<12} {same:<13} {seconds:<12} {' '.join(d[:12] for d in digests)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
