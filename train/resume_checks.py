"""What a `--resume` checks before it loads anything: the checkpoint's settings against the command's (only
`RESUMABLE_KEYS` may differ), the cache it trained on against the one given (provenance and every shard's
index checksum), and the checkpoint's own files. `Trainer.resume` and `dflash-train --dry-run --resume` run the
same checks (`read_resume_state`), so the dry run refuses what the run would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dflash.shards import Manifest, diff_manifests
from dflash.shards.errors import ManifestMismatch, ShardError
from dflash.shards.manifest import PROVENANCE_FIELDS, canonical_json

from .checkpoint import older_intact_hint, read_resumable
from .checkpoint_files import CheckpointError
from .config import TrainConfig

# What a run trained with where its checkpoint lacks the key: defaults that changed since the key was added
BEFORE_DEFAULTS = {"slot_weights": "decay", "data_order": "shards"}

# Settings a resume may change: they do not alter the trajectory up to the checkpoint.
RESUMABLE_KEYS = frozenset(
    {
        "cache",
        "out",
        "resume",
        "resume_from",
        "shard_cache_dir",  # where a remote cache's copies are kept: another node keeps them elsewhere
        "shard_cache_gb",
        "device",
        "attention",  # a kernel choice: both paths compute the same function
        "compile",  # likewise
        "eval_every",
        "early_stop",  # where the run ends, not the steps before it
        "save_every",
        "log_every",
        "keep_checkpoints",
        "tensorboard",
        "plots",
        "progress",
        "loader_threads",
        "loader_workers",
        "prefetch_batches",
        "max_steps",  # the run's length: a change plans the lr schedule again (`schedule.resumed_schedule`)
        "epochs",
        "eval_samples",
    }
)


def manifest_digest(manifest: Manifest) -> str:
    """sha256 of what a run trains on: the cache's provenance and every shard's index checksum."""
    d = manifest.to_dict()
    keep = {k: d[k] for k in PROVENANCE_FIELDS} | {"shards": sorted(shard_checksums(manifest).items())}
    return hashlib.sha256(canonical_json(keep)).hexdigest()


def shard_checksums(manifest: Manifest) -> dict[str, str]:
    return {s.name: s.index_checksum for s in manifest.shards}


def cache_identity(manifest: Manifest) -> dict[str, Any]:
    """The meta.json entries a resume compares with the cache it is given (`check_resume`)."""
    d = manifest.to_dict()
    return {
        "manifest_sha256": manifest_digest(manifest),
        "cache_provenance": {k: d[k] for k in PROVENANCE_FIELDS},
        "cache_shards": shard_checksums(manifest),
    }


def check_resume(saved: dict[str, Any], cfg_flat: dict[str, Any], manifest: Manifest) -> None:
    """Refuse a resume that would change the trajectory: other settings, or another cache (provenance,
    or any shard added, removed or rewritten since the checkpoint), naming what differs."""
    now = cfg_flat
    # A setting added since the checkpoint was written trained it at its default of the time: today's, but
    # for a default that changed since (BEFORE_DEFAULTS).
    for key in ("config", "cache_provenance"):
        if not isinstance(saved.get(key), dict):
            raise CheckpointError(f"checkpoint meta.json: {key} must be a JSON object")
    then = {**TrainConfig(cache="cache", out="run").to_flat(), **BEFORE_DEFAULTS, **saved["config"]}
    changed = [
        f"{k}: {then.get(k)!r} (checkpoint) != {now[k]!r}"
        for k in sorted(now)
        if k not in RESUMABLE_KEYS and then.get(k) != now[k]
    ]
    if changed:
        # a run from before a default changed (BEFORE_DEFAULTS) resumes with the old value as a flag
        flags = [
            f"--{k.replace('_', '-')} {v}"
            for k, v in BEFORE_DEFAULTS.items()
            if then.get(k) == v != now.get(k)
        ]
        hint = f" (a run started before a default changed: add {' '.join(flags)})" if flags else ""
        raise ValueError(
            f"--resume with settings that change the trajectory: {'; '.join(changed)}; "
            f"use the checkpoint's settings or start a new --out{hint}"
        )
    diffs = diff_manifests(saved["cache_provenance"], manifest.to_dict())
    if diffs:
        raise ManifestMismatch("--resume against a different cache", diffs)
    if saved.get("manifest_sha256") != manifest_digest(manifest):
        before, after = saved.get("cache_shards") or {}, shard_checksums(manifest)
        shards = [
            f"{name}: {before.get(name, 'absent')} (checkpoint) != {after.get(name, 'absent')}"
            for name in sorted(set(before) | set(after))
            if before.get(name) != after.get(name)
        ]
        raise ManifestMismatch(
            "--resume against a cache whose shards changed since the checkpoint",
            shards
            or [
                f"manifest_sha256: {saved.get('manifest_sha256')} (checkpoint) != {manifest_digest(manifest)}"
            ],
        )


def ended_by_early_stop(meta: dict[str, Any], cfg: TrainConfig) -> bool:
    """A checkpoint where `--early-stop` ended its run, resumed with the rule still on: nothing to train (the
    walk already fell past its best; `--early-stop 0` trains on)."""
    return bool(meta.get("ended_early")) and cfg.early_stop > 0


def read_resume_state(
    ckpt: Path, cfg_flat: dict[str, Any], manifest: Manifest
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, loader state) of the checkpoint a resume continues from, once it is complete, its settings and
    cache are this run's (`check_resume`) and its data position is one a run writes."""
    meta, position = read_resumable(ckpt)
    check_resume(meta, cfg_flat, manifest)
    return meta, position


@contextmanager
def naming_older_intact(run_dir: Path, ckpt: Path) -> Iterator[None]:
    """A damaged checkpoint's error names the newest intact one before it (`--resume-from`); another cache
    is refused as it is: an older checkpoint of the same run would not help."""
    try:
        yield
    except (CheckpointError, ShardError) as exc:
        if isinstance(exc, ManifestMismatch):
            raise
        raise CheckpointError(f"{exc}{older_intact_hint(run_dir, ckpt)}") from None
