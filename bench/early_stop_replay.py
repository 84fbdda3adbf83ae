"""Where `dflash-train --early-stop` would have ended the benchmark's recorded runs, read from their curves.

    python bench/early_stop_replay.py [--drop 0.02] REPORT.json ...     # default: every full-size report

A run trains the same steps up to an evaluation whether or not early stopping is on (the check reads the
evaluations, nothing of the trajectory), so a recorded curve says exactly where the rule ends it and what walk
the run has there; what the steps after it would have walked is not needed. The rule is `verdict.early_end`,
the trainer's own test. One row per curve: the end (or "-": the whole schedule), the walk there, the best
walk and its step, the share of steps saved, and the end's walk against the schedule's last one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dflash.train.config import DEFAULT_EARLY_STOP
from dflash.train.verdict import early_end, evaluations

REPORTS = Path(__file__).resolve().parent / "reports"


def replay(paths: list[Path], drop: float) -> list[dict[str, object]]:
    rows = []
    for path in paths:
        report = json.loads(path.read_text())
        lookup = report["baselines"]["prompt_lookup"]["tau_walk"]
        for curve in report.get("curves", []):
            evals = evaluations(curve["points"])
            if len(evals) < 2:
                continue
            end, last = early_end(evals, drop), evals[-1]
            best = max(evals, key=lambda e: e.walk)
            kept = end or last
            rows.append(
                {
                    "report": path.stem,
                    "run": curve["run"],
                    "end": end.step if end else None,
                    "steps": last.step,
                    "walk": kept.walk,
                    "x_lookup": kept.walk / lookup,
                    "best": best.walk,
                    "best_step": best.step,
                    "saved": 1 - kept.step / last.step,
                    "vs_last": kept.walk / last.walk - 1,
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="*", type=Path)
    p.add_argument("--drop", type=float, default=DEFAULT_EARLY_STOP, help="--early-stop's share")
    args = p.parse_args(argv)
    paths = args.reports or sorted(REPORTS.glob("*-full-*.json"))
    print("| report | run | ends at | walk there (x lookup) | best (step) | steps saved | vs the last |")
    print("|---|---|---|---|---|---|---|")
    for r in replay(paths, args.drop):
        end = f"{r['end']:,} of {r['steps']:,}" if r["end"] else "-"
        print(
            f"| {r['report']} | {r['run']} | {end} | {r['walk']:.3f} ({r['x_lookup']:.3f}x) | "
            f"{r['best']:.3f} ({r['best_step']:,}) | {r['saved']:.0%} | {r['vs_last']:+.1%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
