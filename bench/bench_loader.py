"""The training loader's ceiling: tokens/s it delivers with no model, per codec, from a local directory and from a
local S3 server (moto's, started here), and what that costs per core and per GB/s of network.

    python bench/bench_loader.py                       # CPU: the quality benchmark's drafter shape, 3 codecs
    python bench/bench_loader.py --device cuda --threads 2,4,8 --seconds 10 --samples 4000

For each codec a synthetic cache of LLM-like hidden states is written (`synthetic_cache.write_cache`), then the
real `StreamingLoader` runs alone for `--seconds` at each thread count, reading it
  local   from the directory (pread),
  s3      from s3://bench/<codec> on a moto server on a free local port (range requests),
  s3+disk the same with `--shard-cache-gb`: whole shards downloaded once, later epochs from the local disk.
Reported: sequence tokens/s, tokens per CPU-second (the per-core ceiling: process CPU time while the loader
ran), stored bytes per token, tokens/s per GB/s of network (1e9 / stored bytes per token: what a link feeds),
and for s3 the requests and bytes per shard and per batch. A drafter's data wait stays ~0 while the ceiling is
well above what its step consumes: compare with `bench_train.py` / `bench_quality.py` tokens/s.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.shards.retries import request_counts
from dflash.train.config import paper_recipe
from dflash.train.drafter_config import DrafterConfig
from dflash.train.loader import StreamingLoader

from bench.shapes import QWEN3_8B, SMALL, TINY
from bench.synthetic_cache import write_cache
from tests.common.s3 import S3Server, upload_dir

SHAPES = {
    "tiny": (TINY, (100, 200), 512),
    "small": (SMALL, (200, 450), 8192),
    "qwen3_8b": (QWEN3_8B, (1450, 3072), 8192),
}


def measure(cfg: Any, drafter: DrafterConfig, device: torch.device, threads: int, seconds: float) -> dict:
    """The loader alone for `seconds` after its first batch: tokens/s, CPU seconds, remote requests."""
    cache = cfg.open_cache()
    loader = StreamingLoader.for_run(
        cache, cfg, drafter, device=device, loader_threads=threads, prefetch_batches=max(8, 2 * threads),
        on_corrupt="fail", epochs=1000,
    )  # fmt: skip
    gen = loader.iterate()
    tokens = batches = 0
    first_s = None
    t0, c0, r0 = time.perf_counter(), time.process_time(), request_counts()
    for loaded, _ in gen:
        loaded.wait()
        if first_s is None:
            first_s = time.perf_counter() - t0
            t0, c0, r0 = time.perf_counter(), time.process_time(), request_counts()
            continue
        tokens += loaded.tokens
        batches += 1
        if time.perf_counter() - t0 > seconds:
            break
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    gen.close()
    cache.close()
    requests = {k: v - r0.get(k, 0) for k, v in request_counts().items() if v - r0.get(k, 0)}
    return {
        "threads": threads,
        "tokens_per_s": tokens / elapsed,
        "tokens_per_cpu_s": tokens / max(cpu, 1e-9),
        "cores_busy": cpu / elapsed,
        "first_batch_s": first_s,
        "batches": batches,
        "requests": requests,
        "gets_per_batch": requests.get("get", 0) / max(batches, 1),
        "get_bytes_per_batch": requests.get("get_bytes", 0) / max(batches, 1),
    }


def server_ceiling(url: str, threads: int, seconds: float, chunk: int = 1 << 20) -> float:
    """MB/s the server gives to `threads` readers fetching `chunk`-byte ranges of the shards (no decoding):
    what bounds the loader when the server, not the loader, is the slow side."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash.shards.storage import open_storage

    storage = open_storage(url)
    sizes = storage.list_sizes("shards")
    keys = [(f"shards/{n}", s) for n, s in sorted(sizes.items())]
    deadline = time.perf_counter() + seconds

    def reader(k: int) -> int:
        got, i = 0, k
        while time.perf_counter() < deadline:
            key, size = keys[i % len(keys)]
            offset = (i * chunk) % max(size - chunk, 1)
            got += len(storage.read_range(key, offset, min(chunk, size)))
            i += threads
        return got

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(reader, range(threads)))
    return total / (time.perf_counter() - t0) / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="small", help="small: the quality benchmark's")
    p.add_argument("--codecs", default="lossless,fp8,q4")
    p.add_argument("--sources", default="local,s3,s3+disk")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--samples", type=int, default=600)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--workdir", default=None, help="where caches go (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    device = torch.device(args.device)
    target, (min_len, max_len), budget = SHAPES[args.shape]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_loader_"))
    server = S3Server.start(work) if any(s.startswith("s3") for s in args.sources.split(",")) else None
    results: dict[str, Any] = {"shape": args.shape, "device": str(device), "codecs": {}}
    try:
        if server is not None:
            bucket = server.bench_bucket()  # direct: the fault tests' relay would cap the rate
        for codec in args.codecs.split(","):
            cache = work / f"cache_{codec}"
            shutil.rmtree(cache, ignore_errors=True)
            written = write_cache(
                cache, target, codec_name=codec, samples=args.samples, min_len=min_len, max_len=max_len,
                per_shard=64, device=device, threads=4,
            )  # fmt: skip
            stored_per_token = written["stored_gb"] * 1e9 / written["tokens"]
            shards = len(list((cache / "shards").iterdir()))
            if server is not None:
                upload_dir(server, bucket, codec, cache)
            row: dict[str, Any] = {
                "stored_bytes_per_token": stored_per_token,
                "tokens_per_s_per_network_gbps": 1e9 / stored_per_token,
                "shards": shards,
                "mean_shard_mb": written["stored_gb"] * 1e3 / shards,
                "sources": {},
            }
            if server is not None:
                row["server_mb_per_s"] = {
                    int(t): server_ceiling(f"s3://{bucket}/{codec}", int(t), args.seconds / 2)
                    for t in args.threads.split(",")
                }
                print(
                    f"{codec:>8} server alone (1 MiB range GETs): {row['server_mb_per_s']} MB/s", flush=True
                )
            for source in args.sources.split(","):
                location = str(cache) if source == "local" else f"s3://{bucket}/{codec}"
                overrides: dict[str, Any] = dict(
                    device=device.type, token_budget=budget, max_length=max_len, progress=False,
                    tensorboard=False, plots=False, mask_token_id=target["vocab_size"] - 1, eval_fraction=0.0,
                    epochs=1000, num_draft_layers=3 if args.shape != "qwen3_8b" else 5,
                )  # fmt: skip
                if source == "s3+disk":
                    overrides.update(shard_cache_dir=str(work / "kept"), shard_cache_gb=100.0)
                cfg = paper_recipe(location, str(work / "run"), **overrides)
                drafter = DrafterConfig.from_target_config(
                    target, mask_token_id=target["vocab_size"] - 1, num_hidden_layers=cfg.drafter.num_draft_layers,
                    block_size=cfg.drafter.block_size, target_layer_ids=None,
                )  # fmt: skip
                runs = [measure(cfg, drafter, device, int(t), args.seconds) for t in args.threads.split(",")]
                row["sources"][source] = runs
                for r in runs:
                    print(
                        f"{codec:>8} {source:>8} {r['threads']:>2} threads: {r['tokens_per_s']:>10,.0f} tok/s, "
                        f"{r['tokens_per_cpu_s']:>9,.0f} tok/CPU-s ({r['cores_busy']:.2f} cores), "
                        f"{r['gets_per_batch']:.1f} GETs and {r['get_bytes_per_batch'] / 1e6:.2f} MB per batch",
                        flush=True,
                    )
            print(
                f"{codec:>8}: {stored_per_token:,.0f} stored bytes/token -> {1e9 / stored_per_token:,.0f} tok/s per "
                f"GB/s of network; {shards} shards of {row['mean_shard_mb']:.1f} MB",
                flush=True,
            )
            results["codecs"][codec] = row
    finally:
        if server is not None:
            server.close()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
