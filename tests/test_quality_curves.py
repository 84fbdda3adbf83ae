"""`bench/quality_curves.py`: what a device job cut before its runs end still measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.quality_curves import format_curves, gaps_by_step, read_curves
from bench.quality_sizes import SIZES, plan_runs


def _metrics(run_dir: Path, walks: dict[int, float], tail: str = "") -> None:
    run_dir.mkdir(parents=True)
    lines = []
    for step, walk in walks.items():
        lines += [json.dumps({"step": step - 50, "loss": 1.0}), json.dumps({"step": step, "tau_walk": walk})]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)


def test_pairs_are_compared_at_each_step_both_runs_evaluated(tmp_path: Path) -> None:
    _metrics(tmp_path / "runs-s0" / "base-lossless-f1-s0", {1000: 3.0, 2000: 4.0})
    # a faster run, cut in the middle of writing a line
    _metrics(tmp_path / "runs-s0" / "base-q4-f1-s0", {1000: 2.97, 2000: 3.96, 3000: 4.4}, tail='{"step": 30')
    _metrics(tmp_path / "runs-distill-s0" / "distill-lossless-f1-s0", {1000: 3.06})
    _metrics(tmp_path / "runs-s1" / "base-fp8-f1-s1", {1000: 3.3})  # no lossless run of seed 1: no pair
    _metrics(tmp_path / "target", {100: 9.9})  # not a benchmark run's folder
    _metrics(tmp_path / "runs-s0" / "old-q4-run-copy", {100: 9.9})  # dashes, but no fraction and seed
    curves = read_curves(tmp_path)
    assert sorted(curves) == [
        "base-fp8-f1-s1",
        "base-lossless-f1-s0",
        "base-q4-f1-s0",
        "distill-lossless-f1-s0",
    ]
    assert [p["step"] for p in curves["base-q4-f1-s0"]] == [1000, 2000, 3000]
    gaps = {(g["step"], g["differ"], g[g["differ"]]): g for g in gaps_by_step(curves)}
    assert sorted(gaps) == [
        (1000, "codec", "q4"), (1000, "variant", "distill"), (2000, "codec", "q4")
    ]  # fmt: skip
    assert gaps[1000, "codec", "q4"]["per_seed"] == pytest.approx([-0.01])
    assert gaps[2000, "codec", "q4"]["per_seed"] == pytest.approx([-0.01])
    assert gaps[1000, "variant", "distill"]["per_seed"] == pytest.approx([0.02])
    assert gaps[1000, "variant", "distill"]["reference"] == "base"
    text = format_curves(curves)
    assert "base-q4-f1-s0           1000: 2.970  2000: 3.960  3000: 4.400" in text
    assert "step  2000  q4 vs lossless (base), seeds s0 -1.0%" in text
    assert "step  1000  distill vs base (lossless), seeds s0 +2.0%" in text


def test_nothing_evaluated_yet_says_so(tmp_path: Path) -> None:
    assert format_curves(read_curves(tmp_path)) == "no run has evaluated yet\n"


def test_every_curve_makes_every_all_rows_run_evaluate_along_the_way() -> None:
    size = SIZES["cpu"]
    first = plan_runs(Path("r"), size, ["lossless", "q4"], {"base": ()}, first_seed=2)
    every = plan_runs(Path("r"), size, ["lossless", "q4"], {"base": ()}, first_seed=2, every_curve=True)
    assert [r.name for r in first] == [r.name for r in every]
    assert [r.name for r in first if r.curve] == ["base-lossless-f1-s2"]
    assert all(r.curve == (r.fraction == 1.0) for r in every)
