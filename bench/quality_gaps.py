"""The quality benchmark's paired comparisons: each run against its reference run of the same seed.

Two kinds, one rule. `codec_gaps`: each lossy codec against the lossless drafter of the same variant, fraction
and seed. `variant_gaps`: each recipe variant against `base` (else the report's first variant), of the same
codec, fraction and seed (distillation against hard labels; two identical variants for the GPU's own run-to-run
noise). A pair shares its seed: the drafter's initialization, and its batches and anchors, whatever the cache's
codec, in reports of the `spans` data order (`data_order`); in older reports each codec's cache gave its runs its
own batches (`train/data_plan.py`), so a codec pair there shared its initialization alone. A gap leaves out
what the two runs share.

Each row gives the per-seed gaps (walk / the reference's walk - 1), their mean and its standard error over seeds
(None for one seed: a mean gap reads as "within X%" only once that error is well under X), the gap of the means,
and the reference runs' own spread over seeds. Where both runs of a seed kept each held-out row's walk
(`walk_rows`), the seed's gap also gets the held-out rows' part of its error (`walk_stats.paired_gap`): what
more held-out rows would shrink, against what only more seeds average out.

A run's scored walk is its last checkpoint's. Where `--early-stop` ended a run (or its walk peaked before the end)
that is not the drafter `dflash-train` hands a user, RUN/export, its best evaluation: `print_gaps` then pairs the
runs again on each one's best evaluation along the way (`at_best_evaluation`, the trainer's own walks on the same
held-out rows, so selected on them, and without the rows' error). The trainer evaluates a run on its own cache's
states, the scoring on lossless ones: on the recorded full-size runs the scored walk of a q4 run was -0.1..+0.6%
(mean +0.2%) over its trainer's evaluation of the same checkpoint, fp8's and lossless's within 0.2%, so these
pairs read q4 ~0.2% lower than the scoring would.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train.verdict import evaluations
from dflash.train.walk_stats import RowWalks, paired_gap

from bench.quality_sizes import OLD_ORDER, Run

# what a pair's two runs differ in, and what they share (the row's label)
_SHARED = {"codec": ("variant", "fraction"), "variant": ("codec", "fraction")}


def codec_gaps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each lossy codec against lossless. `runs` are a report's (`run` named VARIANT-CODEC-fF-sS)."""
    return _paired([Run.from_report(r) for r in runs], "codec", "lossless")


