"""`dflash-train --dry-run`: every check a run makes before its first step, and what the run will cost,
without a GPU, a process group or a byte written.

    dry_run(cfg, world_size) -> dict    the checked plan (cache, drafter, schedule, checkpoint disk)
    print_plan(plan)                    a short table of it

Why: a training job waits in a queue for GPUs, then runs for days. A cache whose target/ was damaged, a
layer list the cache does not hold, a mask id the tokenizer uses, a `--resume` whose settings or cache its
checkpoint refuses, or a disk too small for the checkpoints should be found on the login node, before any of
that. A resume's plan is its own: the step it resumes at, and where its schedule ends when the command changes
the run's length or world size (`schedule.resumed_schedule`).
"""

from __future__ import annotations

import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from dflash.shards.layers import layer_ids_reason
from dflash.shards.outdir import check_out_dir
from dflash.shards.sizes import size_text

from .checkpoint import resume_point
from .config import TrainConfig
from .guards import check_frozen_finite
from .model import DFlashDrafter
from .resume_checks import ended_by_early_stop, naming_older_intact, read_resume_state
from .run_parts import check_resume_rule, check_run_unlocked, checked_parts, settle_epochs
from .schedule import Schedule, estimate_total_steps, resumed_schedule
from .startup import StartupClock

# A checkpoint holds the fp32 master weights and AdamW's two fp32 moments per parameter; RUN/best only the
# weights.
CHECKPOINT_BYTES_PER_PARAM = 12
BEST_BYTES_PER_PARAM = 4


