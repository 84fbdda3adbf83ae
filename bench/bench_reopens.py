"""How often a training epoch opens each shard again, for a cache's shape and a number of open readers: the real
planner's sample order (`epoch_batches`, the default 1024-sample shuffle window) through an LRU of N readers,
as `Cache` keeps them. A reopen costs a local cache an index read and its checks, a remote one three requests
and a 1 MiB tail read, and under a bounded shard cache maybe a whole download. No I/O: seconds on a CPU.

    python bench/bench_reopens.py
    python bench/bench_reopens.py --shapes 50x2000,475x200 --readers 64,256
"""

from __future__ import annotations

import argparse
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train.data_plan import ORDERS, ShardEntries, epoch_batches


def opens_per_shard(rows_per_shard: int, shards: int, readers: int, order: str, window: int) -> float:
    """Reader opens per shard in one epoch (1.0: each shard opened once)."""
    rng = np.random.default_rng(0)
    rows = np.array_split(np.arange(rows_per_shard * shards), shards)
    entries = {
        f"shard-{i:06d}": ShardEntries(
            rows=r, lengths=rng.integers(200, 400, len(r)), supervised=np.full(len(r), 100)
        )
        for i, r in enumerate(rows)
    }
    batches = epoch_batches([(name, len(e.rows)) for name, e in entries.items()], entries.__getitem__, seed=0,
                            epoch=1, window=window, token_budget=8192, max_length=3072, heldout_fraction=0.0,
                            order=order)  # fmt: skip
    open_now: OrderedDict[str, None] = OrderedDict()
    opens = 0
    for batch in batches:
        for ref in batch:
            if ref.shard in open_now:
                open_now.move_to_end(ref.shard)
                continue
            opens += 1
            open_now[ref.shard] = None
            if len(open_now) > readers:
                open_now.popitem(last=False)
    return opens / shards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="20x5000,50x2000,475x200", help="ROWSxSHARDS, comma-separated")
    p.add_argument("--readers", default="64,128,256")
    p.add_argument("--window", type=int, default=1024)
    args = p.parse_args()
    readers = [int(r) for r in args.readers.split(",")]
    print("rows a shard x shards   order   " + "   ".join(f"{r:>4} open" for r in readers))
    for shape in args.shapes.split(","):
        rows_per_shard, shards = (int(x) for x in shape.split("x"))
        for order in ORDERS:
            cells = [
                f"{opens_per_shard(rows_per_shard, shards, r, order, args.window):9.2f}" for r in readers
            ]
            print(f"{rows_per_shard:>11} x {shards:<8}   {order:>6}   " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