def variant_gaps(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each variant against `base` (the benchmark's name for a run without --variants), else against the first
    one the report names (its plan's order)."""
    parsed = [Run.from_report(r) for r in runs]
    names = [run.variant for run in parsed]
    return _paired(parsed, "variant", "base" if "base" in names else next(iter(names), ""))


def _paired(runs: list[Run], differ: str, ref_name: str) -> list[dict[str, Any]]:
    walks: dict[tuple[str, str, str], dict[str, float]] = {}
    rows: dict[tuple[str, str, str], dict[str, RowWalks]] = {}
    for run in runs:
        if "tau_walk" in run.result:
            key = (run.variant, f"f{run.fraction:g}", run.codec)
            walks.setdefault(key, {})[f"s{run.seed}"] = run.result["tau_walk"]
            if "walk_rows" in run.result:  # JSON made the row ids strings
                walked = {int(r): (t, n) for r, (t, n) in run.result["walk_rows"].items()}
                rows.setdefault(key, {})[f"s{run.seed}"] = walked
    table = []
    for key, by_seed in sorted(walks.items()):
        fields = dict(zip(("variant", "fraction", "codec"), key, strict=True))
        if fields[differ] == ref_name:
            continue
        ref_key = tuple(ref_name if name == differ else value for name, value in fields.items())
        ref_walks = walks.get(ref_key, {})
        seeds = sorted(set(by_seed) & set(ref_walks), key=lambda s: int(s[1:]))
        if not seeds:
            continue
        ref = np.array([ref_walks[s] for s in seeds])
        gaps = [by_seed[s] / ref_walks[s] - 1 for s in seeds]
        ours, theirs = rows.get(key, {}), rows.get(ref_key, {})
        paired = [paired_gap(ours[s], theirs[s]) if s in ours and s in theirs else None for s in seeds]
        table.append({
            **fields, "reference": ref_name, "seeds": seeds, "per_seed": gaps,
            "per_seed_rows_se": [None if p is None else p[1] for p in paired],
            "mean_of_gaps": float(np.mean(gaps)),
            "mean_gap_se": float(np.std(gaps, ddof=1) / np.sqrt(len(gaps))) if len(gaps) > 1 else None,
            "gap_of_means": float(np.mean([by_seed[s] for s in seeds]) / ref.mean() - 1),
            "reference_spread": float((ref.max() - ref.min()) / ref.mean()),
        })  # fmt: skip
    return table


def at_best_evaluation(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run as RUN/export keeps it: its walk at its best evaluation along the way (the trainer's own, on the
    held-out rows the scoring uses), with that evaluation's `step` and whether it is the curve's `last`; runs
    without a curve are left out."""
    kept = []
    for run in runs:
        evals = evaluations(run.get("curve", []))  # the trainer's own reading of its records
        if evals:
            best = max(evals, key=lambda e: e.walk)
            kept.append(
                {"run": run["run"], "tau_walk": best.walk, "step": best.step, "last": best is evals[-1]}
            )
    return kept


def print_gaps(report: dict[str, Any]) -> None:
    """Both tables, each once it has a pair; then the same pairs on each run's best evaluation (RUN/export) where
    some run's best is not its last checkpoint (`--early-stop` ended it, or its walk peaked before its end)."""
    for differ, table in (("codec", codec_gaps(report["runs"])), ("variant", variant_gaps(report["runs"]))):
        if not table:
            continue
        what = "codecs against lossless" if differ == "codec" else f"variants against {table[0]['reference']}"
        _print_table(
            report, differ, table, f"{what}, paired by seed (walk / the same seed's reference walk - 1; a seed's "
            "±: the held-out rows' standard error of its gap, where the report kept each row's walk):",
        )  # fmt: skip
    best = at_best_evaluation(report["runs"])
    tables = [("codec", codec_gaps(best)), ("variant", variant_gaps(best))]
    if all(run["last"] for run in best) or not any(table for _, table in tables):
        return
    for differ, table in tables:
        _print_table(
            report, differ, table, f"the same {differ} pairs as RUN/export keeps each run: its best evaluation "
            "along the way (the trainer's own walk on these held-out rows, so picked on them), what dflash-train "
            "hands a user where the walk fell before the end:",
        )  # fmt: skip
    print("  best at step: " + ", ".join(f"{run['run']} {run['step']}" for run in best))


def _print_table(report: dict[str, Any], differ: str, table: list[dict[str, Any]], title: str) -> None:
    if not table:
        return
    print(f"\n{title}")
    order = report.get("data_order", OLD_ORDER)
    if differ == "codec" and order != "spans":
        print(
            "(runs from before the spans data order: each codec's cache gave its runs their own batches)"
            if order == OLD_ORDER
            else "(runs on both data orders: a codec pair shares its batches where both ran on spans)"
        )
    label_of = (*_SHARED[differ], differ)
    print(
        f"{', '.join(label_of):<30} {'per seed':<44} {'mean gap':>9} {'± se':>6} {'of means':>9} "
        f"{'reference spread':>17}"
    )
    for row in table:
        seeds = " ".join(
            f"{s} {g:+.1%}" + ("" if se is None else f"±{se:.1%}")
            for s, g, se in zip(row["seeds"], row["per_seed"], row["per_seed_rows_se"], strict=True)
        )
        label = ", ".join(str(row[name]) for name in label_of)
        se = "-" if row["mean_gap_se"] is None else f"{row['mean_gap_se']:.1%}"
        print(f"{label:<30} {seeds:<44} {row['mean_of_gaps']:>+9.1%} {se:>6} {row['gap_of_means']:>+9.1%} "
              f"{row['reference_spread']:>17.1%}")  # fmt: skip
