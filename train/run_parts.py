"""Everything a run needs before its drafter exists, checked against each other (`Trainer.build`'s first half).

    open_run(cfg, clock) -> RunParts(info, cache, frozen, drafter_cfg, spec)
        process group and device; the --out rule, rank 0's lock on RUN/.lock (a second trainer or a --resume
        started meanwhile is refused, naming the holder), interrupted saves cleaned, seeds; the cache; then
        `checked_parts`; the frozen weights copied to the device as stored, NaN/inf-counted there
        (`guards.check_frozen_finite`), then cast there to the compute dtype.
    checked_parts(cfg, cache, clock) -> (frozen, drafter_cfg, spec)
        the checks that write nothing (`--dry-run` makes them too): every listed shard present at its
        recorded size (stat only); target/'s files against the manifest's digests (`shards.target_files`:
        zeroed bytes in the frozen weights are finite, no later check sees them); the frozen target parts
        and the layers and drafter shape they imply, checked against the cache (`cache_checks.check_cache`,
        `guards.check_trainable`); then `--epochs` pinned on cfg where it was left out (`settle_epochs`).
Each piece is timed into the launch's `StartupClock` (`startup.py`). On failure the cache is closed.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from dflash.shards import Cache, ShardError
from dflash.shards.layers import resolve_layer_ids
from dflash.shards.locks import FileLock, refuse_if_held, take_lock
from dflash.shards.outdir import claim_out_dir
from dflash.shards.paths import LOCK_NAME
from dflash.shards.row_ledger import unaccounted_rows
from dflash.shards.target_files import check_target_files
from dflash.shards.urls import is_url

from . import checkpoint as ckpt
from .cache_checks import check_cache
from .checkpoint_files import read_meta
from .config import TrainConfig
from .data_spec import DataSpec, read_eval_rows
from .drafter_config import DrafterConfig
from .frozen import FrozenTarget, load_frozen_target
from .guards import check_frozen_finite, check_trainable
from .parallelize import DistInfo, barrier, init_distributed
from .schedule import DEFAULT_EPOCHS_RULE, batches_per_epoch, default_epochs
from .startup import StartupClock

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunParts:
    info: DistInfo
    cache: Cache
    frozen: FrozenTarget  # on info.device, in the compute dtype
    drafter_cfg: DrafterConfig
    spec: DataSpec
    lock: FileLock | None  # rank 0's lock on the run directory, held until the run closes


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def check_resume_rule(cfg: TrainConfig) -> None:
    """A run directory that holds checkpoints is continued only with --resume, never trained over."""
    if not cfg.resume and ckpt.list_checkpoints(cfg.out):
        raise ValueError(
            f"{cfg.out} already holds checkpoints: pass --resume to continue, or choose a new --out"
        )


def open_run(cfg: TrainConfig, clock: StartupClock) -> RunParts:
    """The run's parts, each checked against the others; see the module docstring."""
    with clock.phase("process_group"):
        info = init_distributed(cfg.device)
    if cfg.attention == "flex" and info.device.type != "cuda":
        raise ValueError(
            f"--attention flex needs a CUDA device: FlexAttention has no backward on {info.device.type}; "
            "use --attention auto (the default) or dense"
        )
    run_dir = Path(cfg.out)
    lock = None
    try:
        with clock.phase("run_dir"):
            if info.is_main:
                claim_out_dir(run_dir, "run")  # the --out rule, before anything is cleaned up or written
                # Before the cleanup: another trainer's temp checkpoint is not an interrupted save. Rank 0
                # speaks for its process group (the other ranks write nothing in the run directory).
                lock = lock_run_dir(run_dir)
                for action in ckpt.clean_interrupted_saves(run_dir):
                    log.warning("interrupted checkpoint write: %s", action)
            barrier(info)
            check_resume_rule(cfg)
            seed_everything(cfg.seed)
        with clock.phase("cache_open"):
            cache = cfg.open_cache()
        if info.is_main and is_url(cfg.cache) and not cfg.data.shard_cache_gb:
            client = getattr(cache.storage, "read_client", "fsspec")
            cost = "~0.5-1.5 ms of CPU each through obstore" if client == "obstore" else "~2-3 ms of CPU each"
            log.info(
                "%s: read by range requests, one per sample (%s, in this process): a fast drafter can run "
                "slower than from a local disk (2.6x on the quality benchmark's, through s3fs); "
                "--shard-cache-dir DIR --shard-cache-gb N keeps whole shards on a local disk (BENCHMARKS.md)",
                cfg.cache,
                cost,
            )
    except BaseException:
        release_lock(lock)
        raise
    try:
        frozen, drafter_cfg, spec = checked_parts(cfg, cache, clock)
        frozen = _frozen_on_device(frozen, cache, info.device, clock)
        return RunParts(info, cache, frozen, drafter_cfg, spec, lock)
    except BaseException:
        cache.close()
        release_lock(lock)
        raise


def lock_run_dir(run_dir: Path) -> FileLock:
    """The run directory's writer lock (`RUN/.lock`, as a cache's), held by rank 0 until the run closes."""
    return take_lock(run_dir / LOCK_NAME, _busy(run_dir), command="dflash-train")


def check_run_unlocked(run_dir: Path) -> None:
    """`lock_run_dir`'s refusal, for the dry run (which takes no lock)."""
    refuse_if_held(run_dir / LOCK_NAME, _busy(run_dir))


def _busy(run_dir: Path) -> str:
    return f"{run_dir} is being written by another dflash-train"


def release_lock(lock: FileLock | None) -> None:
    if lock is not None:
        lock.release()


