"""End-to-end multi-process check: torchrun extraction and DDP training on N devices, one cache.

    python bench/multi_gpu_smoke.py --nproc 2            # on a 2-GPU machine (nccl), or CPU (gloo)

Builds a tiny random qwen3 target and a save_to_disk dataset, runs `torchrun --nproc-per-node N` for
`dflash.extract.cli`, verifies the cache against the dataset, trains with `torchrun` for a few steps and
prints one line per phase. Exit code 0 only if every phase succeeded.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash.train.metrics import read_metrics

from tests.common.datasets import make_rows, write_save_to_disk
from tests.common.targets import make_target
from tests.common.train_cli import tiny_train_argv, torchrun


def _run(what: str, cmd: list[str]) -> float:
    print(f"{what}: starting", flush=True)
    t = time.perf_counter()
    # Output streams through (not captured), so a run stopped by a timeout still shows how far it got.
    proc = subprocess.run(cmd)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"{what}: failed with exit code {proc.returncode}")
    print(f"{what}: ok in {seconds:.1f} s")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rows", type=int, default=400)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--attention", default="auto", choices=["auto", "dense", "flex"])
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dflash-multi-"))
    target = make_target(work, "qwen3", num_layers=4)
    dataset = write_save_to_disk(make_rows(args.rows, seed=3, min_len=8, max_len=200, vocab=200), work / "ds")
    cache, run = work / "cache", work / "run"
    launch = torchrun(args.nproc)
    _run(
        f"extract on {args.nproc} processes",
        [
            *launch,
            "-m",
            "dflash.extract.cli",
            "--target",
            str(target),
            "--dataset",
            str(dataset),
            "--out",
            str(cache),
            "--layers",
            "all",
            "--token-budget",
            "2048",
            "--unit-size",
            "1MiB",
            "--json",
        ],
    )
    _run(
        "verify",
        [sys.executable, "-m", "dflash.tools.shards_cli", "verify", str(cache), "--dataset", str(dataset)],
    )
    _run(
        f"train on {args.nproc} processes",
        [
            *launch,
            "-m",
            "dflash.train.cli",
            *tiny_train_argv(
                cache,
                run,
                "--device",
                args.device,
                "--attention",
                args.attention,
                "--num-draft-layers",
                "2",
                "--target-layer-ids",
                "1,2",
                "--max-steps",
                str(args.steps),
                "--eval-every",
                "10",
                "--save-every",
                "10",
                "--no-progress",
                "--mask-token-id",
                "255",
            ),
        ],
    )
    lines = read_metrics(run)
    last = [x for x in lines if "loss" in x][-1]
    print(
        f"steps {last['step']}  loss {last['loss']:.3f}  tau {[x['tau'] for x in lines if 'tau' in x][-1]:.2f}"
    )
    print(f"workdir {work}")


if __name__ == "__main__":
    main()
