"""One rank of `bench/bench_scaling.py`, started by `torchrun`; it records what the rank saw in a JSON file.

    torchrun --nproc-per-node N bench/scaling_worker.py extract <dflash-extract args>
    torchrun --nproc-per-node N bench/scaling_worker.py train <dflash-train args>

Both run the real code on this rank's share: `extract` parses the `dflash-extract` arguments with the CLI's
own parser and calls `run_extraction` with the random-weight target of $DFLASH_BENCH_ARCH built in memory
(seeded, the stub's embedding: the same target on every rank; no multi-GB checkpoint on disk), compiled
and warmed up before the timed extraction as `dflash-extract` compiles it; `train` is `dflash-train` itself,
with two observers: a wrapper around the loader's iterator (time blocked waiting for a batch, per rank; the
trainer logs only the mean over ranks) and PyTorch's global optimizer-step hook (time of each step).

Environment: DFLASH_BENCH_DIR (where rank<r>.json and rank<r>.pid go), DFLASH_BENCH_ARCH (extract only),
DFLASH_BENCH_LAUNCH (wall-clock time the launch started, for the time to the first step).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write(name: str, text: str) -> None:
    out = Path(os.environ["DFLASH_BENCH_DIR"]) / name
    tmp = out.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(out)


def extract(argv: list[str]) -> int:
    import torch
    from dflash.extract.cli import config_from_args
    from dflash.extract.pipeline import resolve_device, resolve_dtype, run_extraction
    from dflash.extract.units import RankInfo

    from bench.extract_common import target_from_stub

    config = config_from_args(argv)
    rank = RankInfo.from_env()
    device = resolve_device(config.device, rank.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    t = time.perf_counter()
    target = target_from_stub(
        os.environ["DFLASH_BENCH_ARCH"], config.target, device, resolve_dtype(config.dtype, device)
    )
    target.speed_up(compile=config.compile)
    # Compilation and kernel selection happen on the first shapes; a real run amortises them over hours.
    vocab = int(target.model.config.vocab_size)
    for rows, length in ((1, 64), (2, config.max_len // 4), (4, config.max_len)):
        target.capture(torch.randint(0, vocab, (rows, length), device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - t
    result = run_extraction(config, target=target).to_dict()
    _write(f"rank{rank.rank}.json", json.dumps({**result, "warmup_s": warm_s}))
    return 0


def train(argv: list[str]) -> int:
    import torch
    from dflash.train import cli
    from dflash.train.loader import StreamingLoader
    from dflash.train.loader_procs import ProcessLoader
    from torch.optim.optimizer import register_optimizer_step_post_hook

    launch = float(os.environ.get("DFLASH_BENCH_LAUNCH", time.time()))
    marks: dict[str, Any] = {"steps": [], "wait_after_first_s": 0.0, "wait_s": 0.0}

    def timed(iterate: Any) -> Any:
        def timed_iterate(self: StreamingLoader):
            batches = iterate(self)
            while True:
                t = time.perf_counter()
                try:
                    item = next(batches)
                except StopIteration:
                    return
                waited = time.perf_counter() - t
                marks["wait_s"] += waited
                if marks["steps"]:
                    marks["wait_after_first_s"] += waited
                yield item

        return timed_iterate

    def on_step(*_: Any) -> None:
        if not marks["steps"] and torch.cuda.is_available():
            torch.cuda.synchronize()
        marks["steps"].append(time.perf_counter())
        if len(marks["steps"]) == 1:
            marks["first_step_s"] = time.time() - launch

    # threads or worker processes: whichever the run uses
    for loader_class in (StreamingLoader, ProcessLoader):
        loader_class.iterate = timed(loader_class.iterate)
    register_optimizer_step_post_hook(on_step)
    code = cli.main(argv)
    steps = marks.pop("steps")
    span = steps[-1] - steps[0] if len(steps) > 1 else 0.0
    marks.update(
        rank=_rank(),
        steps=len(steps),
        span_s=span,  # first optimizer step to the last
        data_wait_frac=marks["wait_after_first_s"] / span if span else None,
        exit_code=code,
    )
    _write(f"rank{_rank()}.json", json.dumps(marks))
    return code


def main() -> int:
    kind, argv = sys.argv[1], sys.argv[2:]
    _write(f"rank{_rank()}.pid", str(os.getpid()))
    return {"extract": extract, "train": train}[kind](argv)


if __name__ == "__main__":
    sys.exit(main())
