"""The extraction's writer stage alone against the disk: can it store encoded shards as fast as the disk takes them?

    python bench/bench_writer.py [--gb 4] [--unit-mb 1024] [--sample-mb 40] [--dir DIR] [--json out.json]

`extract.stages.write_shards` (the real writer thread: append frames, finish each unit, publish it with
fsync + rename on the Committer's threads) is fed already-encoded samples (incompressible bytes, one ~40 MB
sample = a 1450-token row of a Qwen3-8B-shaped target, 5 layers, lossless) as fast as it takes them, so
its throughput is the stage's ceiling on this disk. In the same run, on the same directory:

    dd          `dd if=/dev/zero bs=16M conv=fdatasync` (when dd exists; zeros: a compressing filesystem
                would flatter it, so the next line writes the bench's own random bytes)
    sequential  one file of the same random bytes, large writes and one fdatasync
    writer      the stage as extraction runs it (commits overlapped, COMMITS_IN_FLIGHT at a time)
    sync commit the stage with every commit waited for in the writer thread (the old behaviour)

The target (issue 14): writer >= 0.9 of the disk's sequential rate. A CPU box's fsync may not reach a
real disk (VMs cache it): trust the figures from the GPU box. On the H200 bench box the lossless 8B
extraction needs ~1.2 GB/s of stored bytes at the forward's speed (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
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
from dflash.shards.writer import COMMITS_IN_FLIGHT, Committer

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


class _SyncCommitter(Committer):
    """Publishes in the calling thread: the writer stage as it was before commits overlapped."""

    def submit(self, writer) -> None:
        writer.publish()


def writer_stage(root: Path, samples: list[EncodedSample], per_unit: int, depth: int | None) -> dict:
    """The real writer thread's rate; depth None: commits waited for in the writer thread."""
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
                channel.put((item, [done], []))
        channel.put(None)

    feeder = threading.Thread(target=feed, daemon=True)
    clock = stats.clock("write")
    stage = sys.modules[write_shards.__module__]
    real = stage.Committer
    if depth is None:
        stage.Committer = _SyncCommitter
    t = time.perf_counter()
    try:
        feeder.start()
        write_shards(channel, lambda u: root / shard_name(u), meta, clock, stats, 0, None, depth or 1)
    finally:
        stage.Committer = real
    seconds = time.perf_counter() - t
    feeder.join()
    shutil.rmtree(root)
    return {
        "seconds": seconds,
        "bytes": stats.bytes_written,
        "gb_per_s": stats.bytes_written / seconds / 1e9,
        "busy_s": clock.busy,
        "wait_disk_s": clock.wait_out,
    }


def sequential_write(path: Path, total: int, chunk: bytes) -> dict:
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        written = 0
        while written < total:
            written += f.write(chunk)
        os.fdatasync(f.fileno())
    seconds = time.perf_counter() - t
    path.unlink()
    return {"seconds": seconds, "bytes": written, "gb_per_s": written / seconds / 1e9}


def dd_write(path: Path, total: int) -> dict | None:
    """`dd` itself (None where it is missing), 16 MiB blocks, one fdatasync at the end."""
    dd = shutil.which("dd")
    if dd is None:
        return None
    count = max(1, total // (16 << 20))
    cmd = [dd, "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fdatasync", "status=none"]
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    seconds = time.perf_counter() - t
    path.unlink()
    return {"seconds": seconds, "bytes": count * (16 << 20), "gb_per_s": count * (16 << 20) / seconds / 1e9}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=4.0, help="bytes to write per measurement")
    p.add_argument("--unit-mb", type=float, default=1024, help="shard size (dflash-extract --unit-size)")
    p.add_argument("--sample-mb", type=float, default=40)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    p.add_argument("--commits", type=int, default=COMMITS_IN_FLIGHT, help="shards published at a time")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dflash-bench-writer-", dir=args.dir))
    count = max(1, round(args.gb * 1e3 / args.sample_mb))
    per_unit = max(1, round(args.unit_mb / args.sample_mb))
    samples = _samples(args.sample_mb, count)
    total = int(args.gb * 1e9)
    try:
        results = {
            "dd": dd_write(root / "dd.bin", total),
            "sequential": sequential_write(root / "sequential.bin", total, samples[0].frames[2]),
            "writer": writer_stage(root / "cache", samples, per_unit, args.commits),
            "sync_commit": writer_stage(root / "cache-sync", samples, per_unit, None),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    disk = results["sequential"]["gb_per_s"]
    print(
        f"{args.gb:.1f} GB each, shards of ~{per_unit * args.sample_mb:.0f} MB, samples of {args.sample_mb:.0f} MB, "
        f"{args.commits} commits in flight"
    )
    labels = {
        "dd": "dd (zeros), one fdatasync",
        "sequential": "sequential (same bytes), one fdatasync",
        "writer": "writer stage (commits overlapped)",
        "sync_commit": "writer stage (commit waited for)",
    }
    for key, label in labels.items():
        r = results[key]
        if r is None:
            print(f"{label:<42} -  (dd not found)")
            continue
        extra = f"  (waited for the disk {r['wait_disk_s']:.1f} s)" if "wait_disk_s" in r else ""
        print(f"{label:<42} {r['gb_per_s']:6.2f} GB/s = {r['gb_per_s'] / disk:.2f} of sequential{extra}")
    if args.json:
        args.json.write_text(
            json.dumps({**results, "args": vars(args) | {"dir": str(args.dir), "json": str(args.json)}})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
