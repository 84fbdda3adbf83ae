"""Integrity where data is used: a shard must be the one the manifest committed (training, evaluation), a
resume must find the cache its checkpoint trained on, and evaluation follows --on-corrupt and counts."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash.shards import Cache, ShardReader, load_manifest, save_manifest, shard_name
from dflash.shards.errors import ManifestMismatch, ShardError
from dflash.train.config import tiny_debug
from dflash.train.data_plan import heldout_mask
from dflash.train.data_spec import DataSpec
from dflash.train.drafter_config import DrafterConfig
from dflash.train.evaluate import build_eval_set, evaluate
from dflash.train.frozen import load_frozen_target
from dflash.train.loop import train
from dflash.train.metrics import read_metrics
from dflash.train.model import DFlashDrafter

from tests.common.fake_cache import corrupt_sample, write_fake_cache

SWAPPED = shard_name(1)


def _two_extractions(tmp_path: Path) -> tuple[Path, Path]:
    """Two caches of the same rows whose hidden states differ (as two targets, or two runs of one, give)."""
    a = write_fake_cache(tmp_path / "a", num_samples=40, samples_per_shard=10)
    b = write_fake_cache(tmp_path / "b", num_samples=40, samples_per_shard=10, noise=0.31)
    return a, b


def _swap(a: Path, b: Path) -> None:
    shutil.copyfile(b / "shards" / SWAPPED, a / "shards" / SWAPPED)


def _spec(on_corrupt: str) -> DataSpec:
    return DataSpec(
        layer_ids=(2,),
        block_size=4,
        mask_token_id=90,
        num_anchors=8,
        gamma=1.0,
        token_budget=256,
        max_length=128,
        on_corrupt=on_corrupt,
        heldout_fraction=0.2,
        loader_threads=2,
    )


def _evaluate(cache_dir: Path, spec: DataSpec) -> dict:
    frozen = load_frozen_target(cache_dir, dtype=torch.float32)
    torch.manual_seed(0)
    model = DFlashDrafter(
        DrafterConfig.from_target_config(
            frozen.config, mask_token_id=90, num_hidden_layers=1, block_size=4, target_layer_ids=[2]
        )
    )
    with Cache.open(cache_dir) as cache:
        return evaluate(model, frozen, cache, build_eval_set(cache, spec), spec, device=torch.device("cpu"))


def test_a_shard_from_another_extraction_is_refused_by_training_and_evaluation(tmp_path: Path) -> None:
    a, b = _two_extractions(tmp_path)
    with ShardReader.open(b / "shards" / SWAPPED) as other, Cache.open(a) as cache:
        assert other.info().rows == cache.shard(SWAPPED).info().rows  # same rows, other content
    _swap(a, b)
    message = rf"{SWAPPED}: not the shard this cache's manifest lists \(index_checksum"
    cfg = tiny_debug(str(a), str(tmp_path / "run"), eval_every=0, tensorboard=False, plots=False)
    # Training stats every shard first: a swapped shard of another size is refused there, before step 1.
    resized = rf"{SWAPPED}: \d+ bytes, the manifest records \d+"
    with pytest.raises(ShardError, match=f"{message}|{resized}"):
        train(cfg)
    with pytest.raises(ShardError, match=message):
        _evaluate(a, _spec("fail"))
    # Under --on-corrupt skip both go on without it, and say so.
    skip_run = tmp_path / "skip_run"
    train(tiny_debug(str(a), str(skip_run), on_corrupt="skip", eval_every=0, tensorboard=False, plots=False))
    assert read_metrics(skip_run)[-1]["skipped_shards"] == 1
    skipped, whole = _evaluate(a, _spec("skip")), _evaluate(b, _spec("skip"))
    held_in_swapped = int(heldout_mask(np.arange(10, 20), 0.2).sum())
    assert held_in_swapped > 0 and skipped["eval_skipped_shards"] == 1
    assert skipped["eval_samples"] == whole["eval_samples"] - held_in_swapped


def test_resume_refuses_a_cache_whose_shards_changed_since_the_checkpoint(tmp_path: Path) -> None:
    a, b = _two_extractions(tmp_path)
    run = tmp_path / "run"
    train(tiny_debug(str(a), str(run), max_steps=2, eval_every=0, tensorboard=False, plots=False))
    # A shard re-extracted and its manifest entry rewritten: every shard opens, but the data changed.
    _swap(a, b)
    manifest = load_manifest(a)
    manifest.shards = [*(s for s in manifest.shards if s.name != SWAPPED), load_manifest(b).shards[1]]
    manifest.shards.sort(key=lambda s: s.name)
    save_manifest(a, manifest)
    with pytest.raises(
        ManifestMismatch, match=rf"{SWAPPED}: [0-9a-f]{{16}} \(checkpoint\) != [0-9a-f]{{16}}"
    ):
        train(tiny_debug(str(a), str(run), max_steps=4, resume=True, eval_every=0))


def test_evaluation_counts_corrupt_samples_under_skip_and_stops_under_fail(tmp_path: Path) -> None:
    cache = write_fake_cache(tmp_path / "c", num_samples=40, samples_per_shard=10)
    clean = _evaluate(cache, _spec("skip"))
    with Cache.open(cache) as c:
        first, frame = build_eval_set(c, _spec("skip")).batches[0][0], 2 + c.layers.index(2)
    row = corrupt_sample(cache, first.shard, first.index, frame=frame)
    skipped = _evaluate(cache, _spec("skip"))
    assert skipped["eval_skipped_samples"] == 1 and skipped["eval_skipped_shards"] == 0
    assert skipped["eval_samples"] == clean["eval_samples"] - 1
    with pytest.raises(ShardError, match=rf"row {row}.*checksum mismatch.*--on-corrupt skip"):
        _evaluate(cache, _spec("fail"))
