"""`dflash-shards convert` throughput: GB/s of bf16 features re-encoded per CPU core, per conversion.

    python bench/bench_convert.py [--samples 8] [--tokens 1024] [--hidden 4096] [--layers 5] [--threads 1]
                                  [--device cpu] [--json out.json]
    python bench/bench_convert.py --tiny                      # seconds, exercises the code path

A lossless cache of LLM-like bf16 states (default 5 layers x 4096, `--samples` rows of `--tokens`) is written
once; then lossless -> fp8, lossless -> q6, lossless -> q4 and fp8 -> q4 run with `convert_cache`.
GB/s count the raw bf16 bytes of the converted layers: per core = / process CPU seconds (decode, quantize,
zstd, hashing, writing; so a busy machine does not distort it), wall = / elapsed seconds with --threads.
With --device cuda the quantization runs on the GPU (as on a GPU box with spare time).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common.fake_cache import TINY_TARGET, write_fake_target
from common.hostile import record_target_files
from common.synth import make_cache
from dflash.shards.convert import ConvertConfig, convert_cache

CONVERSIONS = (("lossless", "fp8"), ("lossless", "q6"), ("lossless", "q4"), ("fp8", "q4"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5, help="cached layers per sample")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tiny", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.samples, args.tokens, args.hidden = 3, 64, 256
    torch.set_num_threads(1)  # per-core figures: the converter's own threads are the parallelism
    root = Path(tempfile.mkdtemp(prefix="dflash-bench-convert-", dir=args.dir))
    results = []
    try:
        make_cache(
            root / "lossless",
            [args.tokens] * args.samples,
            layers=tuple(range(args.layers)),
            hidden=args.hidden,
            rows_per_shard=max(1, args.samples // 2),
        )
        # a small vocabulary: the target's copy is not what this measures
        write_fake_target(root / "lossless" / "target", {**TINY_TARGET, "hidden_size": args.hidden}, 0)
        record_target_files(root / "lossless")
        for src, dst in CONVERSIONS:
            out = root / dst if src == "lossless" else root / f"{src}-{dst}"
            cpu, wall = time.process_time(), time.perf_counter()
            r = convert_cache(
                ConvertConfig(source=root / src, out=out, codec=dst, threads=args.threads, device=args.device)
            )
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            results.append(
                {
                    "conversion": f"{src} -> {dst}",
                    "raw_gb": r.raw_bytes / 1e9,
                    "gb_per_s_per_core": r.raw_bytes / cpu / 1e9,
                    "gb_per_s_wall": r.raw_bytes / wall / 1e9,
                    "size_ratio": r.bytes_in / r.bytes_out,
                }
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{args.samples} rows x {args.tokens} tokens x {args.layers} layers x {args.hidden}, {args.threads} threads, "
        f"quantizing on {args.device}"
    )
    print(f"{'conversion':<20}{'GB/s/core':>11}{'GB/s wall':>11}{'smaller':>9}")
    for r in results:
        print(
            f"{r['conversion']:<20}{r['gb_per_s_per_core']:>11.3f}{r['gb_per_s_wall']:>11.3f}{r['size_ratio']:>8.2f}x"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
