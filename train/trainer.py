"""The training loop: build -> (resume) -> stream, step, log, evaluate, checkpoint -> close.

One flat function with `# ---` sections, read top-down. Everything that decides the trajectory
(weights, optimizer, schedule position, data position, anchors, global RNGs) is in the checkpoint,
so on the CPU a resumed run reproduces the uninterrupted losses bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dflash.shards import Cache
from dflash.shards.manifest import PROVENANCE_FIELDS
from dflash.shards.outdir import claim_out_dir

from . import checkpoint as ckpt
from .cache_checks import check_cache, resolve_layer_ids
from .config import TrainConfig, config_from_flat, estimate_total_steps, lr_at
from .evaluate import configured_eval_set, evaluate_configured
from .export import export_drafter
from .frozen import load_frozen_target
from .guards import FiniteGuard, check_trainable
from .loader import StreamingLoader
from .loss import drafter_loss
from .mask import build_attention_mask
from .metrics import MetricsLogger, format_eta
from .model import DFlashDrafter, DrafterConfig
from .parallelize import (
    DistInfo,
    all_reduce_sum,
    barrier,
    init_distributed,
    no_sync_unless,
    shutdown,
    wrap_model,
)

log = logging.getLogger(__name__)
EXPORT_DIR = "export"


@dataclass(slots=True)
class TrainResult:
    step: int
    run_dir: Path
    last_checkpoint: Path | None
    best_tau: float | None
    final_metrics: dict[str, Any]


def train(cfg: TrainConfig) -> TrainResult:
    # --- process group, run directory, seeds --------------------------------------------------------
    info: DistInfo = init_distributed(cfg.device)
    run_dir = Path(cfg.out)
    if info.is_main:
        claim_out_dir(run_dir, "run")  # the --out rule, before anything is cleaned up or written
        for action in ckpt.clean_interrupted_saves(run_dir):
            log.warning("interrupted checkpoint write: %s", action)
    barrier(info)
    resume_from = ckpt.latest_checkpoint(run_dir) if cfg.resume else None
    if cfg.resume and resume_from is None:
        log.warning("--resume: %s holds no checkpoint yet; starting from scratch", run_dir)
    if not cfg.resume and ckpt.list_checkpoints(run_dir):
        raise ValueError(
            f"{run_dir} already holds checkpoints: pass --resume to continue, or choose a new --out"
        )
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    random.seed(cfg.seed)
    device = info.device
    if cfg.attention == "flex" and device.type != "cuda":
        raise ValueError(
            f"--attention flex needs a CUDA device: FlexAttention has no backward on {device.type}; "
            "use --attention auto (the default) or dense"
        )

    # --- cache, frozen target, drafter ----------------------------------------------------------------
    cache = Cache.open(cfg.cache)
    frozen_cpu = load_frozen_target(cfg.cache, mask_token_id=cfg.drafter.mask_token_id)
    layer_ids = resolve_layer_ids(cfg, frozen_cpu.num_layers, cache.layers)
    drafter_cfg = DrafterConfig.from_target_config(
        frozen_cpu.config,
        mask_token_id=frozen_cpu.mask_token_id,
        num_hidden_layers=cfg.drafter.num_draft_layers,
        block_size=cfg.drafter.block_size,
        target_layer_ids=layer_ids,
    )
    check_cache(cache, frozen_cpu, drafter_cfg)
    check_trainable(cache, frozen_cpu)
    frozen = frozen_cpu.to(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    with device:  # initialised where it trains (seconds, not minutes, for a 1B-parameter drafter on a GPU)
        model = DFlashDrafter(drafter_cfg)  # fp32 master weights; bf16 compute via autocast on CUDA
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    param_names = [n for n, _ in named]
    optimizer = torch.optim.AdamW(
        [p for _, p in named],
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
        fused=device.type == "cuda" or None,
    )
    heldout_rows = _read_eval_rows(cfg.data.eval_rows)
    loader = StreamingLoader.for_run(
        cache,
        cfg,
        drafter_cfg,
        heldout_rows=heldout_rows,
        rank=info.rank,
        world_size=info.world_size,
        device=device,
    )

    # --- resume ---------------------------------------------------------------------------------------
    step, best_tau = 0, None
    total_steps = estimate_total_steps(cache.manifest, cfg, info.world_size)
    if resume_from is not None:
        saved_meta = ckpt.read_json(resume_from / "meta.json")
        ckpt.check_resume(saved_meta, cfg.to_flat(), cache.manifest)
        meta, loader_state = ckpt.load_checkpoint(
            resume_from, model=model, optimizer=optimizer, param_names=param_names
        )
        loader.load_state_dict(loader_state)
        step, total_steps, best_tau = meta["step"], meta["total_steps"], meta.get("best_tau")
    max_steps = cfg.optim.max_steps or total_steps * 10**6  # epochs end the run unless a step budget does
    warmup_steps = round(cfg.optim.warmup_frac * total_steps)
    ddp_model = wrap_model(model, info)
    logger = MetricsLogger(
        run_dir,
        enabled=info.is_main,
        start_step=step,
        total_steps=min(total_steps, max_steps),
        tensorboard=cfg.tensorboard,
        plots=cfg.plots,
        progress=cfg.progress,
    )
    if info.is_main:
        # For people to read; checkpoints' meta.json is what a resume trusts.
        (run_dir / "config.json").write_text(json.dumps(cfg.to_flat(), indent=1) + "\n")
        logger.write(
            f"dflash-train: {model.num_parameters() / 1e6:.1f}M drafter params, layers {list(layer_ids)}, "
            f"{cache.manifest.rows} cached rows, ~{total_steps} steps, world {info.world_size}, "
            f"{'resuming at step ' + str(step) if step else 'from scratch'}"
        )
    eval_set = None
    meta_base = {
        "config": cfg.to_flat(),
        "drafter": dataclasses.asdict(drafter_cfg),
        "total_steps": total_steps,
        "manifest_sha256": ckpt.manifest_digest(cache.manifest),
        "world_size": info.world_size,
        "cache_provenance": {k: cache.manifest.to_dict()[k] for k in PROVENANCE_FIELDS},
    }
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    )

    def save(
        path: Path, loader_state: dict[str, Any], extra: dict[str, Any], weights_only: bool = False
    ) -> Path:
        return ckpt.save_checkpoint(
            path,
            step,
            model=model,
            optimizer=optimizer,
            param_names=param_names,
            loader_state=loader_state,
            meta={**meta_base, "best_tau": best_tau, **extra},
            weights_only=weights_only,
        )

    # --- the loop ---------------------------------------------------------------------------------------
    batches = loader.iterate()
    guard = FiniteGuard(cache, layer_ids)  # a NaN/inf loss or gradient stops the run before any write
    loader_state = loader.state_dict()
    window = dict.fromkeys(("loss_sum", "weight_sum", "tokens", "wait"), 0.0)
    last_saved, last_record, last_tau = None, {}, None
    started = window_start = time.perf_counter()
    t_wait = time.perf_counter()
    lookahead = next(batches, None)  # one batch ahead, so the last step is known when it runs
    first_wait = time.perf_counter() - t_wait
    try:
        while lookahead is not None and step < max_steps:
            # --- take grad_accum micro-batches (time blocked on the loader is data wait)
            wait = first_wait
            first_wait = 0.0
            micro = []
            while lookahead is not None and len(micro) < cfg.optim.grad_accum:
                micro.append(lookahead[0])
                loader_state = lookahead[1]
                t_wait = time.perf_counter()
                lookahead = next(batches, None)
                wait += time.perf_counter() - t_wait
            # --- forward/backward; the loss is normalised by the weight sum over micro-batches and ranks
            local_weight = sum(m.weight_sum for m in micro)
            global_weight = all_reduce_sum([local_weight], info)[0]
            normalizer = max(global_weight, 1e-12) / info.world_size  # DDP averages gradients over ranks
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # on device: no sync per step
            for i, loaded in enumerate(micro):
                batch = loaded.wait()
                with no_sync_unless(ddp_model, i == len(micro) - 1), autocast:
                    attn_mask = build_attention_mask(batch, cfg.attention)
                    loss, stats = drafter_loss(
                        ddp_model, frozen, batch, attn_mask=attn_mask, normalizer=normalizer
                    )
                    (loss * loaded.loss_scale).backward()
                if loaded.loss_scale:
                    loss_sum += stats.loss_sum.double()
            # --- clip, schedule, step
            grad_norm = (
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
                if cfg.optim.grad_clip > 0
                else torch.tensor(float("nan"))
            )
            lr = lr_at(
                step,
                base_lr=cfg.optim.lr,
                warmup_steps=warmup_steps,
                total_steps=total_steps,
                min_lr_frac=cfg.optim.min_lr_frac,
            )
            for group in optimizer.param_groups:
                group["lr"] = lr
            clipped = grad_norm if cfg.optim.grad_clip > 0 else None
            guard.record(step + 1, [r for m in micro for r in m.rows], loss_sum, clipped, model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window["loss_sum"] += loss_sum
            window["weight_sum"] += local_weight
            window["tokens"] += sum(m.tokens for m in micro if m.loss_scale)
            window["wait"] += wait
            last_step = step >= max_steps or lookahead is None
            do_eval = cfg.eval_every > 0 and (step % cfg.eval_every == 0 or last_step)
            # --- log (one small all-reduce on log steps)
            logged = step % max(cfg.log_every, 1) == 0 or last_step or do_eval
            if logged or (cfg.save_every and step % cfg.save_every == 0):
                guard.check()  # synced with the log; before any checkpoint or export is written
            if logged:
                window["loss_sum"] = float(window["loss_sum"])  # the device sync of a log step
                elapsed = time.perf_counter() - window_start
                loss_all, weight_all, tokens_all, wait_all, skipped_all = all_reduce_sum(
                    [*window.values(), float(loader_state["skipped_samples"])], info
                )
                last_record = {
                    "step": step,
                    "epoch": micro[-1].epoch,
                    "loss": loss_all / max(weight_all, 1e-12),
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens_per_s": tokens_all / max(elapsed, 1e-9),
                    "data_wait_frac": min(1.0, wait_all / max(elapsed * info.world_size, 1e-9)),
                    "skipped_samples": int(skipped_all),
                }
                window = dict.fromkeys(window, 0.0)
            # --- evaluate (rank 0; the others wait at the barrier)
            if do_eval:
                if eval_set is None:
                    eval_set = configured_eval_set(cache, cfg, heldout_rows)
                if info.is_main:
                    result = evaluate_configured(
                        model, frozen, cache, eval_set, cfg, drafter_cfg, device=device
                    )
                    last_record = {**last_record, "step": step, **result}
                    last_tau = result.get("tau", last_tau)
                    if result.get("tau") is not None and (best_tau is None or result["tau"] > best_tau):
                        best_tau = result["tau"]
                        save(run_dir / ckpt.BEST_DIR, loader_state, {"eval": result}, weights_only=True)
                        export_drafter(model, drafter_cfg, run_dir / EXPORT_DIR)
                barrier(info)
            if last_record.get("step") == step and (cfg.log_every or do_eval):
                logger.log(last_record)
                if do_eval:
                    logger.refresh_plots()
            rate = step / max(time.perf_counter() - started, 1e-9)
            logger.progress(
                step,
                {
                    "ep": micro[-1].epoch,
                    "loss": f"{last_record.get('loss', float('nan')):.3f}",
                    "tau": f"{last_tau if last_tau is not None else float('nan'):.2f}",
                    "tok/s": f"{last_record.get('tokens_per_s', 0):.0f}",
                    "wait": f"{100 * last_record.get('data_wait_frac', 0):.0f}%",
                    "eta": format_eta((min(total_steps, max_steps) - step) / max(rate, 1e-9)),
                },
            )
            # --- checkpoint (rank 0 writes; the others wait so nobody races ahead of a slow disk)
            if (cfg.save_every and step % cfg.save_every == 0) or last_step:
                if info.is_main:
                    last_saved = save(
                        run_dir / ckpt.CHECKPOINT_DIR / ckpt.step_dir_name(step), loader_state, {}
                    )
                    ckpt.prune_checkpoints(run_dir, cfg.keep_checkpoints)
                barrier(info)
            if logged:  # throughput windows exclude evaluation and checkpoint time
                window_start = time.perf_counter()
    finally:
        batches.close()
        logger.close()

    # --- close -------------------------------------------------------------------------------------------
    if loader.bad_shards or loader_state["skipped_samples"]:
        log.warning(
            "skipped %d corrupt samples and %d unreadable shards (%s)",
            loader_state["skipped_samples"],
            len(loader.bad_shards),
            ", ".join(sorted(loader.bad_shards)) or "none",
        )
    cache.close()
    shutdown(info)
    return TrainResult(
        step=step, run_dir=run_dir, last_checkpoint=last_saved, best_tau=best_tau, final_metrics=last_record
    )


def _read_eval_rows(path: str | None) -> frozenset[int]:
    """Row ids held out explicitly: a JSON list or one integer per line."""
    if not path:
        return frozenset()
    text = Path(path).read_text().strip()
    try:
        rows = json.loads(text) if text.startswith("[") else [int(x) for x in text.split()]
        return frozenset(int(r) for r in rows)
    except ValueError:
        raise ValueError(
            f"--eval-rows {path}: expected a JSON list of row ids or one integer per line"
        ) from None


def config_of_checkpoint(path: str | Path) -> TrainConfig:
    """The TrainConfig a checkpoint was written with (from its meta.json)."""
    return config_from_flat(ckpt.read_json(Path(path) / "meta.json")["config"])
