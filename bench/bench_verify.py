"""`dflash-shards verify` speed: full decoding vs `--quick` (hashes only) on a cache of LLM-like states.

    python bench/bench_verify.py [--tiny] [--codecs lossless,fp8,q6,q4] [--json out.json]

GB/s/core counts the bytes the frames decode to (token ids, loss mask and every layer as bf16) per
CPU-second of the verifying thread, best of `--repeat`, so a busy machine does not distort it. Target
(issue 16): full decoding >= 1 GB/s/core for every codec.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common.synth import make_cache
from dflash.shards import Cache, verify_cache
from dflash.shards.codecs import codec_names


def bench(args: argparse.Namespace, root: Path) -> list[dict]:
    results = []
    for codec in args.codecs.split(","):
        path = root / codec
        lengths = [args.tokens] * args.samples
        make_cache(path, lengths, layers=tuple(range(args.layers)), hidden=args.hidden, codec=codec)
        for quick in (False, True):
            best_cpu, best_wall, report = float("inf"), float("inf"), None
            for _ in range(args.repeat):
                with Cache.open(path) as cache:
                    t_cpu, t_wall = time.thread_time(), time.perf_counter()
                    report = verify_cache(cache, dataset_rows=len(lengths), quick=quick)
                    best_cpu = min(best_cpu, time.thread_time() - t_cpu)
                    best_wall = min(best_wall, time.perf_counter() - t_wall)
            assert report is not None and report.ok, report.lines()
            decoded = args.samples * args.tokens * (4 + 1 + args.layers * args.hidden * 2)
            results.append(
                {
                    "codec": codec,
                    "mode": "quick" if quick else "full",
                    "stored_mb": report.bytes_checked / 1e6,
                    "decoded_mb": decoded / 1e6,
                    "cpu_s": best_cpu,
                    "wall_s": best_wall,
                    "gbs_per_core": decoded / best_cpu / 1e9,
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per sample")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--repeat", type=int, default=3, help="best of N timings")
    p.add_argument("--tiny", action="store_true", help="small sizes (smoke run)")
    p.add_argument("--codecs", default=",".join(codec_names()), help="comma-separated (default: all)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.tiny:
        args.samples, args.tokens, args.hidden, args.layers, args.repeat = 2, 128, 256, 2, 1
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        results = bench(args, Path(d))
    print(
        f"verify: {args.samples} samples x {args.tokens} tokens, {args.layers} layers x hidden {args.hidden}"
    )
    print(f"{'codec':<10}{'mode':<7}{'stored MB':>11}{'decoded MB':>12}{'cpu s':>8}{'GB/s/core':>11}")
    for r in results:
        print(
            f"{r['codec']:<10}{r['mode']:<7}{r['stored_mb']:>11.1f}{r['decoded_mb']:>12.1f}"
            f"{r['cpu_s']:>8.3f}{r['gbs_per_core']:>11.2f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
