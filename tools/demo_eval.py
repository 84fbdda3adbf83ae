"""The demo's training config and its two evaluations: the untrained drafter and the exported one.

`untrained_drafter` rebuilds exactly the step-0 weights `trainer.train` starts from (same config, same
`torch.manual_seed(seed)` before construction), so `tau_before` is the trained run's own starting point.
`evaluate_drafter` runs the trainer's evaluation (`train.evaluate`) with the run's settings, so both
taus are measured on the same held-out rows and the same seeded anchors.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dflash.train.config import TrainConfig
    from dflash.train.model import DFlashDrafter

    from .demo import DemoSize


def make_train_config(cache: Path, run: Path, spec: DemoSize, *, seed: int) -> TrainConfig:
    """The `TrainConfig` of the demo: what `dflash-train` builds from `demo_commands.train_argv`."""
    from dflash.train.cli import build_config

    from .demo_commands import train_argv

    return build_config(train_argv(cache, run, spec, seed=seed, layers=cached_layers(cache)))


def cached_layers(cache: Path) -> list[int]:
    from dflash.shards import Cache

    with Cache.open(cache) as opened:
        return list(opened.layers)


def untrained_drafter(cfg: TrainConfig) -> DFlashDrafter:
    """The drafter the trainer starts from: same config and same seeded init (`torch.manual_seed(seed)`,
    then construction, as `trainer.train` does), built without touching the caller's RNG state."""
    import torch
    from dflash.train.drafter_config import DrafterConfig
    from dflash.train.frozen import load_frozen_target
    from dflash.train.model import DFlashDrafter

    frozen = load_frozen_target(cfg.cache, mask_token_id=cfg.drafter.mask_token_id)
    drafter_cfg = DrafterConfig.from_target_config(
        frozen.config,
        mask_token_id=frozen.mask_token_id,
        num_hidden_layers=cfg.drafter.num_draft_layers,
        block_size=cfg.drafter.block_size,
        target_layer_ids=cfg.drafter.target_layer_ids,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return DFlashDrafter(drafter_cfg)


def evaluate_drafter(drafter: DFlashDrafter | str | Path, cfg: TrainConfig) -> dict[str, Any]:
    """The trainer's evaluation (held-out rows, seeded anchors, decode walk) of a drafter or an exported dir."""
    import torch
    from dflash.shards import Cache
    from dflash.shards.target_files import check_target_files
    from dflash.train.data_spec import DataSpec, read_eval_rows
    from dflash.train.evaluate import build_eval_set, evaluate
    from dflash.train.export import load_drafter
    from dflash.train.frozen import load_frozen_target

    if isinstance(drafter, (str, Path)):
        drafter = load_drafter(drafter, dtype=torch.float32)
    spec = DataSpec.for_run(cfg, drafter.config, read_eval_rows(cfg.data.eval_rows))
    with Cache.open(cfg.cache) as cache:
        check_target_files(cache.path, cache.manifest.target_files)  # as training does before reading it
        frozen = load_frozen_target(
            cache.path, mask_token_id=drafter.config.mask_token_id, dtype=torch.float32
        )
        result = evaluate(
            drafter, frozen, cache, build_eval_set(cache, spec), spec, device=torch.device("cpu")
        )
    if "tau" not in result:
        raise ValueError(
            f"{cfg.cache}: no held-out rows to evaluate on; raise eval_fraction or the prompt count"
        )
    return result
