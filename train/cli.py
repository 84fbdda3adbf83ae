"""`dflash-train`: train a DFlash drafter from a cache; `dflash-train export RUN_DIR --out DIR` exports one.

Flags mirror `TrainConfig`'s flat keys; `--config FILE` (JSON or TOML, same keys) is applied first and
flags given on the command line win. `--preset paper` starts from the DFlash paper's recipe as published,
`--preset tiny` from the CPU smoke-test preset.
Launch on N GPUs with `torchrun --nproc-per-node N dflash-train ...`.
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash.shards.cli import DefaultsHelp, run_main
from dflash.shards.errors import DiskFull
from dflash.shards.outdir import claim_out_dir
from dflash.shards.urls import local_path

from .config import (
    ATTENTION_CHOICES,
    DEVICE_CHOICES,
    ON_CORRUPT_CHOICES,
    SLOT_WEIGHT_CHOICES,
    default_recipe,
    paper_recipe,
    tiny_debug,
)
from .config_file import load_config_file
from .data_plan import ORDERS
from .metrics import read_metrics
from .schedule import BASE_EPOCHS, MAX_EPOCHS, MIN_BATCHES
from .stop_signal import StopRequest, exit_code
from .verdict import evaluations, verdict

PRESETS = {"default": default_recipe, "paper": paper_recipe, "tiny": tiny_debug}

PROG = "dflash-train"


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        argument_default=argparse.SUPPRESS,
        description="Train a DFlash drafter from a dflash-extract cache (export a run: dflash-train export -h).",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("--config", help="JSON/TOML file of flag names -> values (flags given here override it)")
    p.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        help="starting point: default (the paper's recipe, --slot-weights reach), paper (as published) or tiny",
    )
    run = p.add_argument_group("run")
    run.add_argument("--cache", help="cache directory written by dflash-extract")
    run.add_argument("--out", help="run directory: checkpoints/, metrics.jsonl, plots/, export/")
    run.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    run.add_argument(
        "--resume-from",
        metavar="CHECKPOINT",
        help="continue from this checkpoint of --out (RUN/checkpoints/step_NNNNNN) instead of the latest",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="run every start-up check (no GPU needed, nothing written) and print the plan: drafter size, "
        "steps (world size from WORLD_SIZE), checkpoint disk against free space",
    )
    run.add_argument("--seed", type=int, help="seeds the drafter's init, the shuffle and the anchors")
    run.add_argument("--device", choices=DEVICE_CHOICES, help="auto: CUDA when there is one, else CPU")
    run.add_argument(
        "--attention",
        choices=ATTENTION_CHOICES,
        help="auto (default): dense SDPA for small batches or off CUDA, FlexAttention otherwise, dense if "
        "FlexAttention fails; dense or flex force one (flex: CUDA only, errors are fatal; the held-out "
        "decode walk still uses auto)",
    )
    run.add_argument(
        "--split-own-slots",
        action=argparse.BooleanOptionalAction,
        help="FlexAttention over the context keys only, each block's own slots attended apart and merged "
        "(same math; on the benchmark's full-size drafter on an H200 18.8 steps/s against 19.4 without; "
        "off by default)",
    )
    run.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="on CUDA (default on), torch.compile the drafter's norms, projections and MLPs and the loss "
        "epilogue (see BENCHMARKS.md); a compile failure falls back to eager",
    )
    run.add_argument("--eval-every", type=int, help="evaluate every N steps and at the end (0: never)")
    run.add_argument(
        "--early-stop",
        type=float,
        help="end the run at an evaluation whose held-out decode walk is this share below its best so far "
        "(RUN/export keeps the best; 0: train the whole schedule)",
    )
    run.add_argument("--save-every", type=int, help="checkpoint every N steps (and at the end)")
    run.add_argument("--log-every", type=int, help="write metrics every N steps")
    run.add_argument(
        "--keep-checkpoints", type=int, help="keep the N newest step checkpoints (best/ is separate)"
    )
    run.add_argument(
        "--no-tensorboard", dest="tensorboard", action="store_false", help="no RUN/tensorboard/ events"
    )
    run.add_argument("--no-plots", dest="plots", action="store_false", help="no RUN/plots/*.png")
    run.add_argument(
        "--no-progress",
        dest="progress",
        action="store_false",
        help="no progress bar (on a terminal) or progress line every few seconds (in a log)",
    )
    data = p.add_argument_group("data")
    data.add_argument("--token-budget", type=int, help="context tokens per micro-batch (samples are packed)")
    data.add_argument("--max-length", type=int, help="truncate samples to this many tokens")
    data.add_argument(
        "--loader-threads",
        type=int,
        help="decompression threads (with --loader-workers: in all, at least 2 per worker)",
    )
    data.add_argument(
        "--loader-workers",
        type=int,
        help="processes that read and pack batches, off the training process's GIL",
    )
    data.add_argument("--prefetch-batches", type=int, help="batches prepared ahead of the GPU")
    data.add_argument("--shuffle-window", type=int, help="samples in the shuffle buffer")
    data.add_argument(
        "--data-order",
        choices=ORDERS,
        help="an epoch's order: spans of the cache's stored order (the same batches from any codec's cache of "
        "one dataset) or shards (runs started before 2026-12-05 resume with it)",
    )
    data.add_argument(
        "--on-corrupt", choices=ON_CORRUPT_CHOICES, help="corrupt sample: skip (counted) or fail"
    )
    data.add_argument("--eval-fraction", type=float, help="fraction of rows held out (hash of the row id)")
    data.add_argument("--eval-rows", help="file of row ids to hold out (JSON list or one per line)")
    data.add_argument("--eval-samples", type=int, help="held-out samples used per evaluation")
    data.add_argument(
        "--shard-cache-dir",
        help="--cache URL only: where its manifest, target/ and downloaded shards are kept "
        "(default ~/.cache/dflash/remote)",
    )
    data.add_argument(
        "--shard-cache-gb",
        type=float,
        help="--cache URL only: keep up to this many GB of whole shards locally, so later epochs read the "
        "disk (default 0: every read is a range request)",
    )
    model = p.add_argument_group("drafter")
    model.add_argument("--num-draft-layers", type=int, help="drafter decoder layers")
    model.add_argument("--target-layer-ids", help="comma-separated target layer ids")
    model.add_argument("--block-size", type=int, help="B: the anchor plus B - 1 drafted tokens")
    model.add_argument("--num-anchors", type=int, help="anchors sampled per sequence")
    model.add_argument(
        "--copy-anchor-weight",
        type=float,
        help="odds of an anchor where prompt lookup would copy the whole block, against 1 where it copies "
        "nothing (in between by the share it copies; default 1: uniform)",
    )
    model.add_argument(
        "--copy-slot-weight",
        type=float,
        help="least loss weight of the slots prompt lookup would copy at an anchor, whatever the decay gives "
        "them (default 0: off)",
    )
    model.add_argument(
        "--gamma",
        type=float,
        help="loss decay over block positions: reach's floor (default 1), or with --slot-weights decay the "
        "decay itself (default by block size: 7 for B = 16)",
    )
    model.add_argument(
        "--slot-weights",
        choices=SLOT_WEIGHT_CHOICES,
        help="decay: exp(-(k-1)/gamma) (the paper); reach: follow the drafter's acceptance (slot_weights.py)",
    )
    model.add_argument("--mask-token-id", type=int, help="the mask token's id")
    model.add_argument(
        "--distill",
        type=float,
        help="share of the target's next-token distribution in each label, from its cached last layer "
        "(0: hard labels; needs the target's last layer in the cache)",
    )
    opt = p.add_argument_group("optimizer")
    opt.add_argument("--lr", type=float, help="AdamW peak learning rate")
    opt.add_argument("--min-lr-frac", type=float, help="the cosine ends at lr x this")
    opt.add_argument("--weight-decay", type=float, help="AdamW weight decay")
    opt.add_argument("--warmup-frac", type=float, help="linear warmup over this fraction of the steps")
    opt.add_argument("--grad-clip", type=float, help="clip the gradient norm to this (0: off)")
    opt.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    opt.add_argument(
        "--epochs",
        type=int,
        help="passes over the training rows",
    )
    opt.add_argument(
        "--max-steps", type=int, help="stop after N optimizer steps (also sets the schedule length)"
    )
    _show_preset_defaults(p)
    return p


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


# Defaults that the config leaves open (None) and start-up settles, said in words.
DEFAULTS_IN_WORDS = {
    "epochs": f"{BASE_EPOCHS}, or as many as make {MIN_BATCHES:,} batches, at most {MAX_EPOCHS}; --resume: its run's",
    "loader_workers": "4 on CUDA, 0 on a CPU (0: threads inside the training process)",
    "target_layer_ids": "the DFlash rule",
    "mask_token_id": "the first unused embedding row",
}


def _show_preset_defaults(p: argparse.ArgumentParser) -> None:
    """Every flag's help ends with its default (and the other presets' values where they differ).
    The parser itself has no defaults (SUPPRESS): a flag left out must not override --config."""
    flats = {name: preset("CACHE", "OUT").to_flat() for name, preset in PRESETS.items()}
    default = flats.pop("default")
    for action in p._actions:
        key = action.dest
        if key not in default or key in ("cache", "out", "resume"):
            continue
        text = f"default: {DEFAULTS_IN_WORDS.get(key) or _shown(default[key])}"
        for name, flat in flats.items():
            if flat[key] != default[key]:
                text += f"; --preset {name}: {_shown(flat[key])}"
        action.help = f"{action.help} ({text})" if action.help else f"({text})"


def _export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} export",
        description="Export a run's checkpoint as an HF drafter dir.",
        formatter_class=DefaultsHelp,
    )
    p.add_argument("run_dir", help="a dflash-train --out directory")
    p.add_argument(
        "--out", required=True, help="destination directory (config.json, model.safetensors, dflash.py)"
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    which.add_argument("--best", action="store_true", help="the best checkpoint by the held-out decode walk")
    return p


def build_config(argv: Sequence[str]) -> Any:
    return parse_command(argv)[0]


def parse_command(argv: Sequence[str]) -> tuple[Any, bool]:
    """(the run's TrainConfig, whether --dry-run was given)."""
    args = vars(_train_parser().parse_args(argv))
    dry = bool(args.pop("dry_run", False))
    values: dict[str, Any] = {}
    preset = args.pop("preset", "default")
    file = args.pop("config", None)
    if file is not None:
        values.update({k.replace("-", "_"): v for k, v in load_config_file(file).items()})
        preset = values.pop("preset", preset)
    values.update(args)
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: choose one of {', '.join(PRESETS)}")
    for name in ("cache", "out"):
        if name not in values:
            raise ValueError(f"{name} is required: pass --{name} or set it in the config file")
    return PRESETS[preset](**values), dry


def export_main(argv: Sequence[str]) -> int:
    from . import checkpoint as ckpt
    from .checkpoint_files import read_meta
    from .drafter_config import DrafterConfig
    from .export import export_drafter
    from .model import DFlashDrafter

    args = _export_parser().parse_args(argv)
    local_path(args.run_dir, "RUN_DIR")
    local_path(args.out, "--out")
    source = ckpt.find_checkpoint(args.run_dir, step=args.step, best=args.best)
    claim_out_dir(args.out, "export")  # the --out rule of every dflash command
    # Checked: a damaged meta.json is one line naming the field.
    meta = read_meta(source, require=("drafter",))
    drafter = dict(meta["drafter"])
    try:
        drafter["target_layer_ids"] = tuple(drafter["target_layer_ids"])
        config = DrafterConfig(**drafter)
        model = DFlashDrafter(config)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{source / 'meta.json'}: drafter settings do not build a drafter ({exc})") from None
    ckpt.load_weights(model, source / "model.safetensors")
    out = export_drafter(model, config, Path(args.out))
    print(f"exported step {meta['step']} of {args.run_dir} to {out}")
    return 0


def run_verdict(cfg: Any) -> list[str]:
    """What a finished run's evaluations say (`verdict`), read from its metrics.jsonl: the lines
    `dflash-train` (and the demo) ends with."""
    optim = cfg.optim
    return verdict(evaluations(read_metrics(cfg.out)), epochs=optim.epochs, max_steps=optim.max_steps)


def main_impl(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "export":
        return export_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg, dry = parse_command(argv)
    if dry:
        from .dry_run import dry_run, print_plan, world_size_from_env

        print_plan(dry_run(cfg, world_size_from_env()))
        return 0
    from .loop import train

    try:
        with StopRequest().installed() as stop:  # SIGTERM / SIGINT: a checkpoint at the next step, then exit
            result = train(cfg, stop)
    except OSError as exc:  # metrics, an export: what a checkpoint's own save says (`save_checkpoint`)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskFull(
            f"{exc.filename or cfg.out}: no space left on device; the checkpoints committed before are intact: "
            "free space, then continue with --resume"
        ) from None
    if result.stopped_by is not None:  # every rank ends as the signal asked, after rank 0's checkpoint
        if result.last_checkpoint is not None:
            print(
                f"{PROG}: stopped by {signal.Signals(result.stopped_by).name} after step {result.step}, "
                f"checkpoint {result.last_checkpoint}: continue with the same command and --resume",
                file=sys.stderr,
            )
        return exit_code(result.stopped_by)
    if result.last_checkpoint is not None:
        print(
            f"done: step {result.step}, checkpoint {result.last_checkpoint}"
            + (f", best decode walk {result.best_walk:.3f}" if result.best_walk is not None else "")
            + (
                f" (ended early: the walk fell more than --early-stop {cfg.early_stop:g} below it)"
                if result.ended_early
                else ""
            )
        )
        for line in run_verdict(cfg):
            print(line)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(main_impl, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
