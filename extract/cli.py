"""`dflash-extract`: run a frozen target over a tokenized dataset and write the hidden-state cache.

    dflash-extract --target DIR --dataset PATH --out CACHE [--layers 1,9,17|all | --num-draft-layers K]
                   [--codec lossless|fp8|q6|q4] [--max-len N] [--overlong truncate|skip] [--token-budget N]
                   [--dry-run] [--json] ...

`--dry-run` opens only the target's config.json and the dataset: it validates, plans and prints the
cache size per codec next to the free disk space. It imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from dflash.shards.cli import DefaultsHelp, run_main

from .config import CODECS, DTYPES, NONFINITE_POLICIES, OVERLONG_POLICIES, ColumnNames, ExtractConfig, GiB

PROG = "dflash-extract"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line through run_main, not argparse's usage block + exit.
        raise ValueError(f"{message} (see {PROG} --help)")


def _layers(text: str) -> list[int] | str:
    if text.strip() == "all":
        return "all"
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer ids like 1,9,17 or 'all', got {text!r}"
        ) from None


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a byte size like 1GiB or 536870912, got {text!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        formatter_class=DefaultsHelp,
    )
    p.add_argument(
        "--target", required=True, help="HF model directory of the frozen target (config.json + weights)"
    )
    p.add_argument(
        "--dataset", required=True, help="save_to_disk dir, Arrow IPC file/dir or Parquet file/dir"
    )
    p.add_argument(
        "--out",
        default=None,
        help="cache directory to write, or s3://bucket/prefix (any fsspec URL) (optional with --dry-run)",
    )
    p.add_argument(
        "--stage-dir",
        default=None,
        help="--out URL only: the local directory the cache is built in before upload (default: one per URL "
        "under ~/.cache/dflash/remote); re-use it to resume",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "--layers", type=_layers, default=None, help="target layer ids to capture, e.g. 1,9,17, or 'all'"
    )
    which.add_argument(
        "--num-draft-layers",
        type=int,
        default=None,
        help="K for the DFlash default layer rule (default 5 when --layers is not given)",
    )
    p.add_argument(
        "--codec",
        choices=CODECS,
        default="lossless",
        help="feature codec of the cache (each one's size, error and tau cost: --dry-run)",
    )
    p.add_argument("--max-len", type=int, default=3072, help="longest sequence extracted (tokens)")
    p.add_argument(
        "--overlong", choices=OVERLONG_POLICIES, default="truncate", help="what to do with longer rows"
    )
    p.add_argument("--token-budget", type=int, default=16384, help="padded tokens per forward batch")
    p.add_argument("--pad-multiple", type=int, default=1, help="round each batch's padded length up to this")
    p.add_argument(
        "--unit-size", type=_size, default=GiB, help="stored bytes per work unit / shard (e.g. 1GiB)"
    )
    p.add_argument("--input-ids-column", default="input_ids", help="dataset column of token id lists")
    p.add_argument(
        "--loss-mask-column",
        default="loss_mask",
        help="dataset column of 0/1 lists marking the supervised (assistant) tokens",
    )
    p.add_argument(
        "--seq-len-column", default="seq_len", help="used when present, else derived from the lists"
    )
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="compute dtype of the target")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the target's own modeling code")
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, torch.compile the target's attention, MLP and norms (+32%% tokens/s for a "
        "Qwen3-8B shape, +11%% for a Qwen3.5-27B one on an H200; ~20-60 s before the first batch; "
        "falls back to eager if compiling fails)",
    )
    p.add_argument("--force", action="store_true", help="skip the free-disk-space pre-flight check")
    p.add_argument(
        "--on-nonfinite",
        choices=NONFINITE_POLICIES,
        default="fail",
        help="a row whose hidden states hold NaN/inf (checked on the device): stop, or skip it (listed "
        "with its reason in the manifest's skipped rows)",
    )
    p.add_argument(
        "--allow-empty", action="store_true", help="write an empty cache when no row is left to extract"
    )
    p.add_argument(
        "--encode-threads", type=int, default=None, help="codec threads (default: from the CPU count)"
    )
    p.add_argument("--queue-depth", type=int, default=4, help="batches in flight between pipeline stages")
    p.add_argument(
        "--dry-run", action="store_true", help="validate and plan only; print sizes and free space"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def config_from_args(argv: Sequence[str] | None) -> ExtractConfig:
    args = build_parser().parse_args(argv)
    return ExtractConfig(
        target=args.target,
        dataset=args.dataset,
        out=args.out,
        layers=args.layers,
        num_draft_layers=args.num_draft_layers,
        codec=args.codec,
        max_len=args.max_len,
        overlong=args.overlong,
        token_budget=args.token_budget,
        pad_multiple=args.pad_multiple,
        unit_bytes=args.unit_size,
        columns=ColumnNames(
            input_ids=args.input_ids_column, loss_mask=args.loss_mask_column, seq_len=args.seq_len_column
        ),
        dtype=args.dtype,
        device=args.device,
        trust_remote_code=args.trust_remote_code,
        compile=args.compile,
        force=args.force,
        on_nonfinite=args.on_nonfinite,
        allow_empty=args.allow_empty,
        dry_run=args.dry_run,
        json=args.json,
        num_encode_threads=args.encode_threads,
        queue_depth=args.queue_depth,
        stage_dir=args.stage_dir,
    )


def run_config(config: ExtractConfig) -> int:
    """Run `config` as the command line does: the dry run, a local extraction, or one published to `--out URL`."""
    if config.dry_run:
        from .dryrun import run_dry_run

        run_dry_run(config)
        return 0
    from dflash.shards.publish import remote_output, retried_text

    from .pipeline import run_extraction  # torch + transformers: imported only for a real run
    from .units import RankInfo

    if config.publish_to is None or RankInfo.from_env().rank != 0:
        run_extraction(config)  # other ranks of an object-storage run write into the staging directory
        return 0
    note = sys.stderr if config.json else sys.stdout  # --json: stdout holds the one JSON object
    # Staging keeps only shards not yet uploaded: extraction reads committed ones through shards/published.py.
    with remote_output(config.publish_to, config.out, PROG, keep_local=False) as staged:
        if staged is None:
            print(f"{config.publish_to} is already a complete cache: nothing to extract", file=note)
            return 0
        run_extraction(config)
    print(f"published to {config.publish_to} (staged in {config.out}){retried_text()}", file=note)
    return 0


def _main(argv: Sequence[str] | None) -> int:
    return run_config(config_from_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(_main, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
