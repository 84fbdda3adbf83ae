"""What a training run needs from its cache, checked before step 1: the drafter's layers are cached, the
cache was made from the target files it ships, and widths agree. Each refusal is one line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from dflash.shards import Cache, target_fingerprint
from dflash.shards.errors import ManifestMismatch
from dflash.shards.layers import default_layer_ids

from .config import TrainConfig

if TYPE_CHECKING:
    from .frozen import FrozenTarget
    from .model import DrafterConfig


def check_layers(wanted: Sequence[int], cached: Sequence[int]) -> None:
    """Refuse, in one line, a drafter whose target layers the cache does not hold."""
    missing = [i for i in wanted if i not in cached]
    if missing:
        raise ValueError(
            f"target layer {missing[0]} is not in the cache (target_layer_ids {list(wanted)}, cached layers "
            f"{list(cached)}): pick --target-layer-ids from the cached layers or re-extract with them"
        )


def resolve_layer_ids(cfg: TrainConfig, num_target_layers: int, cached: list[int]) -> tuple[int, ...]:
    """Explicit ids, else the DFlash default rule; either way every id must be cached."""
    if cfg.drafter.target_layer_ids is not None:
        ids = cfg.drafter.target_layer_ids
    else:
        ids = tuple(default_layer_ids(num_target_layers, cfg.drafter.num_draft_layers))
        missing = [i for i in ids if i not in cached]
        if missing:
            raise ValueError(
                f"the default target_layer_ids {list(ids)} (a {num_target_layers}-layer target, "
                f"{cfg.drafter.num_draft_layers} draft layers) are not all cached: the cache holds {cached}; "
                "pass --target-layer-ids chosen from those"
            )
    check_layers(ids, cached)
    return tuple(ids)


def check_cache(cache: Cache, frozen: FrozenTarget, drafter_cfg: DrafterConfig) -> None:
    """Refuse a cache whose provenance does not match the target files or the drafter's width."""
    m = cache.manifest
    problems = []
    want_sha = m.target.get("config_sha256")
    have_sha = target_fingerprint(frozen.config)
    if want_sha and want_sha != have_sha:
        problems.append(f"target.config_sha256: {want_sha} (manifest) != {have_sha} (target/config.json)")
    if m.hidden_size != drafter_cfg.hidden_size:
        problems.append(f"hidden_size: {m.hidden_size} (cache) != {drafter_cfg.hidden_size} (target config)")
    if frozen.hidden_size != drafter_cfg.hidden_size:
        problems.append(f"frozen embed width {frozen.hidden_size} != hidden_size {drafter_cfg.hidden_size}")
    if problems:
        raise ManifestMismatch(f"{cache.path}: cache does not match its target", problems)
