"""The end of a loader's data: how long the trainer's last wait for a batch takes once every batch is delivered.

    python bench/bench_loader_end.py                      # threads, 2 and 4 worker processes, 5 passes each

The trainer reads one batch ahead, so the wait that ends in "no more batches" is part of its last log window's
data wait, and the run's end (last evaluation, export) follows it. With worker processes that wait includes
stopping them. A small synthetic cache (`tests/common/fake_cache.py`), consumed at a fixed pace (10 ms a batch,
so the loader is always ahead); reported per loader: the median wait for a batch and the wait for the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards import Cache
from dflash.train.data_spec import DataSpec
from dflash.train.loader_procs import streaming_loader

from tests.common.fake_cache import write_fake_cache

SPEC = dict(
    layer_ids=[1, 3], block_size=4, mask_token_id=90, num_anchors=4, gamma=2.0, token_budget=96, max_length=40,
    shuffle_window=8, loader_threads=2, prefetch_batches=3, heldout_fraction=0.2, seed=1, epochs=1,
)  # fmt: skip


def one_pass(cache_dir: Path, workers: int, pace_s: float) -> tuple[float, float]:
    """(median wait for a batch, wait for the end) over one pass of the cache."""
    loader = streaming_loader(Cache.open(cache_dir), DataSpec(**{**SPEC, "loader_workers": workers}))
    loader.warm_up()
    stream, waits = loader.iterate(), []
    while True:
        t = time.perf_counter()
        item = next(stream, None)
        waits.append(time.perf_counter() - t)
        if item is None:
            break
        time.sleep(pace_s)
    loader.close()
    loader.cache.close()
    return statistics.median(waits[1:-1]), waits[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="0,2,4", help="loader worker processes per row (0: threads)")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--pace-ms", type=float, default=10.0, help="the consumer's time per batch")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache_dir = write_fake_cache(Path(tmp), num_samples=args.samples, samples_per_shard=10)
        print("| loader | batch wait, median (ms) | end-of-data wait, median of passes (ms) | max (ms) |")
        print("|---|---|---|---|")
        for workers in (int(w) for w in args.workers.split(",")):
            runs = [one_pass(cache_dir, workers, args.pace_ms / 1e3) for _ in range(args.passes)]
            name = f"{workers} worker processes" if workers else "threads"
            batch = statistics.median(r[0] for r in runs) * 1e3
            ends = [r[1] * 1e3 for r in runs]
            print(f"| {name} | {batch:.2f} | {statistics.median(ends):.1f} | {max(ends):.1f} |")
            rows.append({"workers": workers, "batch_wait_ms": batch, "end_wait_ms": ends})
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
