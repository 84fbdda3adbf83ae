"""`bench/bench_quality.py --size ci`: every phase through the real CLIs (target LM -> greedy data -> extract
-> train -> export -> evaluation on held-out files) on a CPU in seconds. Checks the benchmark, not the drafter."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
import transformers
from common.quality import ci_argv
from dflash.train.checkpoint import latest_checkpoint

from bench import bench_quality, quality_data, quality_phases, quality_sizes
from bench.quality_report import SPLIT_CLASSES, print_split_table, print_table


@pytest.mark.slow
def test_ci_size_runs_every_phase_and_reports_on_heldout_rows(tmp_path: Path, capsys) -> None:
    work = tmp_path / "q"
    assert bench_quality.main(ci_argv(work)) == 0
    report = json.loads((work / "runs" / "quality.json").read_text())
    size = bench_quality.SIZES["ci"]
    meta = json.loads((work / "data" / "rows.json").read_text())
    assert meta["rows_sha256"] == hashlib.sha256((work / "data" / "rows.arrow").read_bytes()).hexdigest()
    # Evaluation rows come after the training rows and are held out of every run.
    assert meta["eval_rows"] == list(range(size.data.train_rows, size.data.train_rows + size.data.eval_rows))
    for fraction in size.fractions:
        heldout = set(json.loads((work / "runs" / f"heldout-{fraction:g}.json").read_text()))
        assert set(meta["eval_rows"]) <= heldout
        assert len(heldout) == size.data.eval_rows + size.data.train_rows - round(
            fraction * size.data.train_rows
        )
    # Which stack built the target and ran the drafters: a build repeats its weights on one stack only.
    for stack in (report["target"]["built_with"], report["run_with"]):
        assert stack["torch"] == torch.__version__ and stack["transformers"] == transformers.__version__
    # Each extraction's throughput and stage table, so a slow one says where its time went.
    assert {r["run"].split("-")[1] for r in report["runs"]} <= set(report["extractions"])  # base-CODEC-f1-s0
    for codec, summary in report["extractions"].items():
        assert summary[0].startswith(f"cache W/cache-{codec}: complete")  # the work folder's path left out
        assert any(line.split()[:2] == ["forward", "(cpu)"] for line in summary)
        assert any(line.startswith("write ") for line in summary)
        assert not any(str(work) in line for line in summary)
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
    # the default length its runs trained under: it merges with reports of the same only
    assert report["default_epochs"] == "6, up to 10 below 6,000 batches; --early-stop 0.02"
    assert json.loads((work / "cache-lossless" / "manifest.json").read_text())["complete"]
    assert opened == [work / "cache-lossless"]  # the q4 drafter was scored on exact states


def test_deadline_starts_no_run_the_runs_so_far_say_would_not_end_in_time(tmp_path: Path, capsys) -> None:
    """A device call kills what still runs at its limit, losing the run and its device time: with --deadline
    the first run always starts (nothing to go by), a later one only if the longest so far would end in time.
    Here every run takes more than the whole deadline, so the second seed is reported as not started, its
    group's row says so, and the benchmark still succeeds on the run it finished."""
    assert quality_sizes.starts_in_time(10.0, []) and quality_sizes.starts_in_time(10.0, [4.0, 10.0])
    assert not quality_sizes.starts_in_time(9.9, [4.0, 10.0]) and not quality_sizes.starts_in_time(
        -1.0, [1.0]
    )
    work = tmp_path / "q"
    argv = ci_argv(work, "--codecs", "lossless,fp8", "--fractions", "1")
    assert bench_quality.main([*argv, "--parallel", "1", "--deadline", "0.001"]) == 0
    report = json.loads((work / "runs" / "quality.json").read_text())
    done, skipped = report["runs"]
    assert done["run"] == "base-lossless-f1-s0" and "tau_walk" in done and "not_started" not in done
    assert (
        skipped["run"] == "base-fp8-f1-s0"
        and "tau" not in skipped
        and "left before --deadline" in skipped["not_started"]
    )
    assert not (work / "runs" / "base-fp8-f1-s0").exists()
    assert [row.get("not_started", False) for row in report["table"]] == [True, False]  # fp8 sorts first
    assert "base: fp8, 100% rows" in capsys.readouterr().out.split("not started (--deadline)")[0]


