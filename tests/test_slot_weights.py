"""`--slot-weights reach`: the rule (slot_weights.py), its state across ranks and checkpoints, the trainer's use."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from dflash.train import checkpoint as ckpt
from dflash.train.blocks import slot_weights
from dflash.train.config import tiny_debug
from dflash.train.loop import train
from dflash.train.loss import drafter_loss
from dflash.train.mask import build_attention_mask
from dflash.train.slot_weights import ReachWeights, reach_weights
from dflash.train.trainer import Trainer
from hypothesis import given
from hypothesis import strategies as st

from tests.common.fake_cache import write_fake_cache

FLOOR4 = slot_weights(4, 1.0).tolist()  # [0, 1, e^-1, e^-2]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("cache"), num_samples=40, samples_per_shard=10)


def test_worked_example() -> None:
    # 10 blocks; 8 accept >= 1 slot, 4 >= 2, 2 all 3: R_3 = 0.2, R_2 = 0.6, R_1 = 1.4.
    w = reach_weights([10, 8, 4, 2], FLOOR4)
    assert w == pytest.approx([0.0, 1.0, 0.6 / 1.4, 0.2 / 1.4])
    # A drafter that accepts only slot 1 leaves later slots on the floor.
    assert reach_weights([10, 5, 0, 0], FLOOR4) == pytest.approx(FLOOR4)


def test_nothing_accepted_is_the_floor() -> None:
    assert reach_weights([0, 0, 0, 0], FLOOR4) == FLOOR4
    assert reach_weights([12, 0, 0, 0], FLOOR4) == FLOOR4
    with pytest.raises(ValueError, match="3 acceptance tallies for 4 slots"):
        reach_weights([1, 1, 1], FLOOR4)


def test_geometric_acceptance_gives_the_papers_decay() -> None:
    """Slot k right with a constant chance a once the earlier ones were: the rule is exp(-(k-1)/gamma) with
    gamma = -1/ln a (a long block, so truncation at its end is negligible for the first slots)."""
    a, b = 0.87, 96
    w = reach_weights([1e6 * a**k for k in range(b)], [0.0] + [1e-9] * (b - 1))
    gamma = -1 / math.log(a)
    assert w[1:8] == pytest.approx([math.exp(-(k - 1) / gamma) for k in range(1, 8)], rel=1e-4)


@given(
    drops=st.lists(st.integers(0, 50), min_size=3, max_size=15),
    blocks=st.integers(1, 400),
    gamma=st.floats(0.25, 8.0),
)
def test_weights_are_a_decay_above_the_floor(drops: list[int], blocks: int, gamma: float) -> None:
    tallies, left = [blocks], blocks
    for d in drops:  # blocks accepting >= k can only shrink with k
        left = max(0, left - d)
        tallies.append(left)
    floor = slot_weights(len(tallies), gamma).tolist()
    w = reach_weights(tallies, floor)
    assert w[0] == 0.0 and w[1] == pytest.approx(1.0)
    assert all(f <= x + 1e-12 <= 1.0 + 1e-9 for f, x in zip(floor[1:], w[1:], strict=True))
    assert all(x >= y - 1e-12 for x, y in itertools.pairwise(w[1:]))


def test_state_sums_ranks_and_round_trips() -> None:
    reach = ReachWeights(4, 1.0, torch.device("cpu"))
    assert reach.factors == [1.0] * 4 and reach.weight_sum([0.0, 2.0, 1.0, 1.0]) == pytest.approx(4.0)
    reach.add(torch.tensor([10.0, 8.0, 4.0, 2.0]))
    twice = reach.update(lambda xs: [2 * x for x in xs])  # another rank tallied the same
    assert twice == pytest.approx([0.0, 1.0, 0.6 / 1.4, 0.2 / 1.4])
    assert reach.factors == pytest.approx([0.0, 1.0, (0.6 / 1.4) / FLOOR4[2], (0.2 / 1.4) / FLOOR4[3]])
    assert reach.scale.tolist() == pytest.approx(reach.factors)
    assert float(reach.tally.sum()) == 0.0  # a new window
    reach.add(torch.tensor([3.0, 1.0, 0.0, 0.0]))
    state = json.loads(json.dumps(reach.state_dict(lambda xs: [2 * x for x in xs])))
    main, other = ReachWeights(4, 1.0, torch.device("cpu")), ReachWeights(4, 1.0, torch.device("cpu"))
    main.load_state_dict(state, is_main=True)
    other.load_state_dict(state, is_main=False)
    assert main.factors == reach.factors == other.factors
    assert main.tally.tolist() == [6.0, 2.0, 0.0, 0.0] and other.tally.tolist() == [0.0] * 4
    with pytest.raises(ValueError, match="3 slots, the drafter has 4"):
        main.load_state_dict({"factors": [1.0] * 3, "tally": [0.0] * 3}, is_main=True)


def test_trainer_weighs_slots_and_checkpoints_the_state(cache_dir: Path, tmp_path: Path) -> None:
    cfg = tiny_debug(str(cache_dir), str(tmp_path / "run"), slot_weights="reach", grad_accum=2)
    assert cfg.drafter.loss_gamma == 1.0  # reach's floor when --gamma is not given
    trainer = Trainer.build(cfg)
    try:
        state = {"factors": [0.0, 1.0, 2.0, 3.0], "tally": [0.0] * 4}
        trainer.reach.load_state_dict(state, is_main=True)
        batches = trainer.loader.iterate()
        micro = [next(batches)[0], next(batches)[0]]
        loader_state = next(batches)[1]
        batches.close()
        scale = torch.tensor(state["factors"])
        with torch.no_grad():
            expected = [
                drafter_loss(
                    trainer.model,
                    trainer.frozen,
                    m.batch,
                    attn_mask=build_attention_mask(m.batch, "dense"),
                    slot_scale=scale,
                )[1]
                for m in micro
            ]
        result = trainer.train_step(micro)
        scaled = sum(float((m.batch.weights * scale).sum()) for m in micro)
        assert result.weight_sum == pytest.approx(scaled)
        assert float(result.loss_sum) == pytest.approx(sum(float(e.loss_sum) for e in expected), rel=1e-5)
        blocks = sum(float(e.accept_at_least[0]) for e in expected)
        assert float(trainer.reach.tally[0]) == blocks > 0  # the step's blocks were tallied
        saved = trainer.save_step(loader_state)
    finally:
        trainer.close()
    meta = ckpt.read_json(saved / "meta.json")
    assert meta["slot_weights"]["factors"] == state["factors"] and meta["slot_weights"]["tally"][0] == blocks
    resumed = Trainer.build(dataclasses.replace(cfg, resume=True))
    try:
        assert resumed.resume()
        assert resumed.reach.factors == state["factors"] and float(resumed.reach.tally[0]) == blocks
    finally:
        resumed.close()


def test_a_checkpoint_from_before_the_setting_resumes(cache_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    common = {"eval_every": 0, "tensorboard": False, "plots": False}
    train(tiny_debug(str(cache_dir), str(run), max_steps=2, slot_weights="decay", **common))
    meta_path = run / "checkpoints" / "step_000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["config"]["slot_weights"]  # written before the setting existed: the paper's decay trained it
    meta_path.write_text(json.dumps(meta))
    # today's default is reach: resuming such a run without the flag is refused, naming the flag that resumes it
    with pytest.raises(
        ValueError, match=r"slot_weights: 'decay' \(checkpoint\) != 'reach'.*add --slot-weights decay"
    ):
        train(tiny_debug(str(cache_dir), str(run), max_steps=3, resume=True, **common))
    assert (
        train(
            tiny_debug(str(cache_dir), str(run), max_steps=3, resume=True, slot_weights="decay", **common)
        ).step
        == 3
    )
