"""Held-out evaluation: the decode walk over several samples at once, its threads, its timing."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from dflash.shards import Cache
from dflash.train import evaluate as evaluate_mod
from dflash.train import mask as mask_module
from dflash.train.acceptance import accepted_lengths, decode_walk, walk_tau
from dflash.train.blocks import eligible_anchors
from dflash.train.data_spec import DataSpec
from dflash.train.drafter_config import DrafterConfig
from dflash.train.evaluate import build_eval_set, evaluate
from dflash.train.frozen import load_frozen_target
from dflash.train.lookup import lookup_accepted
from dflash.train.lookup_split import CLASSES, span_room
from dflash.train.model import DFlashDrafter
from dflash.train.walk_stats import row_walk, walk_se

from tests.common.fake_cache import write_fake_cache

MASK = 90  # the fake target's vocabulary leaves rows free past its tokenizer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("cache"), num_samples=24, samples_per_shard=8)


def _spec(**kw) -> DataSpec:
    return DataSpec(layer_ids=(2,), block_size=4, mask_token_id=MASK, num_anchors=8, gamma=1.0,
                    token_budget=256, max_length=128, heldout_fraction=0.5, loader_threads=2, **kw)  # fmt: skip


def _model(frozen) -> DFlashDrafter:
    torch.manual_seed(0)
    config = DrafterConfig.from_target_config(
        frozen.config, mask_token_id=MASK, num_hidden_layers=1, block_size=4, target_layer_ids=[2]
    )
    return DFlashDrafter(config).eval()


def _walk_anchor_by_anchor(model, frozen, sample, spec) -> list[int]:
    """The reference: each block drafted in a pack of its own (what a sequential decode would see)."""
    accepted_at = torch.full((sample.length,), -1, dtype=torch.long)
    for a in eligible_anchors(sample.loss_mask).tolist():
        batch = spec.pack([sample], anchors=[torch.tensor([a])], num_anchors=1)
        preds = evaluate_mod._block_predictions(model, frozen, batch)
        accepted_at[a] = accepted_lengths(preds[:1], batch.labels[:1, 1:], batch.weights[:1, 1:] > 0)[0]
    return decode_walk(accepted_at, sample.loss_mask)


def _first_eval_batch(cache_dir: Path) -> tuple:
    """spec, frozen target, drafter and the samples of the first evaluation batch."""
    spec = _spec()
    frozen = load_frozen_target(cache_dir, dtype=torch.float32)
    with Cache.open(cache_dir) as cache:
        refs = build_eval_set(cache, spec).batches[0]
        samples = [cache.shard(r.shard).read(r.index, spec.layer_ids) for r in refs]
    return spec, frozen, _model(frozen), samples


def _walk_batch(model, frozen, samples, spec) -> list[int]:
    """The evaluation's decode walk over one batch of samples: their anchors drafted together, walked in order."""
    on_host = evaluate_mod._accepted_on_host(model, frozen, samples, spec, device=torch.device("cpu"))
    return [a for steps in evaluate_mod._walks(samples, on_host) for a in steps]


@torch.no_grad()
def test_walk_over_several_samples_equals_each_block_drafted_alone(cache_dir: Path) -> None:
    spec, frozen, model, samples = _first_eval_batch(cache_dir)
    assert len(samples) >= 3
    batched = _walk_batch(model, frozen, samples, spec)
    expected = [a for s in samples for a in _walk_anchor_by_anchor(model, frozen, s, spec)]
    assert batched == expected
    assert len(expected) > len(samples)  # several decode steps per sample: the order within each one counts


