"""The one layer-id rule (`shards.layers`): default ids, validation, capture sets, the exported copy, and a
shallow target training on its default ids (repeats allowed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from dflash.shards.layers import (
    capture_layer_ids,
    check_layer_ids,
    default_layer_ids,
    resolve_layer_ids,
)
from dflash.train.config import tiny_debug
from dflash.train.export import load_drafter
from dflash.train.loop import train

from tests.common.fake_cache import TINY_TARGET, write_fake_cache

HF_MODELING = Path(__file__).resolve().parents[1] / "train" / "hf_modeling.py"


def _exported_rule():
    """`_default_layer_ids` of the file every export ships as dflash.py, loaded as a user would (no dflash)."""
    spec = importlib.util.spec_from_file_location("exported_dflash", HF_MODELING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._default_layer_ids


def _outcome(rule, L: int, k: int) -> list[int] | str:
    try:
        return rule(L, k)
    except ValueError as exc:
        return f"ValueError: {exc}"


def test_exported_copy_of_the_rule_gives_the_same_ids_and_errors() -> None:
    exported = _exported_rule()
    for L in range(0, 97):
        for k in range(0, 17):
            assert _outcome(exported, L, k) == _outcome(default_layer_ids, L, k), (L, k)


@pytest.mark.parametrize(
    ("L", "K", "expected"),
    [(36, 5, [1, 9, 17, 25, 33]), (28, 5, [1, 7, 13, 19, 25]), (6, 5, [1, 2, 2, 2, 3]), (4, 5, [1] * 5)],
)
def test_default_rule_repeats_only_for_shallow_targets(L: int, K: int, expected: list[int]) -> None:
    assert default_layer_ids(L, K) == expected
    assert resolve_layer_ids(L, K) == tuple(expected)  # the resolver keeps repeats: the drafter's order
    assert capture_layer_ids(L, None, K) == sorted(set(expected))  # extraction stores each layer once


def test_validator_names_the_list_and_the_bound() -> None:
    assert check_layer_ids([3, 3, 1], 8) == (3, 3, 1)
    with pytest.raises(ValueError, match=r"target_layer_ids \[8\] are outside \[0, 8\)"):
        check_layer_ids([1, 8], 8)
    with pytest.raises(ValueError, match="layers must be layer ids >= 0"):
        check_layer_ids([1, True], what="layers")
    with pytest.raises(ValueError, match="is empty"):
        resolve_layer_ids(8, 2, [])
    with pytest.raises(
        ValueError, match=r"the default target_layer_ids \[1, 2, 2, 2, 3\].*layers \[2\] missing"
    ):
        resolve_layer_ids(6, 5, cached=[1, 3])
    with pytest.raises(ValueError, match=r"^target_layer_ids \[1, 4\] are not all cached"):
        resolve_layer_ids(6, 2, [1, 4], cached=[1, 3])


def test_six_layer_target_trains_and_exports_on_the_default_ids_of_five_draft_layers(tmp_path: Path) -> None:
    # The dry run captures the rule's ids once each ([1, 2, 3]); training reads them as [1, 2, 2, 2, 3].
    six = {**TINY_TARGET, "num_hidden_layers": 6}
    cache = write_fake_cache(
        tmp_path / "cache", num_samples=12, layers=tuple(capture_layer_ids(6)), target=six
    )
    cfg = tiny_debug(
        str(cache),
        str(tmp_path / "run"),
        num_draft_layers=5,
        max_steps=2,
        eval_every=2,
        tensorboard=False,
        plots=False,
    )
    result = train(cfg)
    assert result.step == 2 and "tau" in result.final_metrics
    drafter = load_drafter(tmp_path / "run" / "export")
    assert (
        drafter.config.target_layer_ids == (1, 2, 2, 2, 3)
        and drafter.fc.in_features == 5 * six["hidden_size"]
    )
