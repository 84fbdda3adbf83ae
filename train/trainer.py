"""One run's parts and its step: `Trainer.build` -> `resume` -> `loop.fit` (which calls `train_step`,
`evaluate_and_keep_best`, `save_step`) -> `close`.

Everything that decides the trajectory (weights, optimizer, schedule position, data position, anchors,
global RNGs) is in the checkpoint, so on the CPU a resumed run reproduces the uninterrupted losses bit
for bit. Checks, in the order they run: the cache's target parts and layers before the model is built
(`build`: `run_parts.open_run`), the checkpoint's settings and cache identity (`resume`), each
shard's identity when first opened (`Cache.shard`), a NaN/inf loss or gradient (`guards.FiniteGuard`,
read before anything is saved). The frozen weights' NaN/inf count runs once they are on the device
(`guards.check_frozen_finite`), before they are cast to the compute dtype there.

A `stop_signal.StopRequest` (the command line's SIGTERM / SIGINT) rides on `train_step`'s all-reduce, so
every rank learns of it in the same step and the loop ends there, with a checkpoint.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dflash.shards import Cache
from dflash.shards.locks import FileLock

from . import checkpoint as ckpt
from .checkpoint_files import CheckpointError
from .compiled import speed_up
from .config import TrainConfig
from .data_spec import DataSpec
from .drafter_config import DrafterConfig
from .evaluate import EvalSet, build_eval_set, evaluate
from .export import export_drafter
from .frozen import FrozenTarget
from .guards import FiniteGuard
from .loaded_batch import LoadedBatch
from .loader_procs import streaming_loader
from .loss import Distill, drafter_loss
from .mask import build_attention_mask
from .model import DFlashDrafter
from .parallelize import (
    DistInfo,
    all_reduce_sum,
    barrier,
    mixed_precision,
    no_sync_unless,
    shutdown,
    wrap_model,
)
from .resume_checks import cache_identity, ended_by_early_stop, naming_older_intact, read_resume_state
from .run_parts import open_run, release_lock
from .schedule import Schedule, estimate_total_steps, resumed_schedule
from .slot_weights import ReachWeights
from .startup import StartupClock
from .stop_signal import StopRequest
from .verdict import fell_below_best

log = logging.getLogger(__name__)
EXPORT_DIR = "export"


@dataclass(slots=True)
class StepResult:
    """One optimizer step on this rank: the weighted loss sum stays on the device (no sync per step)."""

    loss_sum: torch.Tensor
    weight_sum: float
    tokens: int
    grad_norm: torch.Tensor
    lr: float
    stop: bool  # a rank was asked to stop (`StopRequest`): every rank stops after this step


class Trainer:
    """One run's parts; `build` makes them, `loop.fit` trains them. `train_step` works on its own (tests call it)."""

    def __init__(
        self,
        cfg: TrainConfig,
        info: DistInfo,
        cache: Cache,
        frozen: FrozenTarget,
        drafter_cfg: DrafterConfig,
        spec: DataSpec,
        startup: StartupClock | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        self.cfg, self.info, self.cache, self.frozen = cfg, info, cache, frozen
        self.stop = stop or StopRequest()  # one nobody signals unless the command line installed it
        self.drafter_cfg, self.spec = drafter_cfg, spec
        # Evaluation reads the drafter's own features only: distillation's teacher layer is for the loss.
        self.eval_spec = dataclasses.replace(spec, layer_ids=drafter_cfg.target_layer_ids)
        self.run_dir = Path(cfg.out)
        self.run_lock: FileLock | None = None  # RUN/.lock, held by rank 0 from `build` to `close`
        self.startup = startup or StartupClock()  # this launch's set-up, timed to the end of its first step
        device = info.device
        self.loader = streaming_loader(cache, spec, rank=info.rank, world_size=info.world_size, device=device)
        self.loader.warm_up()  # loader processes start while the drafter is built and Dynamo imported
        # Initialised where it trains (seconds, not minutes, for a 1B-parameter drafter on a GPU); fp32
        # master weights, bf16 compute via autocast on CUDA.
        with self.startup.phase("drafter"), device:
            self.model = DFlashDrafter(drafter_cfg)
        with self.startup.phase("compile_setup"):  # imports Dynamo; nothing compiles before step 1
            speed_up(self.model, cfg.compile)  # compiled regions and loss epilogue on CUDA (issue 13)
        started = time.perf_counter()
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.optimizer = torch.optim.AdamW(
            [p for _, p in named],
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            weight_decay=cfg.optim.weight_decay,
            fused=device.type == "cuda" or None,
        )
        self.ddp_model = wrap_model(self.model, info)
        self.autocast = mixed_precision(device)
        self.step, self.best_walk, self.last_tau = 0, None, None
        # resumed where --early-stop ended the run, the rule still on: nothing to train
        self.ended_early = False
        self.schedule = Schedule(estimate_total_steps(cache.manifest, cfg, info.world_size))
        self.eval_set: EvalSet | None = None
        self.guard = FiniteGuard(cache, spec.layer_ids)  # a NaN/inf loss or gradient stops the run
        self.reach = (
            ReachWeights(drafter_cfg.block_size, cfg.drafter.loss_gamma, device)
            if cfg.drafter.slot_weights == "reach"
            else None
        )
        last = drafter_cfg.num_target_layers - 1  # DataSpec.for_run loads it when distilling
        self.distill = (
            Distill(cfg.drafter.distill, spec.layer_ids.index(last)) if cfg.drafter.distill > 0 else None
        )
        self.startup.add("optimizer", time.perf_counter() - started)

    @classmethod
    def build(cls, cfg: TrainConfig, stop: StopRequest | None = None) -> Trainer:
        """The run's parts (`setup.open_run`: process group, run directory, seeds, the cache and its frozen
        target, checked against each other), then the drafter, before any step runs."""
        clock = StartupClock()
        run = open_run(cfg, clock)
        try:
            trainer = cls(cfg, run.info, run.cache, run.frozen, run.drafter_cfg, run.spec, clock, stop)
        except BaseException:
            run.cache.close()
            release_lock(run.lock)
            raise
        trainer.run_lock = run.lock
        return trainer

    @property
    def max_steps(self) -> int:
        """Epochs end the run unless a step budget does."""
        return self.cfg.optim.max_steps or self.total_steps * 10**6

    @property
    def total_steps(self) -> int:
        return self.schedule.total

    @property
    def planned_steps(self) -> int:
        return min(self.total_steps, self.max_steps)

    def resume(self) -> bool:
        """Continue from the run directory's latest checkpoint (with `--resume`), after checking that it was
        written with the same settings and against this very cache. False when there is none."""
        found = ckpt.resume_point(self.run_dir, self.cfg.resume_from) if self.cfg.resume else None
        self._same_checkpoint_everywhere(found)
        if found is None:
            if self.cfg.resume:
                log.warning("--resume: %s holds no checkpoint yet; starting from scratch", self.run_dir)
            return False
        with naming_older_intact(self.run_dir, found):  # every file checked: a damaged one is one line
            meta, loader_state = read_resume_state(found, self.cfg.to_flat(), self.cache.manifest)
            ckpt.load_state(found, model=self.model, optimizer=self.optimizer, param_names=self.param_names)
        self.loader.load_state_dict(loader_state)
        # a run from before the walk chose the best has none: its next evaluation writes RUN/best again
        self.step, self.best_walk = meta["step"], meta.get("best_walk")
        self.ended_early = ended_by_early_stop(meta, self.cfg)
        saved = Schedule.saved(meta)
        self.schedule, changed = resumed_schedule(
            meta, self.cfg, self.cache.manifest, self.info.world_size, loader_state
        )
        if changed and self.info.is_main:
            log.info(
                "resume: %s: %s, to step %d (was %d); step %d's lr %.3g -> %.3g",
                ", ".join(changed),
                "the run had finished: its schedule restarts over the added steps, warmup and cosine"
                if self.schedule.restarts_at(self.step)
                else "the schedule now ends where the data does",
                self.schedule.total,
                saved.total,
                self.step,
                saved.lr(self.step, self.cfg.optim),
                self.schedule.lr(self.step, self.cfg.optim),
            )
        if self.reach is not None:
            if meta.get("slot_weights") is None:
                raise CheckpointError(f"{found / 'meta.json'}: missing field 'slot_weights'")
            self.reach.load_state_dict(meta["slot_weights"], is_main=self.info.is_main)
        return True

    def _same_checkpoint_everywhere(self, found: Path | None) -> None:
        """Every rank resumes from the same step: nodes without a shared filesystem each read their own run
        directory, and rank 0 alone writes checkpoints (copy its run directory to every node to resume)."""
        step = float(int(found.name.removeprefix("step_"))) if found is not None else -1.0
        total, squares = self.reduce_sum([step, step * step])
        world = self.info.world_size
        if squares / world - (total / world) ** 2 > 0.25:  # the steps differ between ranks
            seen = f"step {int(step)}" if found is not None else "no checkpoint"
            raise ValueError(
                f"--resume: rank {self.info.rank} finds {seen} in {self.run_dir}, other ranks another one: "
                "checkpoints are written on rank 0's node only; copy its run directory to every node first"
            )

    def train_step(self, micro: Sequence[LoadedBatch]) -> StepResult:
        """One optimizer step over `grad_accum` micro-batches; the loss is normalised by the loss-weight sum
        over the micro-batches of every rank, so accumulation and world size do not change the gradient."""
        cfg, info, reach = self.cfg, self.info, self.reach
        local_weight = sum(m.weight_sum if reach is None else reach.weight_sum(m.slot_sums) for m in micro)
        # the stop request rides on the step's one collective, so every rank stops after the same step
        global_weight, stops = all_reduce_sum([local_weight, float(self.stop.requested is not None)], info)
        normalizer = max(global_weight, 1e-12) / info.world_size  # DDP averages gradients over ranks
        loss_sum = torch.zeros((), dtype=torch.float64, device=info.device)
        for i, loaded in enumerate(micro):
            batch = loaded.wait()
            with no_sync_unless(self.ddp_model, i == len(micro) - 1), self.autocast:
                attn_mask = build_attention_mask(batch, cfg.attention, split=cfg.split_own_slots)
                loss, stats = drafter_loss(
                    self.ddp_model,
                    self.frozen,
                    batch,
                    attn_mask=attn_mask,
                    normalizer=normalizer,
                    slot_scale=None if reach is None else reach.scale,
                    distill=self.distill,
                )
                (loss * loaded.loss_scale).backward()
            if loaded.loss_scale:
                loss_sum += stats.loss_sum.double()
                if reach is not None:
                    reach.add(stats.accept_at_least)
        grad_norm = (
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
            if cfg.optim.grad_clip > 0
            else torch.tensor(float("nan"))
        )
        lr = self.schedule.lr(self.step, cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        clipped = grad_norm if cfg.optim.grad_clip > 0 else None  # else the guard computes the norm
        rows = [r for m in micro for r in m.rows]
        self.guard.record(self.step + 1, rows, loss_sum, clipped, self.model.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        tokens = sum(m.tokens for m in micro if m.loss_scale)
        return StepResult(loss_sum, local_weight, tokens, grad_norm, lr, stops > 0)

    def evaluate(self) -> dict[str, Any]:
        """Held-out metrics (rank 0 only: the other ranks wait at the caller's barrier)."""
        if self.eval_set is None:
            self.eval_set = build_eval_set(self.cache, self.eval_spec)
        return evaluate(
            self.model, self.frozen, self.cache, self.eval_set, self.eval_spec, device=self.info.device
        )

    def save(
        self, path: Path, loader_state: dict[str, Any], extra: dict[str, Any] | None = None, **kw: Any
    ) -> Path:
        """A checkpoint of the current step at `path` (rank 0; `weights_only=True` for RUN/best)."""
        meta = {
            "config": self.cfg.to_flat(),
            "drafter": dataclasses.asdict(self.drafter_cfg),
            "total_steps": self.total_steps,
            "schedule_start": self.schedule.start,
            "world_size": self.info.world_size,
            **cache_identity(self.cache.manifest),
            "best_walk": self.best_walk,
            **(extra or {}),
        }
        return ckpt.save_checkpoint(
            path,
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            param_names=self.param_names,
            loader_state=loader_state,
            meta=meta,
            **kw,
        )

    def close(self) -> None:
        self.loader.close()
        self.cache.close()
        release_lock(self.run_lock)
        self.run_lock = None
        # DDP's reducer holds the process group and sits in reference cycles: left to the interpreter's exit,
        # gloo's threads met C++ static teardown ("terminate called without an active exception", SIGABRT,
        # no Python frame; 1-2 of 8 two-rank runs on a loaded CPU box). Free it while Python still runs.
        self.ddp_model = None
        gc.collect()
        shutdown(self.info)

    def evaluate_and_keep_best(self, loader_state: dict[str, Any]) -> dict[str, Any]:
        """Evaluate on rank 0; a new best decode walk writes RUN/best and RUN/export.

        The walk, not tau on sampled anchors, picks the drafter: it accepts along the path decoding takes, as a
        server does. The two can part: on the quality benchmark's prose target tau kept rising over a run's
        second half while the walk fell, on every seed (BENCHMARKS.md)."""
        result: dict[str, Any] = {}
        if self.info.is_main:
            result = self.evaluate()
            tau, walk = result.get("tau"), result.get("tau_walk")
            self.last_tau = tau if tau is not None else self.last_tau
            if walk is not None and (self.best_walk is None or walk > self.best_walk):
                self.best_walk = walk
                self.save(self.run_dir / ckpt.BEST_DIR, loader_state, {"eval": result}, weights_only=True)
                export_drafter(self.model, self.drafter_cfg, self.run_dir / EXPORT_DIR)
        barrier(self.info)
        return result

    def ends_early(self, result: dict[str, Any]) -> bool:
        """Whether this evaluation's walk (rank 0's `result`) fell `--early-stop` below the run's best; every
        rank gets rank 0's answer."""
        if self.cfg.early_stop <= 0:
            return False
        fell = self.info.is_main and fell_below_best(
            result.get("tau_walk"), self.best_walk, self.cfg.early_stop
        )
        return self.reduce_sum([float(fell)])[0] > 0

    def save_step(
        self, loader_state: dict[str, Any], finished: bool = False, ended_early: bool = False
    ) -> Path | None:
        """RUN/checkpoints/step_N (every rank calls it: the skip count is summed over ranks first); `finished`:
        the run's last step, its schedule run out (a resume for longer restarts it)."""
        skipped = all_reduce_sum([float(loader_state["skipped_samples"])], self.info)[0]
        extra: dict[str, Any] = {"finished": finished, "ended_early": ended_early}
        if self.reach is not None:
            extra["slot_weights"] = self.reach.state_dict(self.reduce_sum)
        saved = None
        if self.info.is_main:
            state = {**loader_state, "skipped_samples": int(skipped)}
            path = self.run_dir / ckpt.CHECKPOINT_DIR / ckpt.step_dir_name(self.step)
            saved = self.save(path, state, extra)
            ckpt.prune_checkpoints(self.run_dir, self.cfg.keep_checkpoints)
        barrier(self.info)
        return saved

    def reduce_sum(self, values: list[float]) -> list[float]:
        return all_reduce_sum(values, self.info)