@torch.no_grad()
def test_a_flex_failure_in_the_walk_leaves_training_on_flex(cache_dir: Path, monkeypatch) -> None:
    spec, frozen, model, samples = _first_eval_batch(cache_dir)
    expected = [a for s in samples for a in _walk_anchor_by_anchor(model, frozen, s, spec)]
    monkeypatch.setattr(mask_module, "_flex_failures", {})
    # As on a GPU with large walk packs: "auto" picks FlexAttention until it fails where it runs.
    monkeypatch.setattr(
        mask_module,
        "choose_backend",
        lambda _batch, backend="auto": (
            "dense" if backend == "dense" or mask_module.flex_failure() else "flex"
        ),
    )

    def lowering_fails(_device):
        def run(*_args, **_kwargs):
            raise RuntimeError("LoweringException: walk shape")

        return run

    monkeypatch.setattr(mask_module, "_flex_attention", lowering_fails)
    walked = _walk_batch(model, frozen, samples, spec)
    assert walked == expected  # the walk itself fell back to dense SDPA: same decode steps
    assert mask_module.flex_failure("decode walk") == "RuntimeError: LoweringException: walk shape"
    assert mask_module.flex_failure("train") is None  # training's batches still get FlexAttention


def test_evaluation_readers_run_torch_on_one_thread_and_report_their_time(
    cache_dir: Path, monkeypatch
) -> None:
    seen: dict[str, int] = {}
    read = evaluate_mod.read_sample

    def recording(*args, **kwargs):
        seen[threading.current_thread().name] = torch.get_num_threads()
        return read(*args, **kwargs)

    monkeypatch.setattr(evaluate_mod, "read_sample", recording)
    spec = _spec()
    frozen = load_frozen_target(cache_dir, dtype=torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # what a wide machine gives every new thread unless it is told otherwise
    try:
        with Cache.open(cache_dir) as cache:
            result = evaluate(_model(frozen), frozen, cache, build_eval_set(cache, spec), spec,
                              device=torch.device("cpu"))  # fmt: skip
        assert torch.get_num_threads() == 3  # the caller's own count is left as it was
    finally:
        torch.set_num_threads(before)
    readers = {name: n for name, n in seen.items() if name.startswith("dflash-eval")}
    assert readers and set(readers.values()) == {1}, seen
    assert result["eval_samples"] > 0 and result["walk_steps"] > 0
    assert 0 < result["eval_walk_seconds"] <= result["eval_seconds"]


def test_evaluation_draws_uniform_anchors_and_weighs_by_decay_whatever_training_did(cache_dir: Path) -> None:
    # --copy-anchor-weight changes which anchors TRAINING sees; held-out metrics of runs with and without it
    # must be measured on the same anchors, or their tau would not compare
    frozen = load_frozen_target(cache_dir, dtype=torch.float32)
    results = []
    for weight in (1.0, 20.0):
        spec = _spec(copy_anchor_weight=weight, copy_slot_weight=weight - 1.0)
        with Cache.open(cache_dir) as cache:
            result = evaluate(_model(frozen), frozen, cache, build_eval_set(cache, spec), spec,
                              device=torch.device("cpu"), walk=False)  # fmt: skip
        results.append({k: v for k, v in result.items() if "seconds" not in k})
    assert results[0] == results[1] and results[0]["eval_samples"] > 0


def _synthetic_accepted_at(model, frozen, sample, spec, *, device) -> torch.Tensor:
    """A drafter whose A varies with the anchor (0..B-1, at most the slots its span leaves), so every class
    sees short and whole blocks."""
    accepted_at = torch.full((sample.length,), -1, dtype=torch.long)
    anchors = eligible_anchors(sample.loss_mask)
    room = torch.from_numpy(span_room(sample.loss_mask.numpy(), spec.block_size))
    accepted_at[anchors] = torch.minimum((anchors * 5 + 1) % spec.block_size, room[anchors])
    return accepted_at


def _evaluations(cache_dir: Path, *options: dict) -> tuple[list[dict], list, DataSpec]:
    """`evaluate` once per `options` on the fake cache's held-out rows (one eval set), and those rows."""
    spec, cpu = _spec(), torch.device("cpu")
    frozen = load_frozen_target(cache_dir, dtype=torch.float32)
    with Cache.open(cache_dir) as cache:
        eval_set = build_eval_set(cache, spec)
        results = [evaluate(_model(frozen), frozen, cache, eval_set, spec, device=cpu, **o) for o in options]
        samples = [cache.shard(r.shard).read(r.index, spec.layer_ids) for b in eval_set.batches for r in b]
    return results, samples, spec


def test_evaluation_splits_the_drafter_by_what_lookup_accepts_and_walks_their_max(
    cache_dir: Path, monkeypatch
) -> None:
    monkeypatch.setattr(evaluate_mod, "_accepted_at", _synthetic_accepted_at)
    lookups: list[int] = []

    def counting(ids, *args, **kwargs):
        lookups.append(len(ids))
        return lookup_accepted(ids, *args, **kwargs)

    monkeypatch.setattr(evaluate_mod, "lookup_accepted", counting)
    (first, second), samples, spec = _evaluations(cache_dir, {}, {})
    cpu = torch.device("cpu")
    # Lookup ran once per row: the second evaluation reused it.
    assert len(lookups) == len(samples) == first["eval_samples"]
    timing = ("eval_seconds", "eval_walk_seconds")
    assert {k: v for k, v in second.items() if k not in timing} == {
        k: v for k, v in first.items() if k not in timing
    }
    # The reference: every eligible anchor classified one by one.
    whole = spec.block_size - 1
    pairs: dict[str, list[tuple[int, int, int]]] = {name: [] for name in CLASSES}
    max_steps: list[int] = []
    for sample in samples:
        drafter = _synthetic_accepted_at(None, None, sample, spec, device=cpu)
        lookup = torch.from_numpy(lookup_accepted(sample.input_ids.numpy(), sample.loss_mask.numpy(), whole))
        room = span_room(sample.loss_mask.numpy(), spec.block_size)  # B - 1 but near the response's end
        for a in eligible_anchors(sample.loss_mask).tolist():
            name = "full" if lookup[a] == room[a] else "none" if lookup[a] == 0 else "part"
            pairs[name].append((int(drafter[a]), int(lookup[a]), int(room[a])))
        max_steps += decode_walk(torch.maximum(drafter, lookup), sample.loss_mask)
    total = sum(map(len, pairs.values()))
    assert first["walk_split_anchors"] == total
    for name, seen in pairs.items():
        assert seen, name  # the fake rows' fixed successor gives lookup every class
        assert first[f"walk_split_{name}_share"] == pytest.approx(len(seen) / total)
        assert first[f"walk_split_{name}_drafter"] == pytest.approx(sum(d for d, _, _ in seen) / len(seen))
        assert first[f"walk_split_{name}_lookup"] == pytest.approx(sum(k for _, k, _ in seen) / len(seen))
        full = sum(d == r for d, _, r in seen) / len(seen)
        assert first[f"walk_split_{name}_drafter_full"] == pytest.approx(full)
    # Not above both walks per se: a longer step can land on a worse anchor (here below the drafter's own walk).
    assert first["tau_walk_max"] == pytest.approx(walk_tau(max_steps))


def test_each_held_out_rows_walk_is_kept_by_row_id_and_gives_the_walks_error(
    cache_dir: Path, monkeypatch
) -> None:
    monkeypatch.setattr(evaluate_mod, "_accepted_at", _synthetic_accepted_at)
    (plain, result), samples, spec = _evaluations(cache_dir, {}, {"per_row": True})
    cpu = torch.device("cpu")
    assert "walk_rows" not in plain and plain["tau_walk_se"] == result["tau_walk_se"]
    want = {
        s.row: row_walk(decode_walk(_synthetic_accepted_at(None, None, s, spec, device=cpu), s.loss_mask))
        for s in samples
    }
    assert result["walk_rows"] == want and len(want) >= 3
    tokens, steps = (sum(v) for v in zip(*want.values(), strict=True))
    assert result["tau_walk"] == pytest.approx(tokens / steps)
    assert result["tau_walk_se"] == pytest.approx(walk_se(want)) and result["tau_walk_se"] > 0
