"""Does the quality benchmark build the same target twice? Trains a size's target shape several times from one
seed on the same tokens and compares the saved weights' sha256 (the digest `bench_target.json` records):

    python bench/bench_target_determinism.py --size full --steps 300 --control     # one GPU, about a minute
    python bench/bench_target_determinism.py --size full --steps 300 --rows 2048   # and its greedy rows, twice

A benchmark's prompt-lookup baseline belongs to one target: if builds agree, seeds and codecs of one target can
be run in different sessions, each rebuilding it. `--control` builds the same number again with determinism
only warned about (how targets were built before it was strict). The tokens are random
(the corpus is not the question, and skipping it keeps this quick); the shape, optimizer and schedule are the
size's, with `--steps` of them.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_data import DataSpec, cut_prompts, greedy_continuations
from bench.quality_sizes import SIZES
from bench.quality_target import COMPILE_MODES, SizedVocab, TargetSpec, train_target


def build_digests(
    spec: TargetSpec, device: str, builds: int, strict: bool, root: Path, rows: DataSpec | None = None
) -> list[tuple[str, float, list[str]]]:
    """Per build: its weights' sha256, its seconds, and (`rows`) the sha256 of its greedy continuations of
    the same prompts, generated twice: the benchmark's rows.arrow differed between machines whose targets
    agreed bit for bit, and two generations in one process tell a nondeterministic kernel from a machine's."""
    files = [np.random.default_rng(0).integers(1, spec.vocab, 64 * spec.seq_len)]
    prompts = cut_prompts(files, rows.train_rows, rows, np.random.default_rng(1)) if rows else []
    out = []
    for i in range(builds):
        folder = root / f"{'strict' if strict else 'warn-only'}-{i}"
        folder.mkdir()
        start = time.perf_counter()
        info = train_target(spec, SizedVocab(spec.vocab), files, folder, device, seed=0, strict=strict)
        seconds = time.perf_counter() - start
        answers = [
            hashlib.sha256(np.concatenate(greedy_continuations(folder, prompts, rows, 0, device)).tobytes())
            for _ in range(2 if rows else 0)
        ]
        out.append((info["weights_sha256"], seconds, [a.hexdigest() for a in answers]))
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
    p.add_argument("--rows", type=int, default=0, help="also generate this many rows twice per build")
    args = p.parse_args(argv)
    spec = replace(SIZES[args.size].target, steps=args.steps, kind=args.target, compile=args.compile)
    rows = replace(SIZES[args.size].data, train_rows=args.rows) if args.rows else None
    print(
        f"{args.target} target of the {args.size} size, {args.steps} steps, {args.builds} builds, {args.device}, "
        f"compile {args.compile or 'off'}"
    )
    print(f"{'determinism':<12} {'same weights':<13} {'s per build':<12} sha256 per build")
    with tempfile.TemporaryDirectory() as tmp:
        for strict in (True, False) if args.control else (True,):
            got = build_digests(spec, args.device, args.builds, strict, Path(tmp), rows)
            digests = [d for d, _, _ in got]
            seconds = " / ".join(f"{s:.0f}" for _, s, _ in got)
            same = "yes" if len(set(digests)) == 1 else "NO"
            name = "strict" if strict else "warn-only"
            print(f"{name:<12} {same:<13} {seconds:<12} {' '.join(d[:12] for d in digests)}", flush=True)
            if rows:  # per build, its two generations' digests
                generated = [" = ".join(a[:12] for a in answers) for _, _, answers in got]
                print(f"{'':<12} rows ({args.rows}, generated twice per build): {' | '.join(generated)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
