"""End-to-end training on a tiny cache: logs, evaluation, checkpoints, export, exact resume after kill -9."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from dflash.shards.errors import ManifestMismatch
from dflash.train import checkpoint as ckpt
from dflash.train.config import tiny_debug
from dflash.train.dry_run import dry_run, print_plan
from dflash.train.export import load_drafter
from dflash.train.lookup_split import CLASSES
from dflash.train.loop import train
from dflash.train.loss import drafter_loss
from dflash.train.mask import build_attention_mask
from dflash.train.metrics import read_metrics
from dflash.train.model import DFlashDrafter
from dflash.train.schedule import Schedule, lr_at
from dflash.train.startup import PHASES
from dflash.train.trainer import Trainer

from tests.common.fake_cache import write_fake_cache
from tests.common.train_cli import train_killed_at, train_resumed

OPTIM = tiny_debug("cache", "out").optim


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return write_fake_cache(tmp_path_factory.mktemp("cache"), num_samples=40, samples_per_shard=10)


def test_lr_schedule_warmup_then_cosine() -> None:
    lrs = [lr_at(s, base_lr=1.0, warmup_steps=4, total_steps=20, min_lr_frac=0.1) for s in range(24)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))
    assert lrs[-1] == pytest.approx(0.1) and lrs[20] == pytest.approx(0.1)


def test_run_logs_evaluates_checkpoints_and_exports(cache_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = tiny_debug(
        str(cache_dir), str(run), max_steps=8, eval_every=4, save_every=4, log_every=2, keep_checkpoints=1
    )
    result = train(cfg)
    assert result.step == 8
    records = read_metrics(run)
    assert [r["step"] for r in records] == [2, 4, 6, 8]
    for r in records:
        assert {"step", "loss", "lr", "tokens_per_s", "data_wait_frac", "epoch"} <= set(r)
        assert r["loss"] > 0 and 0 <= r["data_wait_frac"] <= 1
    evals = [r for r in records if "tau" in r]
    assert [r["step"] for r in evals] == [4, 8]
    assert all(
        1.0 <= r["tau"] <= cfg.drafter.block_size and len(r["acceptance_per_position"]) == 3 for r in evals
    )
    # Prompt lookup walks the same held-out rows: a reference that no training step can move.
    assert 1.0 <= evals[0]["tau_walk_lookup"] <= cfg.drafter.block_size
    assert evals[0]["tau_walk_lookup"] == evals[1]["tau_walk_lookup"]
    assert all(evals[0][f"walk_split_{c}_share"] == evals[1][f"walk_split_{c}_share"] for c in CLASSES)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [8]  # keep_checkpoints=1 pruned step 4
    meta = ckpt.read_json(run / "checkpoints" / "step_000008" / "meta.json")
    assert meta["step"] == 8 and meta["config"]["lr"] == cfg.optim.lr and len(meta["manifest_sha256"]) == 64
    assert (run / "best" / "meta.json").is_file()
    drafter = load_drafter(run / "export")
    assert drafter.config.target_layer_ids == (2,) and drafter.config.mask_token_id == 90
    assert {p.name for p in (run / "plots").iterdir()} >= {"loss.png", "tau.png", "acceptance.png"}
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))

    # A second run into the same directory must not silently overwrite it.
    with pytest.raises(ValueError, match="--resume"):
        train(cfg)
    # Resuming with a setting that changes the trajectory names it.
    with pytest.raises(ValueError, match=r"lr: 0\.001 \(checkpoint\) != 0\.002"):
        train(tiny_debug(str(cache_dir), str(run), lr=2e-3, resume=True, max_steps=9, keep_checkpoints=1))


def test_the_best_drafter_is_the_best_decode_walk_not_the_best_tau(
    cache_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    # tau on sampled anchors rising while the walk falls (the quality benchmark's prose target did so): the
    # step with the best walk is the one RUN/best and RUN/export keep.
    scripted = {2: (2.0, 1.5), 4: (2.5, 1.8), 6: (3.0, 1.6)}
    real = Trainer.evaluate

    def evaluate(self: Trainer) -> dict:
        tau, walk = scripted[self.step]
        return {**real(self), "tau": tau, "tau_walk": walk}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    run = tmp_path / "run"
    result = train(tiny_debug(str(cache_dir), str(run), max_steps=6, eval_every=2, save_every=0))
    assert result.best_walk == 1.8
    best = ckpt.read_json(run / "best" / "meta.json")
    assert best["step"] == 4 and best["best_walk"] == 1.8
    exported = load_drafter(run / "export")
    kept = DFlashDrafter(exported.config)
    ckpt.load_weights(kept, run / "best" / "model.safetensors")
    pairs = zip(exported.state_dict().values(), kept.state_dict().values(), strict=True)
    assert all(torch.equal(a, b.to(a.dtype)) for a, b in pairs)  # the export is step 4's weights


def test_early_stop_ends_the_run_where_the_walk_fell_and_a_resume_trains_on_only_when_told(
    cache_dir: Path, tmp_path: Path, monkeypatch, caplog, capsys
) -> None:
    # prose's curve on the quality benchmark: a peak, then the walk falls. 1.6 is 11% below 1.8: the run ends
    # at step 6 of 12, its checkpoint there says so, and RUN/export keeps step 4's drafter.
    walks = {2: 1.5, 4: 1.8, 6: 1.6, 8: 1.7, 10: 1.9, 12: 2.0}
    real = Trainer.evaluate
    monkeypatch.setattr(Trainer, "evaluate", lambda self: {**real(self), "tau_walk": walks[self.step]})
    run = tmp_path / "run"
    knobs = dict(epochs=3, eval_every=2, save_every=0, tensorboard=False, plots=False)  # 12 steps
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        result = train(tiny_debug(str(cache_dir), str(run), early_stop=0.1, **knobs))
    assert (result.step, result.ended_early, result.best_walk) == (6, True, 1.8)
    meta = json.loads((ckpt.latest_checkpoint(run) / "meta.json").read_text())
    assert (meta["step"], meta["ended_early"], meta["finished"]) == (6, True, False)
    assert read_metrics(run)[-1]["ended_early"] is True
    assert ckpt.read_json(run / "best" / "meta.json")["step"] == 4
    assert any("11.1% below the best, 1.800" in r.getMessage() for r in caplog.records)

    # a resume with it on trains nothing (its dry run says so); with --early-stop 0 it goes on where the run
    # was, to its end
    planned = dry_run(tiny_debug(str(cache_dir), str(run), early_stop=0.1, resume=True, **knobs))
    assert (planned["resume_step"], planned["ended_early"]) == (6, True)
    print_plan(planned)
    assert "resumes at step 6, where --early-stop ended the run: nothing to train" in capsys.readouterr().out
    assert not dry_run(tiny_debug(str(cache_dir), str(run), early_stop=0.0, resume=True, **knobs))[
        "ended_early"
    ]
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        again = train(tiny_debug(str(cache_dir), str(run), early_stop=0.1, resume=True, **knobs))
    assert (again.step, again.ended_early) == (6, True)
    assert any(
        "nothing to train; --resume --early-stop 0 trains on" in r.getMessage() for r in caplog.records
    )
    on = train(tiny_debug(str(cache_dir), str(run), early_stop=0.0, resume=True, **knobs))
    assert (on.step, on.ended_early, on.best_walk) == (12, False, 2.0)
    # a fall smaller than the share does not end a run
    calm = train(tiny_debug(str(cache_dir), str(tmp_path / "calm"), early_stop=0.2, **knobs))
    assert (calm.step, calm.ended_early) == (12, False)


def test_startup_breakdown_once_per_launch(cache_dir: Path, tmp_path: Path, caplog) -> None:
    """Each launch's set-up, phase by phase to the end of its first step: one INFO line, and a `startup`
    entry in the launch's first metrics record (other keys and records as before)."""
    run = tmp_path / "run"
    quiet = dict(eval_every=0, save_every=2, log_every=2, tensorboard=False, plots=False)
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        train(tiny_debug(str(cache_dir), str(run), max_steps=4, **quiet))
        train(tiny_debug(str(cache_dir), str(run), max_steps=6, resume=True, **quiet))
    records = read_metrics(run)
    assert [r["step"] for r in records] == [2, 4, 6]
    assert [("startup" in r) for r in records] == [True, False, True]  # the resumed launch's first record
    for startup in (records[0]["startup"], records[2]["startup"]):
        assert list(startup) == [*(f"{p}_s" for p in PHASES), "total_s"]
        assert all(isinstance(v, float) and v >= 0 for v in startup.values())
        assert sum(v for k, v in startup.items() if k != "total_s") <= startup["total_s"]
        # floored to the millisecond, a tiny drafter's build can read 0.0 (CI saw it); its first step cannot
        assert startup["first_step_s"] > 0
    assert records[0]["startup"]["resume_s"] == 0 < records[2]["startup"]["resume_s"]
    lines = [r.getMessage() for r in caplog.records if "start-up" in r.getMessage()]
    assert len(lines) == 2 and all(r.levelno == logging.INFO for r in caplog.records if "start-up" in r.msg)
    assert lines[0].startswith("start-up ") and " s to the end of the first step: " in lines[0], lines[0]
    # the line names the phases of 0.01 s or more: a tiny run's first step is sometimes under that
    first_step = records[0]["startup"]["first_step_s"]
    assert ("first_step " in lines[0]) == (first_step >= 0.01), (first_step, lines[0])
    assert lines[0].rsplit(", ", 1)[1].startswith("other ")


