"""What a training run needs from its cache, checked before step 1: the cache was made from the target
files it ships, and widths agree (the drafter's layers are checked by `shards.layers.resolve_layer_ids`,
each shard's identity when it is opened). Each refusal is one line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash.shards import Cache, target_fingerprint
from dflash.shards.errors import ManifestMismatch

if TYPE_CHECKING:
    from .drafter_config import DrafterConfig
    from .frozen import FrozenTarget


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
