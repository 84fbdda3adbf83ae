"""`bench/bench_train_step.py`'s command line: its sections, variants and the shapes each section times."""

from __future__ import annotations

import argparse

import torch
from dflash.train.block_mask import tile_shape

from bench.step_variants import VARIANTS

SECTIONS = ("step", "agree", "vary", "small", "first", "curve")


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The arguments with each size's defaults filled in (tiny shapes: a CPU smoke run) and lists split."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument("--sections", default=None, help=f"comma-separated, of {','.join(SECTIONS)}")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--profile-steps", type=int, default=2)
    parser.add_argument("--small-steps", type=int, default=None)
    parser.add_argument(
        "--small-packs",
        type=int,
        default=1,
        help="distinct pack shapes cycled in [small] (2+: dynamic shapes)",
    )
    parser.add_argument(
        "--small-budgets", default="8192", help="[small]: comma-separated token budgets, one pack shape each"
    )
    parser.add_argument(
        "--small-lengths", default="1450,3072", help="[small]: LOW,HIGH sequence lengths packed (uniform)"
    )
    parser.add_argument("--small-layers", type=int, default=3, help="[small]: drafter layers")
    parser.add_argument("--small-variants", default="before,new", help="[small]: step variants")
    parser.add_argument(
        "--flex-compile-mode",
        help="[small]: torch.compile mode of FlexAttention (e.g. max-autotune-no-cudagraphs: autotuned kernel "
        "tiles, which tiles under 128 need on sm90)",
    )
    parser.add_argument(
        "--flex-tiles",
        default="128x128",
        help="[small]: comma-separated QxKV BlockMask tile shapes to compare",
    )
    parser.add_argument("--vary-steps", type=int, default=3)
    parser.add_argument("--curve-steps", type=int, default=200)
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--precision", choices=("bf16", "amp"), default="amp")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="for the new step")
    parser.add_argument(
        "--time-budget", type=float, default=390.0, help="seconds; later sections are skipped"
    )
    parser.add_argument("--first-step-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None, help="write the results here (after every section)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.tiny else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.small_steps = args.small_steps or (2 if args.tiny else 20)
    args.profile_steps = 1 if args.tiny else args.profile_steps
    args.variants = [v for v in args.variants.split(",") if v]
    args.small_budgets = [int(b) for b in args.small_budgets.split(",")]
    args.small_lengths = tuple(int(n) for n in args.small_lengths.split(","))
    args.small_variants = [v for v in args.small_variants.split(",") if v]
    args.flex_tiles = [tile_shape(tuple(int(n) for n in t.split("x"))) for t in args.flex_tiles.split(",")]
    default = "step,small,agree,curve" if args.tiny else "step,small,agree"
    args.sections = (args.sections or default).split(",")
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    return args