def test_resume_against_another_cache_is_refused(cache_dir: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(tiny_debug(str(cache_dir), str(run), max_steps=2, eval_every=0, tensorboard=False, plots=False))
    other = write_fake_cache(tmp_path / "other", num_samples=40, samples_per_shard=10, codec="fp8")
    with pytest.raises(ManifestMismatch, match="codec"):
        train(tiny_debug(str(other), str(run), max_steps=4, resume=True, eval_every=0))


def test_a_resume_that_lengthens_the_run_plans_its_schedule_again(
    cache_dir: Path, tmp_path: Path, caplog
) -> None:
    """`--resume --epochs 4` after a 2-epoch run. From its last checkpoint (finished: lr annealed to the floor,
    0 by default, where added epochs used to train nothing) the schedule restarts over the added epochs, warmup
    and cosine; from a checkpoint mid-way it ends at the new end, as a fresh 4-epoch run's does."""
    quiet = dict(eval_every=0, log_every=1, save_every=4, keep_checkpoints=4, tensorboard=False, plots=False)
    run, fresh = tmp_path / "run", tmp_path / "fresh"
    first = train(tiny_debug(str(cache_dir), str(run), epochs=2, **quiet))
    shutil.copytree(run, tmp_path / "midway")
    with caplog.at_level(logging.INFO, logger="dflash.train"):
        resumed = train(tiny_debug(str(cache_dir), str(run), epochs=4, resume=True, **quiet))
    lrs = {r["step"]: r["lr"] for r in read_metrics(run)}
    added = range(first.step + 1, resumed.step + 1)
    assert resumed.step == 2 * first.step and lrs[first.step] < 0.05 * lrs[1]  # annealed
    restart = Schedule(total=resumed.step, start=first.step)
    assert [lrs[s] for s in added] == pytest.approx([restart.lr(s - 1, OPTIM) for s in added])
    assert max(lrs[s] for s in added) == pytest.approx(OPTIM.lr)  # back up to the base lr, then annealed
    line = next(r.getMessage() for r in caplog.records if "resume: --epochs 2 -> 4" in r.getMessage())
    assert "the run had finished: its schedule restarts" in line, line
    assert f"to step {resumed.step} (was {first.step})" in line, line
    meta = json.loads((ckpt.latest_checkpoint(run) / "meta.json").read_text())
    assert (meta["total_steps"], meta["schedule_start"], meta["finished"]) == (resumed.step, first.step, True)

    # mid-way (step 4, not finished): the 4-epoch cosine from step 4 on, a fresh 4-epoch run's lr step for step
    midway = tmp_path / "midway"
    step_4 = ckpt.find_checkpoint(midway, step=4)
    assert json.loads((step_4 / "meta.json").read_text())["finished"] is False
    train(tiny_debug(str(cache_dir), str(midway), epochs=4, resume=True, resume_from=str(step_4), **quiet))
    train(tiny_debug(str(cache_dir), str(fresh), epochs=4, **quiet))
    mid_lrs = {r["step"]: r["lr"] for r in read_metrics(midway)}
    fresh_lrs = {r["step"]: r["lr"] for r in read_metrics(fresh)}
    assert [mid_lrs[s] for s in range(5, 17)] == pytest.approx([fresh_lrs[s] for s in range(5, 17)])


def test_train_step_alone(cache_dir: Path, tmp_path: Path) -> None:
    trainer = Trainer.build(tiny_debug(str(cache_dir), str(tmp_path / "run"), grad_accum=2))
    try:
        batches = trainer.loader.iterate()
        micro = [next(batches)[0], next(batches)[0]]
        batches.close()
        before = [p.detach().clone() for p in trainer.model.parameters()]
        with torch.no_grad():
            expected = [
                drafter_loss(
                    trainer.model, trainer.frozen, m.batch, attn_mask=build_attention_mask(m.batch, "dense")
                )[1]
                for m in micro
            ]
        result = trainer.train_step(micro)
    finally:
        trainer.close()
    total = trainer.total_steps
    assert trainer.step == 1
    assert result.lr == lr_at(
        0, base_lr=1e-3, warmup_steps=round(0.04 * total), total_steps=total, min_lr_frac=0
    )
    assert result.weight_sum == pytest.approx(sum(float(m.batch.weights.sum()) for m in micro))
    assert float(result.loss_sum) == pytest.approx(sum(float(e.loss_sum) for e in expected), rel=1e-5)
    assert result.tokens == sum(m.tokens for m in micro) and torch.isfinite(result.grad_norm)
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_default_layer_ids_must_be_cached(tmp_path: Path) -> None:
    cache = write_fake_cache(tmp_path / "c", num_samples=8, layers=(0, 1, 3))
    with pytest.raises(ValueError, match=r"default target_layer_ids \[2\].*cache holds \[0, 1, 3\]"):
        train(tiny_debug(str(cache), str(tmp_path / "run"), max_steps=1))


def test_evaluating_along_the_way_leaves_training_unchanged(cache_dir: Path, tmp_path: Path) -> None:
    # bench/quality_curves.py compares two runs at the steps both evaluated; only fair if an evaluation draws
    # from its own generator and leaves the model, optimizer and data order as it found them
    def trajectory(eval_every: int) -> tuple[list[tuple], int]:
        run = tmp_path / f"every-{eval_every}"
        cfg = tiny_debug(
            str(cache_dir),
            str(run),
            max_steps=6,
            eval_every=eval_every,
            log_every=1,
            tensorboard=False,
            plots=False,
        )
        train(cfg)
        rows = read_metrics(run)
        steps = [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in rows if "loss" in r]
        return steps, sum("tau_walk" in r for r in rows)

    (alone, _), (evaluated, evaluations) = trajectory(0), trajectory(2)
    assert evaluations >= 2 and len(alone) == 6
    assert evaluated == alone


def test_kill9_then_resume_reproduces_the_losses_exactly(cache_dir: Path, tmp_path: Path) -> None:
    flags = [
        "--preset",
        "tiny",
        "--cache",
        str(cache_dir),
        "--max-steps",
        "14",
        "--save-every",
        "5",
        "--eval-every",
        "7",
        "--log-every",
        "1",
        "--no-tensorboard",
        "--no-plots",
        "--grad-accum",
        "2",
        "--epochs",
        "10",
    ]
    reference = tmp_path / "reference"
    train(
        tiny_debug(
            str(cache_dir),
            str(reference),
            max_steps=14,
            save_every=5,
            eval_every=7,
            log_every=1,
            tensorboard=False,
            plots=False,
            grad_accum=2,
            epochs=10,
        )
    )
    run = tmp_path / "run"
    train_killed_at([*flags, "--out", str(run)], 8)
    assert [r["step"] for r in read_metrics(run)][-1] == 8  # it died after step 8, checkpoint at 5
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [5]
    train_resumed([*flags, "--out", str(run)])

    def trajectory(path: Path) -> list[tuple]:
        return [
            (r["step"], r["loss"], r["lr"], r["grad_norm"], r.get("tau"), r.get("eval_loss"))
            for r in read_metrics(path)
        ]

    expected = trajectory(reference)
    assert [s for s, *_ in expected] == list(range(1, 15))
    assert trajectory(run) == expected  # bit for bit, including the steps redone after the kill
    assert json.loads((run / "checkpoints" / "step_000014" / "loader.json").read_text()) == json.loads(
        (reference / "checkpoints" / "step_000014" / "loader.json").read_text()
    )