def _free_bytes(path: Path) -> int:
    """Free space of the filesystem that will hold `path` (its nearest existing ancestor)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return shutil.disk_usage(Path.cwd()).free


def dry_run(cfg: TrainConfig, world_size: int = 1) -> dict[str, Any]:
    """The run's start-up checks (out dir, resume rule, target digests, frozen parts, layers, mask id, data
    spec, NaN/inf in the frozen weights) and its plan; raises as the run would, writes nothing."""
    out = Path(cfg.out)
    resuming = check_out_dir(out, "run")
    check_resume_rule(cfg)
    if resuming:
        check_run_unlocked(out)  # the run would be refused while another trainer writes it
    # a --resume-from that is not one of the run's checkpoints is refused here
    found = resume_point(out, cfg.resume_from) if resuming and cfg.resume else None
    with cfg.open_cache() as cache:
        epochs_why = settle_epochs(cfg, cache)  # checked_parts would pin it too, without telling the plan why
        frozen, drafter_cfg, spec = checked_parts(cfg, cache, StartupClock())
        check_frozen_finite(cache, frozen)
        manifest = cache.manifest
        schedule, resume_step, moved = Schedule(estimate_total_steps(manifest, cfg, world_size)), None, []
        ended_early = False  # a resume of a run --early-stop ended trains nothing while the rule is on
        if found is not None:  # what the resume would refuse, and where its schedule would end
            with naming_older_intact(out, found):
                meta, position = read_resume_state(found, cfg.to_flat(), manifest)
            resume_step = meta["step"]
            ended_early = ended_by_early_stop(meta, cfg)
            schedule, moved = resumed_schedule(meta, cfg, manifest, world_size, position)
        with torch.device("meta"):  # shapes only: no memory, no init
            params = sum(p.numel() for p in DFlashDrafter(drafter_cfg).parameters() if p.requires_grad)
        checkpoint = params * CHECKPOINT_BYTES_PER_PARAM
        # `keep_checkpoints` committed, the one being written before the oldest is removed, and RUN/best.
        checkpoints_disk = checkpoint * (cfg.keep_checkpoints + 1) + params * BEST_BYTES_PER_PARAM
        return {
            "cache": cache.location,
            "codec": manifest.codec.get("name"),
            "rows": manifest.rows,
            "tokens": manifest.tokens,
            "skipped": dict(Counter(str(s.get("reason", "?")) for s in manifest.skipped)),
            "target_layers": list(drafter_cfg.target_layer_ids),
            "target_layers_why": layer_ids_reason(
                frozen.num_layers,
                cfg.drafter.num_draft_layers,
                cfg.drafter.target_layer_ids is not None,
                cached=cache.layers,
            ),
            "draft_layers": drafter_cfg.num_hidden_layers,
            "block_size": drafter_cfg.block_size,
            "num_anchors": cfg.drafter.num_anchors,
            "lr": cfg.optim.lr,
            "mask_token_id": drafter_cfg.mask_token_id,
            "hidden_size": drafter_cfg.hidden_size,
            "params": params,
            "world_size": world_size,
            "epochs": cfg.optim.epochs,
            "epochs_why": epochs_why,  # None: --epochs given
            "max_steps": cfg.optim.max_steps,
            "total_steps": schedule.total,
            "schedule_restarts": resume_step is not None and schedule.restarts_at(resume_step),
            "warmup_steps": schedule.warmup_steps(cfg.optim),
            "heldout_fraction": spec.heldout_fraction,
            "heldout_rows": len(spec.heldout_rows),
            "eval_every": cfg.eval_every,
            "early_stop": cfg.early_stop,
            "out": str(out),
            "resume": bool(resuming and cfg.resume),
            "resume_step": resume_step,  # None: a new run, or a --resume with no checkpoint yet
            "ended_early": ended_early,
            "schedule_moved": moved,  # what changes a resumed run's schedule from its checkpoint's (none: kept)
            "checkpoint_bytes": checkpoint,
            "checkpoints_disk_bytes": checkpoints_disk,
            "free_bytes": _free_bytes(out),
        }


def print_plan(plan: dict[str, Any]) -> None:
    fits = plan["checkpoints_disk_bytes"] <= plan["free_bytes"]
    steps = f"~{plan['total_steps']:,} optimizer steps ({plan['epochs']} epochs"
    steps += f": {plan['epochs_why']}" if plan["epochs_why"] else ""
    steps += f", capped by --max-steps {plan['max_steps']}" if plan["max_steps"] else ""
    steps += f", world {plan['world_size']}), warmup {plan['warmup_steps']:,}, lr {plan['lr']:g}"
    if plan["schedule_moved"]:
        moved = ", ".join(plan["schedule_moved"])
        if plan["schedule_restarts"]:
            steps += (
                f"; the run had finished: its schedule restarts at step {plan['resume_step']:,} ({moved})"
            )
        else:
            steps += f"; the resumed schedule ends there now ({moved})"
    resumes = "a new run"
    if plan["resume"]:
        step = plan["resume_step"]
        resumes = (
            f"resumes at step {step:,}" if step is not None else "--resume, no checkpoint yet: from scratch"
        )
        if plan["ended_early"]:
            resumes += ", where --early-stop ended the run: nothing to train; --early-stop 0 trains on"
    held = f"{plan['heldout_fraction']:.1%} of the rows"
    held += f" and {plan['heldout_rows']:,} rows from --eval-rows" if plan["heldout_rows"] else ""
    held += ", never trained on"
    if plan["eval_every"]:
        held += f"; evaluated every {plan['eval_every']:,} steps"
        if plan["early_stop"]:
            held += f", the run ends at a walk {100 * plan['early_stop']:g}% below its best (--early-stop)"
    lines = [
        ("cache", f"{plan['cache']} ({plan['codec']}, {plan['rows']:,} rows, {plan['tokens']:,} tokens)"),
        (
            "not cached",
            ", ".join(f"{n:,} {why}" for why, n in sorted(plan["skipped"].items()))
            + " (rows extraction skipped)"
            if plan["skipped"]
            else "none: every dataset row is in the cache",
        ),
        (
            "drafter",
            f"{plan['draft_layers']} layers, hidden {plan['hidden_size']}, block {plan['block_size']}, "
            f"{plan['num_anchors']} anchors, "
            f"{plan['params'] / 1e6:.1f}M trained parameters, mask token {plan['mask_token_id']}",
        ),
        ("features", f"target layers {plan['target_layers']}: {plan['target_layers_why']}"),
        ("schedule", steps),
        ("held out", held),
        (
            "checkpoints",
            f"{size_text(plan['checkpoint_bytes'])} each, up to {size_text(plan['checkpoints_disk_bytes'])} on disk; "
            f"{size_text(plan['free_bytes'])} free under {plan['out']}: {'fits' if fits else 'DOES NOT FIT'}",
        ),
        ("out", f"{plan['out']} ({resumes})"),
    ]
    for name, text in lines:
        print(f"{name:12s}{text}")
    print(
        "checks      passed: target digests, frozen weights finite, layers, mask token, data spec, --out rule"
    )


def world_size_from_env() -> int:
    """The WORLD_SIZE torchrun would set (1 outside torchrun): the step count divides by it."""
    text = os.environ.get("WORLD_SIZE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(
            f"WORLD_SIZE={text!r:.40}: expected a whole number >= 1 (the processes torchrun starts)"
        )
    return int(text)
