"""`dflash-train --dry-run`: the run's start-up checks and its plan, with nothing written and no GPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from common.fake_cache import write_fake_cache
from common.hostile import resign_manifest
from common.train_cli import tiny_train_argv
from dflash.shards import Cache, load_manifest
from dflash.train import dry_run as dry_run_module
from dflash.train.cli import build_config
from dflash.train.cli import main as train_main
from dflash.train.model import DFlashDrafter
from dflash.train.run_parts import checked_parts
from dflash.train.schedule import MAX_EPOCHS, MIN_BATCHES, batches_per_epoch, estimate_total_steps
from dflash.train.startup import StartupClock


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return write_fake_cache(tmp_path / "cache", num_samples=24, samples_per_shard=8)


def _plan(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, str]:
    assert train_main([*argv, "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return {line[:12].strip(): line[12:] for line in lines}


def test_plan_matches_the_run_and_writes_nothing(cache: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = tiny_train_argv(cache, tmp_path / "run", "--epochs", "3")
    plan = _plan(capsys, argv)
    assert not (tmp_path / "run").exists()  # not even the --out directory
    cfg = build_config(argv)
    steps = estimate_total_steps(load_manifest(cache), cfg, world_size=2)
    assert plan["schedule"].startswith(f"~{steps:,} optimizer steps (3 epochs, world 2)")
    # The parameter count is the real drafter's (the plan builds it on the meta device).
    result = dry_run_module.dry_run(cfg, 2)
    with Cache.open(cache) as opened:
        _, drafter_cfg, _ = checked_parts(cfg, opened, StartupClock())
    drafter = DFlashDrafter(drafter_cfg)
    trained = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    assert result["params"] == trained and result["checkpoint_bytes"] == 12 * trained
    assert result["checkpoints_disk_bytes"] == 12 * trained * (cfg.keep_checkpoints + 1) + 4 * trained
    assert plan["checks"].startswith("passed") and "fits" in plan["checkpoints"]
    assert plan["not cached"] == "none: every dataset row is in the cache"
    assert plan["held out"].endswith("never trained on; evaluated every 10 steps")  # tiny: no early stop
    early = _plan(capsys, [*argv, "--early-stop", "0.02"])["held out"]
    assert early.endswith("every 10 steps, the run ends at a walk 2% below its best (--early-stop)")


def test_a_disk_too_small_for_the_checkpoints_is_said(
    cache: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setattr(dry_run_module, "_free_bytes", lambda path: 1000)
    plan = _plan(capsys, tiny_train_argv(cache, tmp_path / "run"))
    assert "DOES NOT FIT" in plan["checkpoints"]


def test_what_the_run_would_refuse_is_refused(cache: Path, tmp_path: Path, capsys) -> None:
    config = cache / "target" / "config.json"
    config.write_bytes(config.read_bytes() + b" ")
    assert train_main([*tiny_train_argv(cache, tmp_path / "run"), "--dry-run"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json: damaged or replaced since written" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_run_directory_with_checkpoints_needs_resume(cache: Path, tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    assert train_main(tiny_train_argv(cache, run, "--max-steps", "2", "--no-tensorboard", "--no-plots")) == 0
    capsys.readouterr()
    before = sorted(os.listdir(run))
    assert train_main([*tiny_train_argv(cache, run), "--dry-run"]) != 0
    assert "already holds checkpoints: pass --resume" in capsys.readouterr().err
    plan = _plan(capsys, [*tiny_train_argv(cache, run), "--resume"])
    assert plan["out"].endswith("(resumes at step 2)")  # not ended by --early-stop: nothing else said
    # what the resume plans: the first run finished at --max-steps 2, this command runs its epochs out
    manifest = load_manifest(cache)
    epochs = estimate_total_steps(manifest, build_config(tiny_train_argv(cache, run)), world_size=1)
    assert plan["schedule"].startswith(f"~{epochs:,} optimizer steps")
    assert plan["schedule"].endswith(
        "the run had finished: its schedule restarts at step 2 (--max-steps 2 -> None)"
    )
    same = _plan(capsys, [*tiny_train_argv(cache, run, "--max-steps", "2"), "--resume"])
    assert same["schedule"].startswith("~2 optimizer steps") and "again" not in same["schedule"]
    # and what it would refuse, in the run's own words
    assert train_main([*tiny_train_argv(cache, run), "--resume", "--lr", "0.5", "--dry-run"]) != 0
    assert "--resume with settings that change the trajectory: lr: " in capsys.readouterr().err
    assert sorted(os.listdir(run)) == before
    # The planned size is what a checkpoint weighs (its JSON files and headers aside).
    predicted = dry_run_module.dry_run(build_config([*tiny_train_argv(cache, run), "--resume"]))
    (latest,) = (run / "checkpoints").glob("step_*")
    weighed = sum((latest / f).stat().st_size for f in ("model.safetensors", "optimizer.safetensors"))
    assert predicted["checkpoint_bytes"] <= weighed <= predicted["checkpoint_bytes"] * 1.1


def test_a_bad_world_size_is_named(cache: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "eight")
    assert train_main([*tiny_train_argv(cache, tmp_path / "run"), "--dry-run"]) != 0
    assert "WORLD_SIZE='eight': expected a whole number >= 1" in capsys.readouterr().err


def test_rows_extraction_skipped_are_counted_by_reason(cache: Path, tmp_path: Path, capsys) -> None:
    def two_skipped(d: dict) -> None:
        d["dataset"]["rows"] = 27
        d["skipped"] = [{"row": 24, "reason": "overlong"}, {"row": 25, "reason": "empty"}]
        d["skipped"].append({"row": 26, "reason": "overlong"})

    resign_manifest(cache, two_skipped)
    plan = _plan(capsys, tiny_train_argv(cache, tmp_path / "run"))
    assert plan["not cached"] == "1 empty, 2 overlong (rows extraction skipped)"


def test_epochs_left_out_are_the_caches_default_and_a_resume_keeps_its_runs(
    cache: Path, tmp_path: Path, capsys
) -> None:
    unset = tmp_path / "unset.json"  # the tiny preset sets epochs; a config file can take it back out
    unset.write_text('{"epochs": null}')
    per_epoch = batches_per_epoch(load_manifest(cache), build_config(tiny_train_argv(cache, tmp_path / "x")))
    assert per_epoch * MAX_EPOCHS < MIN_BATCHES  # a small cache: the default's longest
    plan = _plan(capsys, tiny_train_argv(cache, tmp_path / "new", "--config", str(unset)))
    assert (
        f"({MAX_EPOCHS} epochs: dflash-train's default for {per_epoch} batches an epoch" in plan["schedule"]
    )
    # the run pins the number: its checkpoints say how long it is
    auto = tmp_path / "auto"
    quiet = ("--max-steps", "2", "--no-tensorboard", "--no-plots")
    assert train_main(tiny_train_argv(cache, auto, "--config", str(unset), *quiet)) == 0
    (latest,) = (auto / "checkpoints").glob("step_*")
    assert json.loads((latest / "meta.json").read_text())["config"]["epochs"] == MAX_EPOCHS
    # a run of 1 epoch resumed with --epochs left out stays 1 epoch long: its schedule is not moved
    short = tmp_path / "short"
    assert train_main(tiny_train_argv(cache, short, "--epochs", "1", *quiet)) == 0
    capsys.readouterr()
    resumed = _plan(
        capsys, [*tiny_train_argv(cache, short, "--config", str(unset), "--max-steps", "2"), "--resume"]
    )
    assert "(1 epochs: the resumed run's" in resumed["schedule"] and "--epochs" not in resumed["schedule"]
    given = _plan(capsys, [*tiny_train_argv(cache, short, "--epochs", "3"), "--resume"])
    assert "(3 epochs, world 1)" in given["schedule"] and "--epochs 1 -> 3" in given["schedule"]