def checked_parts(
    cfg: TrainConfig, cache: Cache, clock: StartupClock
) -> tuple[FrozenTarget, DrafterConfig, DataSpec]:
    """The frozen target (mmap'd, as stored), the drafter's shape and the data spec of `cfg` on `cache`, each
    checked against the others, after the shards (stat) and `target/` (digests); nothing is written."""
    with clock.phase("cache_open"):  # timed in two parts: Cache.open, then this stat pass
        check_shard_files(cache, cfg.data.on_corrupt)
    with clock.phase("target_files"):  # every byte as extraction wrote it, before any is read or trusted
        check_target_files(cache.path, cache.manifest.target_files)
    with clock.phase("frozen_read"):  # headers and config: the weights stay mmap'd, unread
        frozen = load_frozen_target(cache.path, mask_token_id=cfg.drafter.mask_token_id)
        layer_ids = resolve_layer_ids(
            frozen.num_layers,
            cfg.drafter.num_draft_layers,
            cfg.drafter.target_layer_ids,
            cached=cache.layers,
        )
        drafter_cfg = DrafterConfig.from_target_config(
            frozen.config,
            mask_token_id=frozen.mask_token_id,
            num_hidden_layers=cfg.drafter.num_draft_layers,
            block_size=cfg.drafter.block_size,
            target_layer_ids=layer_ids,
        )
        check_cache(cache, frozen, drafter_cfg)
        check_trainable(cache, frozen)
        check_distill(cfg.drafter.distill, frozen, cache.layers)
        why = settle_epochs(cfg, cache)
        if why:
            log.info("%d epochs: %s", cfg.optim.epochs, why)
        spec = DataSpec.for_run(cfg, drafter_cfg, read_eval_rows(cfg.data.eval_rows))
    return frozen, drafter_cfg, spec


def settle_epochs(cfg: TrainConfig, cache: Cache) -> str | None:
    """Pins `--epochs` on `cfg` where it was left out, and says why: a resumed run keeps its own (its length was
    set when it started, under whatever default then held), a new one gets `schedule.default_epochs` for this
    cache. None: given. Every later reader of the config (data spec, schedule, checkpoints) sees the number."""
    if cfg.optim.epochs is not None:
        return None
    found = ckpt.resume_point(cfg.out, cfg.resume_from) if cfg.resume else None
    try:
        saved = read_meta(found)["config"].get("epochs") if found is not None else None
    except (ValueError, OSError):  # a damaged checkpoint: the resume itself refuses it, naming an intact one
        saved = None
    if isinstance(saved, int) and saved > 0:
        cfg.optim.epochs = saved
        return f"the resumed run's ({found})"
    cfg.optim.epochs = default_epochs(cache.manifest, cfg)
    per_epoch = batches_per_epoch(cache.manifest, cfg)
    return f"dflash-train's default for {per_epoch:,} batches an epoch ({DEFAULT_EPOCHS_RULE})"


def check_distill(alpha: float, frozen: FrozenTarget, cached: Sequence[int]) -> None:
    """Distillation reads the target's last layer (a feature or not) through its final norm: both must be
    in the cache."""
    if alpha <= 0:
        return
    last = frozen.num_layers - 1
    if last not in cached:
        raise ValueError(
            f"--distill needs the target's last layer ({last}) in the cache, which holds {list(cached)}: "
            f"extract with --layers including {last} (or --layers all)"
        )
    if frozen.final_norm_gain is None:
        raise ValueError(
            "--distill: this cache's target/ has no final norm gain (written by an older dflash-extract); "
            "re-run the same dflash-extract command on the cache to add it"
        )


def check_shard_files(cache: Cache, on_corrupt: str) -> None:
    """Every listed shard present at its recorded size, by stat alone, and the manifest accounting for every
    dataset row: under --on-corrupt fail a missing or truncated shard, or rows no entry lists, are refused now,
    not found missing hours in (or never); under skip they are named once."""
    gap = unaccounted_rows(cache.manifest, cache.path)
    if gap is not None:
        if on_corrupt == "fail":
            raise ShardError(
                f"{cache.path}: {gap}: a shard's entry removed from manifest.json? (`dflash-shards verify` "
                "names the rows; pass --on-corrupt skip to train on the rows it lists)"
            )
        log.warning("%s: %s; training on the rows it lists (--on-corrupt skip)", cache.path, gap)
    problems = list(cache.shard_file_problems().values())
    if not problems:
        return
    listed = len(cache.manifest.shards)
    first = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    if on_corrupt == "fail":
        raise ShardError(
            f"{len(problems)} of {listed} shards are not as the manifest records: {first} (restore them, or "
            "pass --on-corrupt skip to train without them; `dflash-shards verify` checks every shard)"
        )
    log.warning("%d of %d shards will be skipped (--on-corrupt skip): %s", len(problems), listed, first)


def _frozen_on_device(
    frozen: FrozenTarget, cache: Cache, device: torch.device, clock: StartupClock
) -> FrozenTarget:
    """The frozen weights copied to `device` as stored, NaN/inf-counted there (a GPU counts 2 x [151936, 4096]
    in milliseconds; the counts are the file's), then cast there to the compute dtype (bf16 on CUDA, fp32 on
    the CPU): one blocking `.to(device, dtype)` would cast on the host first. A bf16 file trained in bf16
    (what extraction writes) is copied once, straight from the mmap'd file, and never cast."""
    with clock.phase("frozen_to_device"):
        frozen = frozen.to(device=device)
    with clock.phase("frozen_check"):
        check_frozen_finite(cache, frozen)
    with clock.phase("frozen_to_device"):
        return frozen.to(dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
