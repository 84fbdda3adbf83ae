"""`dflash-shards`: inspect, check and plan hidden-state caches.

    dflash-shards info CACHE            samples, tokens, bytes, ratio, layers, codec, target, dataset
    dflash-shards ls CACHE              shards with rows, tokens, bytes
    dflash-shards show CACHE ROW        one row: length, supervised tokens, per-layer mean/std/absmax/NaN
    dflash-shards stats CACHE [--sample N]   per-layer statistics over N rows, length histogram
    dflash-shards verify CACHE [--dataset PATH] [--quick]   decode every frame (ids in vocabulary, mask
                                        agrees with the index, no NaN/inf); --quick only re-hashes;
                                        exit 0 only if all is well
    dflash-shards plan ARGS...          `dflash-extract --dry-run ARGS...` (sizes and costs per codec, units, free space)
    dflash-shards convert CACHE --codec C --out NEW   re-encode (e.g. lossless -> q4) without the target; resumable

Every subcommand takes --json. Exit codes: 0 ok, 1 verify found problems, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from dflash.shards.cache import Cache
from dflash.shards.cli import DefaultsHelp, run_main
from dflash.shards.codecs import codec_names
from dflash.shards.convert import ConvertConfig, convert_cache
from dflash.shards.publish import remote_output, retried_text
from dflash.shards.sizes import size_text
from dflash.shards.summary import cache_info, cache_stats, sample_report, shard_list
from dflash.shards.urls import check_url, is_url, local_path
from dflash.shards.verify import verify_cache

from .shards_text import info_text, verify_text

PROG = "dflash-shards"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_, formatter_class=DefaultsHelp)
        sp.add_argument("cache", help="cache directory (holds manifest.json), or s3://bucket/prefix")
        sp.add_argument("--json", action="store_true", help="print one JSON object")
        return sp

    add("info", "cache summary")
    add("ls", "list shards")
    show = add("show", "one sample's statistics")
    show.add_argument("row", type=int, help="dataset row id")
    stats = add("stats", "per-layer activation statistics and a length histogram")
    stats.add_argument("--sample", type=int, default=64, help="rows to decode (default 64)")
    stats.add_argument("--seed", type=int, default=0, help="seeds which rows are sampled")
    verify = add("verify", "decode every frame, check index/manifest and row coverage")
    verify.add_argument("--dataset", help="tokenized dataset: every row must be stored once or skipped")
    verify.add_argument(
        "--quick", action="store_true", help="only re-hash the stored bytes (no decoding: faster, weaker)"
    )
    convert = add("convert", "re-encode every shard with another codec into a new cache (resumable)")
    convert.add_argument("--codec", required=True, choices=codec_names(), help="the new cache's codec")
    convert.add_argument(
        "--out", required=True, help="the new cache directory or s3://bucket/prefix (re-run to resume)"
    )
    convert.add_argument(
        "--stage-dir", help="--out URL only: the local directory the new cache is built in before upload"
    )
    convert.add_argument("--threads", type=int, default=0, help="encode threads (default: one per core)")
    convert.add_argument(
        "--device",
        default="cpu",
        help="where fp8/q6/q4 quantize (default cpu; cuda: groups of samples go to the GPU and back, "
        "decoding and zstd stay on the CPU cores)",
    )
    plan = sub.add_parser("plan", help="dflash-extract --dry-run with these arguments", add_help=False)
    plan.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _dataset_identity(path: str) -> tuple[int, dict[str, Any] | None]:
    """The dataset's row count and fingerprint (rows, lengths, tokens: what `verify --dataset` compares with
    the manifest's), or only its row count where dflash.extract is not importable."""
    try:
        from dflash.extract.dataset import open_dataset
    except ImportError as exc:  # extract not importable here: count rows with pyarrow directly
        import pyarrow.dataset as pads

        print(
            f"{PROG}: note: dflash.extract unavailable ({exc}); counting rows with pyarrow", file=sys.stderr
        )
        return pads.dataset(path, format="arrow").count_rows(), None
    fingerprint = open_dataset(path).fingerprint()
    return fingerprint["rows"], fingerprint


