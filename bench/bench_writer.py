"""The extraction's writer stage alone against the disk: can it store encoded shards as fast as the disk takes them?

    python bench/bench_writer.py [--gb 4] [--unit-mb 1024] [--sample-mb 40] [--dir DIR] [--json out.json]

`extract.stages.write_shards` (the real writer thread: append frames, commit each unit with fsync + rename)
is fed already-encoded samples (incompressible bytes, one ~40 MB sample = a 1450-token row of a
Qwen3-8B-shaped target, 5 layers, lossless) as fast as it takes them, so its throughput is the stage's
ceiling on this disk. The same bytes written with `dd`-style sequential writes and one fdatasync give the
disk's own rate for comparison. On the H200 bench box the lossless 8B extraction needs ~1.2 GB/s of
stored bytes at the forward's speed (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.extract.stages import Channel, StageStats, WorkBatch, write_shards
from dflash.shards import EncodedSample, ShardMeta, get_codec, shard_name
from dflash.shards.layout import checksum

LAYERS, HIDDEN = [1, 9, 17, 25, 33], 4096


def _samples(sample_mb: float, count: int) -> list[EncodedSample]:
    """`count` distinct-row samples sharing a few random payloads (the writer never looks inside)."""
    rng = np.random.default_rng(0)
    tokens = 1450
    layer_bytes = int(sample_mb * 1e6 / len(LAYERS))
    payloads = [rng.integers(0, 256, layer_bytes, dtype=np.uint8).tobytes() for _ in range(3)]
    ids = rng.integers(0, 1000, tokens, dtype=np.int32).tobytes()
    mask = bytes(tokens)
    frames = [ids, mask, *(payloads[k % len(payloads)] for k in range(len(LAYERS)))]
    checksums = [checksum(f) for f in frames]
    codec = get_codec("lossless").to_dict()
    return [
        EncodedSample(
            row=r,
            length=tokens,
            supervised=0,
            dtype="bfloat16",
            hidden_size=HIDDEN,
            codec=codec,
            frames=frames,
            checksums=checksums,
        )
        for r in range(count)
    ]


def writer_stage(root: Path, samples: list[EncodedSample], per_unit: int) -> dict:
    stop = threading.Event()
    channel = Channel(8, stop)
    stats = StageStats()
    meta = ShardMeta(codec=get_codec("lossless"), layers=LAYERS, hidden_size=HIDDEN, dtype="bfloat16")
    units = [samples[i : i + per_unit] for i in range(0, len(samples), per_unit)]
    empty = torch.empty(0)

    def feed() -> None:
        for u, unit in enumerate(units):
            for j, sample in enumerate(unit):
                done: Future = Future()
                done.set_result(sample)
                item = WorkBatch(
                    unit=u,
                    first_in_unit=j == 0,
                    last_in_unit=j == len(unit) - 1,
                    rows=np.array([sample.row]),
                    lengths=np.array([sample.length]),
                    input_ids=empty,
                    loss_mask=empty,
                    select=empty,
                )
                channel.put((item, [done]))
        channel.put(None)

    feeder = threading.Thread(target=feed, daemon=True)
    t = time.perf_counter()
    feeder.start()
    write_shards(channel, lambda u: root / shard_name(u), meta, stats.clock("write"), stats, 0, None)
    seconds = time.perf_counter() - t
    feeder.join()
    return {"seconds": seconds, "bytes": stats.bytes_written, "gb_per_s": stats.bytes_written / seconds / 1e9}


def sequential_write(path: Path, total: int, chunk: bytes) -> dict:
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < total:
            written += f.write(chunk)
        os.fdatasync(f.fileno())
    seconds = time.perf_counter() - t
    return {"seconds": seconds, "bytes": written, "gb_per_s": written / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=4.0, help="bytes to write per measurement")
    p.add_argument("--unit-mb", type=float, default=1024, help="shard size (dflash-extract --unit-size)")
    p.add_argument("--sample-mb", type=float, default=40)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dflash-bench-writer-", dir=args.dir))
    count = max(1, round(args.gb * 1e3 / args.sample_mb))
    per_unit = max(1, round(args.unit_mb / args.sample_mb))
    samples = _samples(args.sample_mb, count)
    try:
        disk = sequential_write(root / "sequential.bin", int(args.gb * 1e9), samples[0].frames[2])
        (root / "sequential.bin").unlink()
        stage = writer_stage(root / "cache", samples, per_unit)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{args.gb:.1f} GB, shards of ~{per_unit * args.sample_mb:.0f} MB, samples of {args.sample_mb:.0f} MB"
    )
    print(f"disk, sequential + one fdatasync: {disk['gb_per_s']:.2f} GB/s")
    print(
        f"writer stage (append + commit each shard): {stage['gb_per_s']:.2f} GB/s "
        f"= {stage['gb_per_s'] / disk['gb_per_s']:.2f} of the disk"
    )
    if args.json:
        args.json.write_text(
            json.dumps({"disk": disk, "writer": stage, "args": vars(args) | {"dir": str(args.dir)}})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
