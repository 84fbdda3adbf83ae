"""The command lines the demo's steps are: the demo builds each step's config by parsing them with the
CLI's own parser, so the commands it prints and records in `summary.json` reproduce it exactly."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .demo import DemoSize


def tokenize_argv(chats: Path, target: Path, dataset: Path) -> list[str]:
    return ["--data", str(chats), "--tokenizer", str(target), "--out", str(dataset)]


def extract_argv(target: Path, dataset: Path, cache: Path, spec: DemoSize) -> list[str]:
    """Every target layer, lossless, float32 on the CPU (no GPU in the demo)."""
    return [
        *("--target", str(target), "--dataset", str(dataset), "--out", str(cache)),
        *("--layers", "all", "--codec", "lossless", "--dtype", "float32", "--device", "cpu"),
        *("--max-len", str(spec.max_length)),
    ]


def train_argv(cache: Path, run: Path, spec: DemoSize, *, seed: int, layers: Sequence[int]) -> list[str]:
    """Every cached layer feeds the drafter; the step budget ends the run (epochs never do); one loader
    thread; no TensorBoard; the final checkpoint only."""
    return [
        *("--cache", str(cache), "--out", str(run), "--seed", str(seed), "--device", "cpu"),
        *("--num-draft-layers", str(spec.num_draft_layers)),
        *("--target-layer-ids", ",".join(map(str, layers))),
        *("--block-size", str(spec.block_size), "--num-anchors", str(spec.num_anchors)),
        *("--token-budget", str(spec.token_budget), "--max-length", str(spec.max_length)),
        *("--loader-threads", "1", "--prefetch-batches", "2", "--shuffle-window", "256"),
        *("--eval-fraction", str(spec.eval_fraction), "--eval-samples", str(spec.eval_samples)),
        *("--epochs", str(10**6), "--max-steps", str(spec.train_steps)),
        *("--lr", str(spec.lr), "--warmup-frac", "0.05"),
        *("--eval-every", str(spec.eval_every), "--save-every", "0", "--log-every", "10"),
        *("--keep-checkpoints", "1", "--no-tensorboard"),
    ]


def command_line(prog: str, argv: Sequence[str], threads: int) -> str:
    """A shell line: the demo runs its steps on `threads` torch threads (OMP_NUM_THREADS sets the same)."""
    return f"OMP_NUM_THREADS={threads} {prog} " + " ".join(shlex.quote(a) for a in argv)