def _fields(d: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items())


def _convert(args: argparse.Namespace) -> int:
    def convert(out: str):  # -> ConvertResult
        return convert_cache(
            ConvertConfig(
                source=args.cache, out=out, codec=args.codec, threads=args.threads, device=args.device
            )
        )

    if is_url(args.out) and not args.out.startswith("file://"):  # built in a staging dir, then published
        check_url(args.out, "--out")
        with remote_output(args.out, args.stage_dir, f"{PROG} convert") as staged:
            if staged is None:
                print(f"{args.out} is already a complete cache: nothing to convert")
                return 0
            result = convert(staged)
        if retried_text():
            print(f"{PROG}: note: {retried_text().lstrip('; ')}", file=sys.stderr)
    else:
        result = convert(args.out)
    if args.json:
        print(json.dumps({**result.to_dict(), "out": args.out}, indent=1))
        return 0
    fewer = result.bytes_in / result.bytes_out if result.bytes_out else 0.0
    print(
        f"converted {result.converted} of {result.shards} shards ({result.rows:,} rows) to {result.codec} in "
        f"{result.seconds:.1f} s: {result.size_in.text()} -> {result.size_out.text()} ({fewer:.2f}x fewer "
        f"stored bytes than the source); check it with `{PROG} verify {args.out}`"
    )
    return 0


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        # Forwarded before parsing: argparse's REMAINDER drops a leading `--flag` inside a subcommand.
        from dflash.extract.cli import main as extract_main

        return extract_main(["--dry-run", *argv[1:]])
    args = _parser().parse_args(argv)
    if args.command == "show" and args.row < 0:
        raise ValueError(f"ROW must be a dataset row id >= 0, got {args.row}")
    if args.command == "stats" and args.sample < 1:
        raise ValueError(f"--sample must be >= 1, got {args.sample}")
    if args.command == "convert":
        return _convert(args)
    if getattr(args, "dataset", None):
        local_path(args.dataset, "--dataset")
    # These commands inspect and report: a row stored twice is what `verify` is there to list, not refuse.
    with Cache.open(args.cache, require_complete=False, unique_rows=False) as cache:
        if args.command == "info":
            out: Any = cache_info(cache)

            def text(d: dict) -> None:
                print(info_text(d))

        elif args.command == "ls":
            out = {"shards": shard_list(cache)}

            def text(d: dict) -> None:
                print(f"{'shard':<20}{'rows':>10}{'tokens':>14}{'bytes':>14}")
                for s in d["shards"]:
                    print(f"{s['name']:<20}{s['rows']:>10,}{s['tokens']:>14,}{size_text(s['bytes']):>14}")
        elif args.command == "show":
            out = sample_report(cache, args.row)

            def text(d: dict) -> None:
                print(f"row {d['row']}: {d['length']} tokens, {d['supervised']} supervised")
                for layer, s in d["layers"].items():
                    print(f"  layer {layer:>3}: " + _fields(s))
        elif args.command == "stats":
            out = cache_stats(cache, sample=args.sample, seed=args.seed)

            def text(d: dict) -> None:
                print(f"{d['rows_sampled']} of {d['rows']} rows sampled ({d['tokens_sampled']:,} tokens)")
                for layer, s in d["layers"].items():
                    print(f"  layer {layer:>3}: " + _fields(s))
                print("lengths: " + _fields(d["lengths"]))
                for b in d["length_histogram"]:
                    print(f"  ({b['lo']:>6}, {b['hi']:>6}]  {b['count']}")
        else:
            rows, fingerprint = _dataset_identity(args.dataset) if args.dataset else (None, None)
            report = verify_cache(cache, dataset_rows=rows, quick=args.quick, dataset=fingerprint)
            out = report.to_dict()

            def text(d: dict) -> None:
                print(verify_text(d, report.lines()))

        if args.json:
            print(json.dumps(out, indent=1))
        else:
            text(out)
        if args.command == "verify" and not out["ok"]:
            return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
