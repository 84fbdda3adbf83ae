"""`bench/bench_quality.py --size ci`: every phase through the real CLIs (target LM -> greedy data -> extract
-> train -> export -> evaluation on held-out files) on a CPU in seconds. Checks the benchmark, not the drafter."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench import bench_quality
from bench.quality_report import SPLIT_CLASSES, print_split_table


@pytest.mark.slow
def test_ci_size_runs_every_phase_and_reports_on_heldout_rows(tmp_path: Path, capsys) -> None:
    work = tmp_path / "q"
    assert bench_quality.main(["--size", "ci", "--device", "cpu", "--work", str(work)]) == 0
    report = json.loads((work / "runs" / "quality.json").read_text())
    size = bench_quality.SIZES["ci"]
    meta = json.loads((work / "data" / "rows.json").read_text())
    # Evaluation rows come after the training rows and are held out of every run.
    assert meta["eval_rows"] == list(range(size.data.train_rows, size.data.train_rows + size.data.eval_rows))
    for fraction in size.fractions:
        heldout = set(json.loads((work / "runs" / f"heldout-{fraction:g}.json").read_text()))
        assert set(meta["eval_rows"]) <= heldout
        assert len(heldout) == size.data.eval_rows + size.data.train_rows - round(
            fraction * size.data.train_rows
        )
    base = report["baselines"]
    b = size.drafter.block_size
    assert base["prompt_lookup"]["eval_samples"] == size.data.eval_rows
    assert 1.0 <= base["prompt_lookup"]["tau_walk"] <= b
    # Untrained: random logits over the vocabulary accept (almost) nothing.
    assert base["untrained"]["tau"] < 1.5
    names = {r["run"] for r in report["runs"]}
    assert names == {"base-lossless-f1-s0", "base-fp8-f1-s0", "base-q4-f1-s0", "base-lossless-f0.5-s0"}
    for run in report["runs"]:
        assert 1.0 <= run["tau"] <= b and 1.0 <= run["tau_walk"] <= b
        assert run["eval_samples"] == size.data.eval_rows
        # The recipe's loss decay reaches dflash-train (the paper's gamma is 4 for B = 8).
        trained = json.loads((work / "runs" / run["run"] / "config.json").read_text())
        assert trained["gamma"] == size.drafter.gamma == 2.0
    # One run draws the tau-vs-steps curve (the first codec's, all rows, first seed); the rest evaluate once.
    (curve,) = report["curves"]
    assert curve["run"] == "base-lossless-f1-s0" and [p["step"] for p in curve["points"]] == [6, 12]
    out = capsys.readouterr().out
    assert "walk/lookup" in out
    # Every run carries the drafter's split by what prompt lookup accepts, printed after the main table.
    for run in report["runs"] + [base["untrained"]]:
        assert sum(run[f"walk_split_{c}_share"] for c in SPLIT_CLASSES) == pytest.approx(1.0)
        assert 1.0 <= run["tau_walk_max"] <= b
    assert f"by what prompt lookup accepts of the block's {b - 1} tokens" in out
    # Every phase is reused on a second call: nothing is recomputed.
    before = {p: p.stat().st_mtime_ns for p in (work / "runs" / "base-lossless-f1-s0" / "final").iterdir()}
    assert bench_quality.main(["--size", "ci", "--device", "cpu", "--work", str(work)]) == 0
    assert {
        p: p.stat().st_mtime_ns for p in (work / "runs" / "base-lossless-f1-s0" / "final").iterdir()
    } == before


@pytest.mark.slow
def test_score_on_extracts_the_scoring_cache_without_training_on_it(tmp_path: Path, monkeypatch) -> None:
    opened: list[Path] = []

    class Recording(bench_quality.Scorer):
        def _open(self, config) -> None:
            super()._open(config)
            opened.append(Path(self.cache.path))

    monkeypatch.setattr(bench_quality, "Scorer", Recording)
    work = tmp_path / "q"
    argv = ["--size", "ci", "--device", "cpu", "--work", str(work), "--codecs", "q4", "--fractions", "1"]
    assert bench_quality.main([*argv, "--score-on", "lossless"]) == 0
    report = json.loads((work / "runs" / "quality.json").read_text())
    assert report["scored_on"] == "lossless" and [r["run"] for r in report["runs"]] == ["base-q4-f1-s0"]
    assert json.loads((work / "cache-lossless" / "manifest.json").read_text())["complete"]
    assert opened == [work / "cache-lossless"]  # the q4 drafter was scored on exact states


def test_first_seed_adds_seeds_to_an_earlier_experiment(tmp_path: Path) -> None:
    # `--first-seed 2 --seeds 1` plans only seed 2's runs, so a later session extends seeds 0-1 in place;
    # that seed then draws the curve and the data-size runs, as seed 0 does in a run of its own.
    size = replace(bench_quality.SIZES["cpu"], seeds=1)
    runs = bench_quality.plan_runs(tmp_path, size, ["lossless", "q4"], {"a": ()}, first_seed=2)
    assert sorted(r.name for r in runs) == ["a-lossless-f0.25-s2", "a-lossless-f1-s2", "a-q4-f1-s2"]
    assert [r.name for r in runs if r.curve] == ["a-lossless-f1-s2"]
    assert all(r.dir == tmp_path / r.name for r in runs)


def _split(full: tuple[float, float, float, float], none: tuple[float, float, float, float]) -> dict:
    """An evaluation's split keys with no anchor where lookup accepts part of the block."""
    keys = {"walk_split_anchors": 10, "walk_split_part_share": 0.0, "tau_walk_max": 2.5}
    for name, (share, drafter, lookup, whole) in (("full", full), ("none", none)):
        keys |= {f"walk_split_{name}_share": share, f"walk_split_{name}_drafter": drafter,
                 f"walk_split_{name}_lookup": lookup, f"walk_split_{name}_drafter_full": whole}  # fmt: skip
    return keys


def test_split_table_prints_each_runs_classes_and_skips_old_reports(capsys) -> None:
    report = {
        "size": {"drafter": {"block_size": 8}},
        "baselines": {"untrained": _split((0.3, 0.0, 7.0, 0.0), (0.7, 0.01, 0.0, 0.0))},
        "runs": [{"run": "base-lossless-f1-s0", **_split((0.3, 2.31, 7.0, 0.07), (0.7, 0.62, 0.0, 0.01))},
                 {"run": "failed-run", "error": "boom"}],
    }  # fmt: skip
    print_split_table(report)
    lines = capsys.readouterr().out.splitlines()
    assert "lookup all 7" in lines[2] and "lookup 1-6" in lines[2]
    (row,) = [line for line in lines if line.startswith("base-lossless-f1-s0")]
    assert row.split()[1:] == ["30%", "2.31/7.00", "7%", "0%", "-", "70%", "0.62/0.00", "1%", "2.500"]
    assert not any(line.startswith("failed-run") for line in lines)
    # A report written before the split prints no split table.
    report["runs"] = [{"run": "old", "tau": 2.0}]
    report["baselines"]["untrained"] = {"tau": 1.0}
    print_split_table(report)
    assert capsys.readouterr().out == ""
