"""The fault phase of `bench/bench_scaling.py`: SIGKILL one rank mid-extraction and mid-training, then resume.

Extraction: N ranks, the last one killed once a third of the units are committed; the same command again
(killed again if it runs long enough); then N/2 ranks finish. The result must verify against the dataset;
its shards are compared byte for byte with the uninterrupted N-rank cache of the same codec (equal when
the kernels are deterministic; reported, not required). Training: an uninterrupted run, and the same run
killed once its mid-run checkpoint is committed and resumed with `--resume`; the loss of every step after
the checkpoint must equal the uninterrupted run's within `--loss-tolerance`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from dflash.extract.cli import config_from_args
from dflash.extract.prepare import prepare
from dflash.extract.units import committed_units
from dflash.shards.paths import SHARDS_DIR
from dflash.tools.shards_cli import main as shards_main
from dflash.train import checkpoint as ckpt
from dflash.train.metrics import read_metrics


def extraction_fault(bench: Any, reference: Path) -> dict[str, Any]:
    n, codec = bench.args.nproc, bench.args.codecs[-1]
    out = bench.work / "cache-faults"
    shutil.rmtree(out, ignore_errors=True)
    argv = bench.extract_argv(out, codec)
    units = len(prepare(config_from_args([str(a) for a in argv])).units)
    runs: list[dict[str, Any]] = []
    for k in (n, n, max(1, n // 2)):  # killed; the same command, killed again if still running; finished
        before = len(committed_units(out)) if out.is_dir() else 0
        if before == units:
            break
        goal = before + max(1, (units - before) // 3)
        kill = (lambda goal=goal: len(committed_units(out)) >= goal) if len(runs) < 2 else None
        run = bench.launch(f"fault-extract-{len(runs)}", "extract", k, argv, kill_when=kill)
        runs.append({"n": k, "units_before": before, "killed": run.killed, "exit": run.code})
    verified = shards_main(["verify", str(out), "--dataset", str(bench.dataset)]) == 0
    ref_shards = sorted((reference / SHARDS_DIR).glob("*.dfs")) if reference.is_dir() else []
    same = sum((out / SHARDS_DIR / p.name).read_bytes() == p.read_bytes() for p in ref_shards)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "units": units,
        "runs": runs,
        "verify_ok": verified,
        "identical_shards": f"{same}/{len(ref_shards)}" if ref_shards else "no reference",
        "pass": bool(verified and runs and runs[0]["killed"] and runs[-1]["exit"] == 0),
    }


def training_fault(bench: Any, cache: Path) -> dict[str, Any]:
    n, steps, tol = bench.args.nproc, bench.args.fault_steps, bench.args.loss_tolerance
    half = steps // 2
    losses: dict[str, dict[int, float]] = {}
    facts: dict[str, Any] = {"steps": steps, "checkpoint_step": half, "tolerance": tol}
    for name in ("uninterrupted", "killed"):
        run_dir = bench.work / f"run-fault-{name}"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = bench.train_argv(cache, run_dir, "auto", steps, half, log_every=1)
        saved = (
            (lambda d=run_dir: any(s == half for s, _ in ckpt.list_checkpoints(d)))
            if name == "killed"
            else None
        )
        run = bench.launch(f"fault-train-{name}", "train", n, argv, kill_when=saved)
        if run.killed:
            facts["resumed_from"] = ckpt.list_checkpoints(run_dir)[-1][0]
            run = bench.launch("fault-train-resume", "train", n, [*argv, "--resume"])
        facts[f"{name}_exit"] = run.code
        losses[name] = {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}  # last one wins
        shutil.rmtree(run_dir, ignore_errors=True)
    later = range(half + 1, steps + 1)
    diffs = [
        abs(losses["killed"][s] - losses["uninterrupted"][s])
        for s in later
        if s in losses["killed"] and s in losses["uninterrupted"]
    ]
    worst = max(diffs) if diffs else float("nan")
    resumed = facts.get("resumed_from")
    ok = resumed is not None and resumed < steps and len(diffs) == len(later) and worst <= tol
    return {
        **facts,
        "compared_steps": len(diffs),
        "max_abs_loss_diff": worst,
        "pass": bool(ok and facts["killed_exit"] == 0),
    }