@pytest.mark.slow
def test_a_run_killed_mid_training_goes_on_from_its_last_checkpoint_to_the_same_drafter(
    tmp_path: Path,
) -> None:
    """A device call's limit SIGKILLs the benchmark and its training run; the same command again (on the same
    machine) goes on from the run's last checkpoint, as dflash-train tells a user to, and ends where an
    uninterrupted run ends: same losses, same held-out evaluation."""
    work = tmp_path / "q"
    argv = ci_argv(work, "--codecs", "lossless", "--fractions", "1", "--steps", "400")
    assert bench_quality.main([*argv, "--stop-after", "extract"]) == 0  # target, rows, cache: shared
    cut = work / "cut" / "base-lossless-f1-s0"
    child = subprocess.Popen(
        [sys.executable, bench_quality.__file__, *argv, "--runs-dir", "cut"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        while latest_checkpoint(cut) is None:  # a committed one
            assert child.poll() is None, (work / "cut" / "base-lossless-f1-s0.log").read_text()[-2000:]
            time.sleep(0.02)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    assert not (cut / "final").exists()
    kept = latest_checkpoint(cut).name
    assert bench_quality.main([*argv, "--runs-dir", "cut"]) == 0
    assert bench_quality.main([*argv, "--runs-dir", "whole"]) == 0
    [resumed], [whole] = (
        json.loads((work / d / "quality.json").read_text())["runs"] for d in ("cut", "whole")
    )
    assert resumed["resumed_from"] == kept and "resumed_from" not in whole
    assert resumed["eval_loss"] == whole["eval_loss"] and resumed["tau"] == whole["tau"]

    def losses(runs: str) -> dict[int, float]:
        lines = (work / runs / "base-lossless-f1-s0" / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r and "tau" not in r}

    after = {s: v for s, v in losses("whole").items() if s > int(kept.removeprefix("step_"))}
    assert after and {s: losses("cut")[s] for s in after} == after
    log = (work / "cut" / "base-lossless-f1-s0.log").read_text()
    assert log.count("dflash-train:") == 2  # both attempts' logs, the first one kept


def test_a_cut_run_of_another_command_starts_again(tmp_path: Path) -> None:
    run = quality_sizes.Run(
        variant="base", flags=(), codec="fp8", fraction=1.0, seed=0, dir=tmp_path, curve=False
    )
    run.dir = tmp_path / "runs" / run.name
    step = run.dir / "checkpoints" / "step_000010"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")  # committed (its contents are dflash-train's to check)
    assert quality_phases.cut_run_checkpoint(run, ["--seed", "0"]) is None  # no command kept
    quality_phases.command_file(run.dir.parent, run.name).write_text(json.dumps(["--seed", "1"]))
    assert quality_phases.cut_run_checkpoint(run, ["--seed", "0"]) is None  # another command's run
    assert quality_phases.cut_run_checkpoint(run, ["--seed", "1"]) == step


def test_first_seed_adds_seeds_to_an_earlier_experiment(tmp_path: Path) -> None:
    # `--first-seed 2 --seeds 1` plans only seed 2's runs, so a later session extends seeds 0-1 in place;
    # that seed then draws the curve and the data-size runs, as seed 0 does in a run of its own.
    size = replace(bench_quality.SIZES["cpu"], seeds=1)
    runs = bench_quality.plan_runs(tmp_path, size, ["lossless", "q4"], {"a": ()}, first_seed=2)
    assert sorted(r.name for r in runs) == ["a-lossless-f0.25-s2", "a-lossless-f1-s2", "a-q4-f1-s2"]
    assert [r.name for r in runs if r.curve] == ["a-lossless-f1-s2"]
    assert all(r.dir == tmp_path / r.name for r in runs)


def test_gen_batch_generates_every_row_in_batches_of_that_many_and_records_it(
    tmp_path: Path, monkeypatch
) -> None:
    # The hybrid's rows took ~370 s in 17 batches of 1024 on the H200 (its decoding is bound by steps, not
    # rows): --gen-batch trades the size's batch for fewer steps, and the rows it makes say which batch made them.
    import pyarrow.ipc as ipc

    batches = []
    generate = quality_data.greedy_continuations

    def spy(target_dir, prompts, spec, pad_id, device):
        batches.append(spec.gen_batch)
        return generate(target_dir, prompts, spec, pad_id, device)

    monkeypatch.setattr(quality_phases, "greedy_continuations", spy)
    work = tmp_path / "q"
    assert bench_quality.main(ci_argv(work, "--stop-after", "data", "--gen-batch", "7")) == 0
    data = bench_quality.SIZES["ci"].data
    meta = json.loads((work / "data" / "rows.json").read_text())
    assert batches == [7] and meta["gen_batch"] == 7 and meta["rows"] == data.train_rows + data.eval_rows
    table = ipc.open_file(str(work / "data" / "rows.arrow")).read_all()
    answers = [sum(m) for m in table.column("loss_mask").to_pylist()]
    assert answers == [data.new_tokens] * meta["rows"]


def test_a_work_folder_of_another_size_or_target_is_refused_before_any_phase(tmp_path: Path) -> None:
    # Phases are reused when their outputs exist: a --work built at the ci size must not be trained and scored
    # as the cpu size's target (a run of 40 minutes on a 100k-parameter LM, tau_walk saturated at the block).
    work = tmp_path / "q"
    (work / "target").mkdir(parents=True)
    ci = asdict(bench_quality.SIZES["ci"].target)
    del ci["kind"]  # written before targets had kinds: code
    (work / "target" / "bench_target.json").write_text(json.dumps({"spec": ci}))
    with pytest.raises(SystemExit) as refused:
        bench_quality.main(["--size", "cpu", "--device", "cpu", "--work", str(work), "--stop-after", "data"])
    message = str(refused.value)
    assert message.startswith("error: --size cpu --target code: ") and "\n" not in message
    assert "hidden 48 (wants 128)" in message and message.endswith("use another --work")
    assert not (work / "tokens").exists() and not (work / "data").exists()  # nothing was built beside it
    # The size it was built for passes the check; a speed-only setting (compile) does not count.
    assert bench_quality.work_mismatch(work, bench_quality.SIZES["ci"]) is None
    ci_compiled = replace(
        bench_quality.SIZES["ci"], target=replace(bench_quality.SIZES["ci"].target, compile="reduce-overhead")
    )
    assert bench_quality.work_mismatch(work, ci_compiled) is None
    hybrid = replace(
        bench_quality.SIZES["ci"], target=replace(bench_quality.SIZES["ci"].target, kind="hybrid")
    )
    assert "kind code (wants hybrid)" in bench_quality.work_mismatch(work, hybrid)
    # Rows cut for another size are refused too.
    (work / "data").mkdir()
    (work / "data" / "rows.json").write_text(json.dumps({"train_rows": 7, "eval_rows": [7, 8]}))
    assert "holds 7 training and 2 evaluation rows (wants 48 and 12)" in bench_quality.work_mismatch(
        work, bench_quality.SIZES["ci"]
    )


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


def test_a_work_folder_above_quality_targets_layout_is_refused_not_rebuilt(tmp_path: Path) -> None:
    # `quality_targets.sh start W hybrid` passes --work W/hybrid, so the target sits in W/hybrid/hybrid; a later
    # `--work W --target hybrid` looked in W/hybrid, found no target and built another (a whole device call).
    for kind, built in (("hybrid", "qt/hybrid/hybrid"), ("code", "qt/code")):
        (tmp_path / built / "target").mkdir(parents=True)
        (tmp_path / built / "target" / "bench_target.json").write_text("{}")
        with pytest.raises(SystemExit) as refused:
            bench_quality.main(ci_argv(tmp_path / "qt", "--target", kind, "--stop-after", "data"))
        message = str(refused.value)
        assert message.startswith(f"error: --work {tmp_path / 'qt'}: ") and "\n" not in message
        assert message.endswith(f"pass --work {tmp_path / 'qt' / kind}")
        assert bench_quality.nested_work(tmp_path / "qt" / kind, kind) is None  # what it says to pass
    assert not (tmp_path / "qt" / "tokens").exists() and not (tmp_path / "qt" / "hybrid" / "tokens").exists()


def test_recipe_defaults_trains_what_dflash_train_does_with_no_recipe_flag(tmp_path: Path) -> None:
    from dflash.train.cli import build_config
    from dflash.train.config import default_recipe

    size = quality_sizes.with_trainer_defaults(bench_quality.SIZES["full"])
    runs = quality_sizes.plan_runs(tmp_path, replace(size, seeds=2, fractions=(1.0,)), ["fp8"], {"base": ()})
    meta = {"eval_rows": [7, 8]}
    for run in runs:
        flags = quality_phases.run_flags(run, tmp_path, size, meta, "cuda", [])
        trained = build_config(flags)
        plain = default_recipe(cache=trained.cache, out=trained.out)
        # Every choice of the recipe is the trainer's own (the evaluation and logging flags differ only).
        assert trained.drafter == plain.drafter and trained.optim == plain.optim
        assert (size.drafter.layers, size.drafter.lr) == (
            plain.drafter.num_draft_layers,
            plain.optim.lr,
        )  # reported
        assert trained.data.token_budget == plain.data.token_budget == size.drafter.token_budget
        # every run evaluates along the way, so that the default --early-stop acts as it would alone
        assert trained.eval_every == quality_sizes.DEFAULTS_CURVE_EVERY
        assert trained.early_stop == plain.early_stop > 0
    # --steps still bounds such a run, and nothing else of the recipe changes.
    short = replace(size, drafter=replace(size.drafter, steps=300))
    flags = quality_phases.run_flags(runs[1], tmp_path, short, meta, "cuda", [])
    assert build_config(flags).optim.max_steps == 300
    # a fixed-step recipe trains all its steps, as every run recorded on one did
    ci = bench_quality.SIZES["ci"]
    (fixed, *_) = quality_sizes.plan_runs(tmp_path, replace(ci, fractions=(1.0,)), ["fp8"], {"base": ()})
    assert build_config(quality_phases.run_flags(fixed, tmp_path, ci, meta, "cpu", [])).early_stop == 0
    # The evaluation is built from the size's block size, anchors and pack budget: a size whose differ from the
    # trainer's defaults is refused, not scored on another block size.
    with pytest.raises(ValueError, match="block_size is 8, dflash-train's 16"):
        quality_sizes.with_trainer_defaults(bench_quality.SIZES["ci"])


def test_the_curve_line_reads_the_schedule_as_dflash_train_does(capsys) -> None:
    """The e10 question (is 6 epochs short?) is read off each variant's curve: rising / peaked / flat."""

    def curve_line(walks: dict[int, float]) -> str:
        points = [{"step": s, "tau": 2.0, "tau_walk": w} for s, w in walks.items()]
        lookup = {"tau": 1.5, "tau_walk": 1.5, "eval_samples": 4}
        report = {
            "baselines": {"prompt_lookup": lookup, "untrained": {"tau": 1.0, "tau_walk": 1.0}},
            "size": {"drafter": {"block_size": 16}}, "table": [], "runs": [], "seconds": {},
            "curves": [{"run": "base-fp8-f1-s0", "points": points}],
        }  # fmt: skip
        print_table(report)
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tau/tau_walk"))

    hybrid = {1000: 2.664, 2000: 3.285, 3000: 3.643, 3918: 3.726}  # the defaults' seed 0 (BENCHMARKS.md)
    assert curve_line(hybrid).endswith("3918: 2.00/3.73; still rising: +2.3% from step 3000")
    prose = {1000: 1.680, 2000: 1.719, 3000: 1.715, 3767: 1.701}
    assert curve_line(prose).endswith("; peaked at step 2000, +1.1% over the end")
    assert curve_line({1000: 3.0, 3000: 3.60, 4000: 3.62}).endswith("4000: 2.00/3.62")  # flat: nothing said


def test_quality_resume_goes_on_from_a_finished_run_in_a_copy_as_a_user_would(tmp_path: Path) -> None:
    from bench import quality_resume

    work = tmp_path / "q"
    assert bench_quality.main(ci_argv(work, "--codecs", "fp8", "--fractions", "1")) == 0
    runs = work / "runs"
    before = (runs / "base-fp8-f1-s0" / "metrics.jsonl").read_text()
    assert quality_resume.main([str(runs), "base-fp8-f1-s0", "more", "--max-steps", "20"]) == 0
    # the finished run is left as it was; the copy went on to the new length, evaluated and exported
    assert (runs / "base-fp8-f1-s0" / "metrics.jsonl").read_text() == before
    steps = [json.loads(line)["step"] for line in (runs / "more" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 20 and 12 in steps
    assert (runs / "more" / "final" / "config.json").is_file()
    flags = json.loads((runs / "more.cmd.json").read_text())
    assert flags[flags.index("--out") + 1] == str(runs / "more") and flags[-3:] == [
        "--resume",
        "--max-steps",
        "20",
    ]
    assert "schedule restarts over the added steps" in (runs / "more.log").read_text()
    with pytest.raises(SystemExit, match="exists"):
        quality_resume.main([str(runs), "base-fp8-f1-s0", "more"])
    with pytest.raises(SystemExit, match="not a finished benchmark run"):
        quality_resume.main([str(runs), "nothing", "other"])


def test_a_codec_name_with_no_codec_and_no_cache_is_refused_before_any_phase(tmp_path: Path) -> None:
    # a simulated codec trains on W/cache-NAME (bench/simulate_codec.py); without one nothing could extract it
    with pytest.raises(SystemExit) as refused:
        bench_quality.main(ci_argv(tmp_path / "w", "--codecs", "lossless,q4delta"))
    message = str(refused.value)
    assert message.startswith("error: --codecs q4delta: no dflash codec") and "\n" not in message
    assert str(tmp_path / "w" / "cache-q4delta") in message
    assert not (tmp_path / "w" / "target").exists()  # refused before the target's build
