"""The run's length in steps: planned from the manifest, and planned again where a resume changes it."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from dflash.train.config import tiny_debug
from dflash.train.schedule import (
    BASE_EPOCHS,
    MAX_EPOCHS,
    MIN_BATCHES,
    Schedule,
    batches_per_epoch,
    default_epochs,
    estimate_total_steps,
    resumed_schedule,
    resumed_total_steps,
)
from hypothesis import given
from hypothesis import strategies as st

MANIFEST = SimpleNamespace(rows=1000, tokens=256_000)  # 256-token rows


def _cfg(**overrides):
    return tiny_debug("cache", "out", token_budget=1728, max_length=1024, eval_fraction=0.0, **overrides)


def test_a_resume_where_nothing_changed_plans_the_same_end() -> None:
    cfg = _cfg(epochs=6)
    per_epoch = batches_per_epoch(MANIFEST, cfg)
    assert per_epoch == 160  # 256k tokens at 1728 - 128 a batch
    total = estimate_total_steps(MANIFEST, cfg, world_size=4)
    for step in (0, 40, 200):  # 4 ranks: 40 steps an epoch
        epoch, index = divmod(4 * step, per_epoch)
        assert resumed_total_steps(MANIFEST, cfg, 4, step=step, epoch=epoch, next_index=index) == total == 240


@pytest.mark.parametrize(
    ("world", "epochs", "expected"),
    [
        (2, 6, 100 + 280),  # half the ranks: the 560 batches left take twice the steps
        (8, 6, 100 + 70),  # twice the ranks: half the steps
        (4, 9, 100 + 260),  # three more epochs: 1040 batches left
        (4, 2, 100),  # two epochs are already past: the run ends where it is
    ],
)
def test_a_resume_ends_its_schedule_where_its_data_now_ends(world: int, epochs: int, expected: int) -> None:
    # a 6-epoch run on 4 ranks stopped at step 100: 400 of its 960 batches done (epoch 2, batch 80)
    cfg = _cfg(epochs=epochs)
    assert resumed_total_steps(MANIFEST, cfg, world, step=100, epoch=2, next_index=80) == expected


def test_max_steps_caps_a_resumed_schedule() -> None:
    cfg = _cfg(epochs=9, max_steps=300)
    assert resumed_total_steps(MANIFEST, cfg, 4, step=100, epoch=2, next_index=80) == 300
    # a batch index past the estimate's epoch counts as the whole epoch
    assert resumed_total_steps(MANIFEST, _cfg(epochs=3), 1, step=500, epoch=1, next_index=999) == 500 + 160


def test_a_resume_plans_again_only_when_its_length_or_world_size_changed() -> None:
    cfg = _cfg(epochs=6)
    meta = {"config": cfg.to_flat(), "step": 100, "total_steps": 237, "world_size": 4, "finished": False}
    position = {"epoch": 2, "next_index": 80}
    assert resumed_schedule(meta, cfg, MANIFEST, 4, position) == (Schedule(237), [])  # kept as saved
    assert resumed_schedule(meta, cfg, MANIFEST, 1, position) == (Schedule(100 + 560), ["world size 4 -> 1"])
    longer = _cfg(epochs=9, max_steps=300)
    assert resumed_schedule(meta, longer, MANIFEST, 8, position) == (
        Schedule(100 + 130),
        ["--epochs 6 -> 9", "--max-steps None -> 300", "world size 4 -> 8"],
    )
    # a restarted schedule is kept by a resume that changes nothing, and by one that moves its end
    restarted = {**meta, "schedule_start": 90}
    assert resumed_schedule(restarted, cfg, MANIFEST, 4, position) == (Schedule(237, 90), [])
    assert resumed_schedule(restarted, cfg, MANIFEST, 1, position)[0] == Schedule(660, 90)


def test_a_finished_run_resumed_for_longer_restarts_its_schedule() -> None:
    """Its lr had annealed to the floor: the added steps get warmup and cosine of their own (the rest of the
    longer cosine walked a third as far at the quality benchmark's CPU size)."""
    cfg, longer = _cfg(epochs=2), _cfg(epochs=3)
    done = {"epoch": 1, "next_index": 160}
    meta = {"config": cfg.to_flat(), "step": 320, "total_steps": 320, "world_size": 1, "finished": True}
    schedule, changed = resumed_schedule(meta, longer, MANIFEST, 1, done)
    assert schedule == Schedule(480, start=320) and changed == ["--epochs 2 -> 3"]
    optim = longer.optim
    lrs = [schedule.lr(step, optim) for step in range(320, 480)]
    warmup = round(optim.warmup_frac * 160)
    assert lrs[warmup] == pytest.approx(optim.lr) and lrs[0] == pytest.approx(optim.lr / warmup)
    assert all(a >= b for a, b in itertools.pairwise(lrs[warmup:])) and lrs[-1] < 0.01 * optim.lr
    # a checkpoint from before the flag counts as finished at its total; shorter: nothing to restart
    older = {k: v for k, v in meta.items() if k != "finished"}
    assert resumed_schedule(older, longer, MANIFEST, 1, done)[0] == Schedule(480, start=320)
    assert resumed_schedule(meta, _cfg(epochs=1), MANIFEST, 1, done)[0] == Schedule(320)


@given(rows=st.integers(1, 10**7), mean_tokens=st.integers(1, 4096), world=st.integers(1, 64))
def test_the_default_epochs_are_the_fewest_that_reach_the_batch_floor_within_bounds(
    rows: int, mean_tokens: int, world: int
) -> None:
    manifest = SimpleNamespace(rows=rows, tokens=rows * mean_tokens)
    cfg = _cfg(epochs=None)
    epochs, per_epoch = default_epochs(manifest, cfg), batches_per_epoch(manifest, cfg)
    assert BASE_EPOCHS <= epochs <= MAX_EPOCHS
    assert epochs == MAX_EPOCHS or epochs * per_epoch >= MIN_BATCHES  # the floor is reached, unless capped
    assert epochs == BASE_EPOCHS or (epochs - 1) * per_epoch < MIN_BATCHES  # and not passed by a whole epoch
    # tokens, not optimizer steps: the schedule's steps follow the world size, the epochs do not
    per_rank = -(-per_epoch // world)
    assert estimate_total_steps(manifest, cfg, world) == per_rank * epochs


def test_the_quality_benchmarks_datasets_get_ten_epochs_and_a_large_one_the_papers_six() -> None:
    """~650 batches an epoch (the 16k-row targets: 6,530 steps at --epochs 10) -> 10; 1,000 or more -> 6."""
    # 1152-token rows fill a 1728-token batch one each (1728 - 1152/2)
    cfg = tiny_debug("c", "o", token_budget=1728, max_length=1152, eval_fraction=0.0, epochs=None)
    for per_epoch, expected in ((653, 10), (700, 9), (999, 7), (1000, 6), (10**5, 6), (3, 10)):
        manifest = SimpleNamespace(rows=per_epoch, tokens=per_epoch * 1152)
        assert batches_per_epoch(manifest, cfg) == per_epoch
        assert default_epochs(manifest, cfg) == expected, per_epoch
