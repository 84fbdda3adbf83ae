"""What a local shard cache (`--shard-cache-gb`) smaller than a remote cache saves: bytes fetched from object
storage per epoch by the real training loader, for both data orders, against the cache's stored bytes.

    python bench/bench_shard_cache.py                    # this box: ~8 min
    python bench/bench_shard_cache.py --fractions 0.25,0.5,1.2 --epochs 3

A synthetic cache of more shards than a loader keeps open (`--shards` x `--per-shard` samples, short rows of
the tiny shape) is served by moto's S3 on a free local port; `StreamingLoader` reads it for `--epochs` epochs
with a shard cache of each `--fractions` of the cache's stored bytes (0: range requests only), keeping as many
shard readers open as training does (`--open` to try another number). Reported per epoch: bytes fetched
(range reads and whole-shard downloads) over the cache's bytes, GETs, and the shards downloaded whole.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards.retries import request_counts
from dflash.train.config import paper_recipe
from dflash.train.drafter_config import DrafterConfig
from dflash.train.loader import StreamingLoader

from bench.shapes import TINY
from bench.synthetic_cache import write_cache
from tests.common.s3 import S3Server, upload_dir


def epochs_fetched(
    cfg: Any, drafter: DrafterConfig, open_readers: int | None, epochs: int
) -> list[dict[str, float]]:
    """Requests and bytes per epoch of one loader reading the whole cache `epochs` times."""
    cache = cfg.open_cache(**({"max_open_shards": open_readers} if open_readers else {}))
    loader = StreamingLoader.for_run(
        cache, cfg, drafter, device=torch.device("cpu"), loader_threads=2, prefetch_batches=4,
        on_corrupt="fail", epochs=epochs,
    )  # fmt: skip
    per_epoch: list[dict[str, float]] = []
    before, downloads, epoch = request_counts(), 0, 0

    def close_epoch() -> None:
        nonlocal before, downloads
        now = request_counts()
        kept = cache._shard_cache
        got = kept.misses if kept is not None else 0
        per_epoch.append({"get_bytes": now.get("get_bytes", 0) - before.get("get_bytes", 0),
                          "gets": now.get("get", 0) - before.get("get", 0), "downloads": got - downloads})  # fmt: skip
        before, downloads = now, got

    for loaded, state in loader.iterate():
        loaded.wait()
        if state["epoch"] != epoch:  # the state after a batch names the epoch the next batch comes from
            close_epoch()
            epoch = state["epoch"]
    close_epoch()
    cache.close()
    return per_epoch[:epochs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", type=int, default=120)
    p.add_argument("--per-shard", type=int, default=100, help="samples a shard (spans are 64)")
    p.add_argument("--open", type=int, default=None, help="shard readers kept open (default: as training)")
    p.add_argument("--fractions", default="0,0.25,0.5", help="shard cache bound / the cache's bytes")
    p.add_argument("--orders", default="spans,shards")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--codec", default="fp8")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_shard_cache_"))
    server = S3Server.start(work)
    results: dict[str, Any] = {"args": vars(args), "runs": []}
    try:
        bucket = server.bench_bucket()
        local = work / "cache"
        write_cache(local, TINY, codec_name=args.codec, samples=args.shards * args.per_shard, min_len=32,
                    max_len=64, per_shard=args.per_shard, device=torch.device("cpu"), threads=2)  # fmt: skip
        stored = sum(f.stat().st_size for f in (local / "shards").iterdir())
        upload_dir(server, bucket, "c", local)
        results["stored_bytes"] = stored
        print(f"{args.shards} shards, {stored / 1e6:.1f} MB stored; readers open: {args.open or 'as training'}",
              flush=True)  # fmt: skip
        print("order   bound/cache   epoch: fetched/cache (GETs, whole-shard downloads)", flush=True)
        for order in args.orders.split(","):
            for fraction in (float(f) for f in args.fractions.split(",")):
                overrides: dict[str, Any] = dict(
                    device="cpu", token_budget=1024, max_length=64, progress=False, tensorboard=False, plots=False,
                    mask_token_id=TINY["vocab_size"] - 1, eval_fraction=0.0, num_draft_layers=3, data_order=order,
                )  # fmt: skip
                if fraction:
                    overrides.update(shard_cache_dir=str(work / f"kept-{order}-{fraction:g}"),
                                     shard_cache_gb=fraction * stored / 1e9)  # fmt: skip
                cfg = paper_recipe(f"s3://{bucket}/c", str(work / "run"), **overrides)
                drafter = DrafterConfig.from_target_config(
                    TINY, mask_token_id=TINY["vocab_size"] - 1, num_hidden_layers=3,
                    block_size=cfg.drafter.block_size, target_layer_ids=None,
                )  # fmt: skip
                epochs = epochs_fetched(cfg, drafter, args.open, args.epochs)
                results["runs"].append({"order": order, "fraction": fraction, "epochs": epochs})
                cells = [f"{e['get_bytes'] / stored:.2f} ({e['gets']}, {e['downloads']})" for e in epochs]
                print(f"{order:>6}   {fraction:>11g}   " + "   ".join(cells), flush=True)
    finally:
        server.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
