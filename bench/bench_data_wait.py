"""Data wait of real training per codec and source (issue 30): is the quality benchmark's drafter kept fed from a
local directory and from a local S3 server?

    python bench/bench_data_wait.py --json dw.json                 # CUDA: the small drafter, 3 codecs x 3 sources
    python bench/bench_data_wait.py --shape tiny --device cpu --samples 96 --train-seconds 4    # every path, CPU

For each codec a synthetic cache is written (`synthetic_cache.write_cache`) and, for the s3 sources, uploaded to
s3://<bucket>/<codec> on moto's standalone server on a free local port (`tests/common/s3.py`, reached directly,
not through the fault tests' relay). Then per source `train()` runs for `--train-seconds` after its second step
(`bench_train.train_phase`: compile excluded) reading
  local    the directory,
  s3       the bucket by range requests, no local copy of the shards (the real remote read path),
  s3+disk  the bucket with `--shard-cache-dir/--shard-cache-gb`: whole shards downloaded in the first epoch,
           read from the local disk after it.
Reported per cell: context tok/s and data-wait fraction of the steady windows (the first quarter of the logged
windows dropped, as bench_train does), the wait in the first epoch and in later ones (windows after the first,
split by the epoch they end in) and how many epochs the window covered; then the loader alone for
`--loader-seconds` at the same thread count (`bench_loader.measure`: its ceiling in tok/s and tok/CPU-s; for
s3+disk measured after training, i.e. from the kept shards). Per codec, the server alone (`bench_loader.
server_ceiling`, 1 MiB range GETs, no decoding) for one reader and for `--train-threads` readers, also as the
tokens/s those bytes carry: a wait with the loader's ceiling near the server's is the server's, not the loader's.
moto answers a range GET by copying the whole object (moto 5.2's `FakeKey.value`), so its rate per GET falls as
shards grow: the caches here use small shards (`--rows-per-shard`), where S3 itself has no such cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards.storage_obstore import s3_client
from dflash.train.metrics import read_metrics

from bench.bench_loader import SHAPES, measure, server_ceiling
from bench.bench_train import train_config, train_phase
from bench.synthetic_cache import write_cache
from tests.common.s3 import S3Server, upload_dir

SOURCES = ("local", "s3", "s3+disk")


def epoch_waits(run_dir: str) -> dict[str, Any]:
    """Data wait in the first epoch and in later ones, from the logged windows after the first (which holds
    step 1's compile); `epochs` = how many epochs the windows ended in."""
    records = [r for r in read_metrics(run_dir) if "data_wait_frac" in r][1:]
    if not records:
        return {"epochs": 0, "first_epoch_wait": None, "later_epochs_wait": None}
    first = records[0]["epoch"]
    early = [r["data_wait_frac"] for r in records if r["epoch"] == first]
    late = [r["data_wait_frac"] for r in records if r["epoch"] != first]
    return {
        "epochs": records[-1]["epoch"] - first + 1,
        "first_epoch_wait": float(np.mean(early)),
        "later_epochs_wait": float(np.mean(late)) if late else None,
    }


def run_cell(
    location: str, source: str, codec: str, work: Path, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    target, (_, max_len), budget = SHAPES[args.shape]
    extra: dict[str, Any] = {}
    if source == "s3+disk":  # a fresh directory: the first epoch downloads every shard
        extra = dict(shard_cache_dir=str(work / f"kept_{codec}"), shard_cache_gb=100.0)
    cfg, drafter = train_config(
        location, str(work / f"run_{codec}_{source}"), target, shape=args.shape, device=device, budget=budget,
        max_len=max_len, threads=args.train_threads, compile=args.compile, **extra,
    )  # fmt: skip
    shutil.rmtree(cfg.out, ignore_errors=True)
    trained = train_phase(cfg, args.train_seconds)
    cell = {**trained, **epoch_waits(cfg.out)}
    if args.loader_seconds > 0:
        cell["loader"] = measure(cfg, drafter, device, args.train_threads, args.loader_seconds)
    return cell


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=("tiny", "small"), default="small", help="small: the quality drafter's")
    p.add_argument("--device", default="cuda")
    p.add_argument("--codecs", default="lossless,fp8,q4")
    p.add_argument("--sources", default=",".join(SOURCES))
    p.add_argument("--samples", type=int, default=1000, help="rows per cache (small: ~325 tokens each)")
    p.add_argument(
        "--rows-per-shard",
        type=int,
        default=16,
        help="small shards: moto copies the whole object for every range GET (S3 does not)",
    )
    p.add_argument("--train-seconds", type=float, default=12.0, help="per cell, after the second step")
    p.add_argument("--train-threads", type=int, default=8, help="loader threads while training")
    p.add_argument("--loader-seconds", type=float, default=2.0, help="the loader alone per cell (0: skip)")
    p.add_argument("--server-seconds", type=float, default=2.0, help="the S3 server alone per codec")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--workdir", default=None, help="where caches and runs go (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    sources = args.sources.split(",")
    if unknown := set(sources) - set(SOURCES):
        p.error(f"--sources: unknown {sorted(unknown)}; known: {','.join(SOURCES)}")
    device = torch.device(args.device)
    # nine train() calls in one process, each with fresh compiled regions over the same functions: room for
    # their guard sets, so a late cell cannot fall back to eager (a slower step would flatter its data wait)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    target, (min_len, max_len), _ = SHAPES[args.shape]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_data_wait_"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "shape": args.shape,
        "s3_client": s3_client(),  # what the s3 rows' range reads go through (DFLASH_S3_CLIENT)
        "args": vars(args),
        "codecs": {},
    }
    server = S3Server.start(work) if any(s != "local" for s in sources) else None
    t_start = time.perf_counter()
    try:
        if server is not None:
            bucket = server.bench_bucket()  # direct: the fault tests' relay would cap the rate
        for codec in args.codecs.split(","):
            cache = work / f"cache_{codec}"
            shutil.rmtree(cache, ignore_errors=True)
            written = write_cache(
                cache, target, codec_name=codec, samples=args.samples, min_len=min_len, max_len=max_len,
                per_shard=args.rows_per_shard, device=device, threads=min(16, os.cpu_count() or 1),
            )  # fmt: skip
            row: dict[str, Any] = {
                "cache": written,
                "stored_bytes_per_token": written["stored_gb"] * 1e9 / written["tokens"],
                "cells": {},
            }
            if server is not None:
                t0 = time.perf_counter()
                upload_dir(server, bucket, codec, cache)
                row["upload_s"] = time.perf_counter() - t0
                url = f"s3://{bucket}/{codec}"
                row["server_mb_per_s"] = {
                    n: server_ceiling(url, n, args.server_seconds) for n in sorted({1, args.train_threads})
                }
            print(
                f"[{codec}] {written['tokens']:,} tokens, {written['stored_gb']:.2f} GB stored, written in "
                f"{written['write_s']:.1f} s, uploaded in {row.get('upload_s', 0):.1f} s; server alone: "
                + ", ".join(
                    f"{n} reader(s) {mb:.0f} MB/s = {mb * 1e6 / row['stored_bytes_per_token']:,.0f} tok/s"
                    for n, mb in row.get("server_mb_per_s", {}).items()
                ),
                flush=True,
            )
            for source in sources:
                location = str(cache) if source == "local" else f"s3://{bucket}/{codec}"
                cell = run_cell(location, source, codec, work, args, device)
                row["cells"][source] = cell
                print(f"  {_cell_line(source, cell)}", flush=True)
            results["codecs"][codec] = row
            if args.json:  # after every codec: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        if server is not None:
            server.close()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    results["wall_s"] = time.perf_counter() - t_start
    _print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _cell_line(source: str, c: dict[str, Any]) -> str:
    loader = c.get("loader")
    alone = (
        f"; loader alone {loader['tokens_per_s']:,.0f} tok/s ({loader['tokens_per_cpu_s']:,.0f} tok/CPU-s)"
        if loader
        else ""
    )
    return (
        f"{source:>8}: {c['tokens_per_s']:,.0f} tok/s, wait {_pct(c['data_wait_frac'])} (first epoch "
        f"{_pct(c['first_epoch_wait'])}, later {_pct(c['later_epochs_wait'])}, {c['epochs']} epochs), "
        f"{c['steps']} steps, first step {c['time_to_first_step_s'] or 0:.1f} s{alone}"
    )


def _print_table(results: dict[str, Any]) -> None:
    print(
        f"\ndevice: {results['device']}, shape: {results['shape']}, s3 reads: {results['s3_client']}, "
        f"wall {results['wall_s']:.0f} s"
    )
    print(
        "| codec | source | context tok/s | data wait | first epoch / later | epochs | loader alone tok/s "
        "(tok/CPU-s) | server alone 1 reader: MB/s = tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for codec, row in results["codecs"].items():
        one = row.get("server_mb_per_s", {}).get(1)
        server = "-" if one is None else f"{one:.0f} = {one * 1e6 / row['stored_bytes_per_token']:,.0f}"
        for source, c in row["cells"].items():
            loader = c.get("loader")
            alone = f"{loader['tokens_per_s']:,.0f} ({loader['tokens_per_cpu_s']:,.0f})" if loader else "-"
            print(
                f"| {codec} | {source} | {c['tokens_per_s']:,.0f} | {_pct(c['data_wait_frac'])} | "
                f"{_pct(c['first_epoch_wait'])} / {_pct(c['later_epochs_wait'])} | {c['epochs']} | {alone} | "
                f"{server if source != 'local' else '-'} |"
            )


if __name__ == "__main__":
    main()
