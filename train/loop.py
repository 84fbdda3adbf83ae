"""The training loop: `train` builds a `Trainer`, resumes it, and `fit` runs it until the data, the step
budget, `--early-stop` (the held-out walk fell below its best) or a stop request ends it.

Per step: take `grad_accum` micro-batches (time blocked on the loader is data wait), step, then on the steps
that call for it check the finite guard, log (one small all-reduce), evaluate (rank 0; a new best walk writes
RUN/best and RUN/export), checkpoint. The loader runs one batch ahead, so the run's last step is known when it
runs. Each launch's first step closes its set-up clock (`startup.StartupClock`): one INFO line and a `startup`
entry in the launch's first metrics.jsonl record.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from dflash.shards.atomic import atomic_write_json
from dflash.shards.retries import storage_retries

from .config import TrainConfig
from .loaded_batch import LoadedBatch
from .metrics import LogWindow, MetricsLogger
from .parallelize import barrier
from .startup import describe
from .stop_signal import StopRequest
from .trainer import Trainer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainResult:
    step: int
    run_dir: Path
    last_checkpoint: Path | None
    best_walk: float | None  # the best held-out decode walk (RUN/best's and RUN/export's)
    final_metrics: dict[str, Any]
    stopped_by: int | None = None  # the signal that stopped the run early, after its checkpoint
    ended_early: bool = False  # --early-stop ended it (its checkpoint says so: a resume trains no further)


def train(cfg: TrainConfig, stop: StopRequest | None = None) -> TrainResult:
    """Build, resume (with `--resume`), train, close: the whole of `dflash-train`. With `stop` installed, a
    signal ends the run after its next step and a checkpoint there (`TrainResult.stopped_by`)."""
    trainer = Trainer.build(cfg, stop)
    try:
        with trainer.startup.phase("resume"):
            trainer.resume()
        result = fit(trainer)
        # Every rank done before any closes its connections: gloo aborts a peer whose pair closes under it
        # ("terminate called without an active exception", seen on a loaded CPU box).
        barrier(trainer.info)
        return result
    finally:
        trainer.close()


def fit(trainer: Trainer) -> TrainResult:
    """Stream, step, log, evaluate, checkpoint until the data or the step budget ends."""
    cfg, loader = trainer.cfg, trainer.loader
    if trainer.ended_early:  # before the logger and the loader start: there is no step to take
        if trainer.info.is_main:
            log.info(
                "--early-stop ended this run at step %d (its held-out walk fell below its best, %.3f): nothing "
                "to train; --resume --early-stop 0 trains on",
                trainer.step,
                trainer.best_walk,
            )
        return TrainResult(trainer.step, trainer.run_dir, None, trainer.best_walk, {}, ended_early=True)
    with trainer.startup.phase("logger"):
        logger = _open_logger(trainer)
    batches = loader.iterate()
    loader_state = loader.state_dict()
    window, record, last_saved, started = LogWindow(), {}, None, time.perf_counter()
    startup: dict[str, float] | None = None  # this launch's set-up, until its first record holds it
    launch_start = trainer.step  # a resumed launch's first step is launch_start + 1
    stopping = ended_early = False
    try:
        lookahead, wait = _timed_next(batches)  # one batch ahead, so the last step is known when it runs
        while lookahead is not None and trainer.step < trainer.max_steps and not (stopping or ended_early):
            # --- take grad_accum micro-batches (time blocked on the loader is data wait)
            micro: list[LoadedBatch] = []
            while lookahead is not None and len(micro) < cfg.optim.grad_accum:
                micro.append(lookahead[0])
                loader_state = lookahead[1]
                lookahead, waited = _timed_next(batches)
                wait += waited
            # --- step
            step_started = time.perf_counter()
            step = trainer.train_step(micro)
            if trainer.step == launch_start + 1:  # this launch's first step
                startup = _finish_startup(trainer, logger, wait, step_started)
            window.add(step.loss_sum, step.weight_sum, step.tokens, wait)
            wait = 0.0
            finished = trainer.step >= trainer.max_steps or lookahead is None
            stopping = step.stop and not finished  # saved now, not evaluated: a grace period is short
            last = finished or stopping
            do_eval = cfg.eval_every > 0 and (trainer.step % cfg.eval_every == 0 or last) and not stopping
            logged = trainer.step % max(cfg.log_every, 1) == 0 or last or do_eval
            saving = bool(cfg.save_every and trainer.step % cfg.save_every == 0) or last
            if logged or saving:
                trainer.guard.check()  # synced with the log; before any checkpoint or export is written
            # --- log (one small all-reduce on log steps)
            if logged:
                record = {
                    "step": trainer.step,
                    "epoch": micro[-1].epoch,
                    "lr": step.lr,
                    "grad_norm": float(step.grad_norm),
                    "skipped_shards": len(loader.bad_shards),  # every rank plans over every shard
                    **storage_retries(),  # this rank's retried object-storage requests, when any
                    **window.record(
                        trainer.reduce_sum, trainer.info.world_size, loader_state["skipped_samples"]
                    ),
                }
                if trainer.reach is not None:  # the next steps weigh slots by this window's acceptance
                    record["slot_weights"] = [round(w, 4) for w in trainer.reach.update(trainer.reduce_sum)]
            # --- evaluate (rank 0; the others wait at the barrier)
            if do_eval:
                record = {**record, **trainer.evaluate_and_keep_best(loader_state)}
                ended_early = not finished and trainer.ends_early(record)
                if ended_early:
                    record, saving = {**record, "ended_early": True}, True
                    _log_early_end(trainer, record)
            if record.get("step") == trainer.step and (cfg.log_every or do_eval):
                if startup is not None:
                    record, startup = {**record, "startup": startup}, None
                logger.log(record)
                if do_eval:
                    logger.refresh_plots()
            logger.show_step(
                trainer.step, trainer.planned_steps, record, micro[-1].epoch, trainer.last_tau, started
            )
            # --- checkpoint (rank 0 writes; the others wait so nobody races ahead of a slow disk)
            if saving:
                last_saved = trainer.save_step(loader_state, finished, ended_early) or last_saved
            if logged:  # throughput windows exclude evaluation and checkpoint time
                window = LogWindow()
    finally:
        batches.close()  # joins the loader's threads before `close` closes the cache
        logger.close()
    _report_skips(trainer, loader_state)
    stopped_by = (trainer.stop.requested or signal.SIGTERM) if stopping else None  # another rank's signal
    return TrainResult(
        trainer.step, trainer.run_dir, last_saved, trainer.best_walk, record, stopped_by, ended_early
    )


def _open_logger(trainer: Trainer) -> MetricsLogger:
    cfg, info = trainer.cfg, trainer.info
    logger = MetricsLogger(
        trainer.run_dir,
        enabled=info.is_main,
        start_step=trainer.step,
        total_steps=trainer.planned_steps,
        tensorboard=cfg.tensorboard,
        plots=cfg.plots,
        progress=cfg.progress,
    )
    if info.is_main:
        # For people to read; checkpoints' meta.json is what a resume trusts.
        atomic_write_json(trainer.run_dir / "config.json", cfg.to_flat())
        logger.write(
            f"dflash-train: {trainer.model.num_parameters() / 1e6:.1f}M drafter params, layers "
            f"{list(trainer.drafter_cfg.target_layer_ids)}, {trainer.cache.manifest.rows} cached rows, "
            f"~{trainer.total_steps} steps, world {info.world_size}, "
            f"{'resuming at step ' + str(trainer.step) if trainer.step else 'from scratch'}"
        )
    return logger


def _log_early_end(trainer: Trainer, record: dict[str, Any]) -> None:
    if trainer.info.is_main:
        log.info(
            "--early-stop %g: the held-out walk %.3f at step %d is %.1f%% below the best, %.3f (RUN/export); "
            "the run ends here, %d steps before its schedule's end",
            trainer.cfg.early_stop,
            record["tau_walk"],
            trainer.step,
            100 * (1 - record["tau_walk"] / trainer.best_walk),
            trainer.best_walk,
            trainer.planned_steps - trainer.step,
        )


def _finish_startup(
    trainer: Trainer, logger: MetricsLogger, wait: float, step_started: float
) -> dict[str, float]:
    """The set-up record, once per launch, after its first step (synced once on CUDA, so the step's kernels
    are in it); its line goes to the log now."""
    if trainer.info.device.type == "cuda":
        torch.cuda.synchronize(trainer.info.device)
    trainer.startup.add("first_batch", wait)
    trainer.startup.add("first_step", time.perf_counter() - step_started)
    record = trainer.startup.finish()
    logger.write(describe(record))
    return record


def _report_skips(trainer: Trainer, loader_state: dict[str, Any]) -> None:
    bad = trainer.loader.bad_shards
    if bad or loader_state["skipped_samples"]:
        log.warning(
            "rank %d skipped %d corrupt samples and %d unreadable shards (%s)",
            trainer.info.rank,
            loader_state["skipped_samples"],
            len(bad),
            ", ".join(sorted(bad)) or "none",
        )


def _timed_next(batches: Iterator[Any]) -> tuple[Any, float]:
    t = time.perf_counter()
    item = next(batches, None)
    return item, time.perf_counter() - t
