"""Every benchmark run's evaluations so far, and each run's gap to its reference at the same step, read from the
runs' own metrics.jsonl while they train: what a device job that is cut before its runs end still measured.

    python bench/quality_curves.py W        # W: a job's work folder (every RUN/metrics.jsonl below it)

A run evaluates along the way only with `bench_quality.py --curves all` (the device jobs pass it). The pairs are
`bench/quality_gaps.py`'s (each lossy codec against lossless, each variant against base; same seed), taken at
every step both runs evaluated: runs of one seed share every batch on the `spans` order, so two runs compared at
one step have trained on the same data, whatever their speed. `device_job.sh poll` writes it as curves.txt.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quality_gaps import codec_gaps, variant_gaps
from bench.quality_sizes import Run


def _is_run(name: str) -> bool:
    """A folder named as the benchmark names a run (`Run.name`: VARIANT-CODEC-fF-sS), which the gaps parse."""
    try:
        return Run.from_report({"run": name}).name == name
    except ValueError:
        return False


def read_curves(work: Path) -> dict[str, list[dict[str, Any]]]:
    """Run name -> its evaluations (`step`, `tau_walk`, ...) in step order, from each RUN/metrics.jsonl under
    `work` (other folders' are not runs; a line still being written is skipped)."""
    curves: dict[str, list[dict[str, Any]]] = {}
    for metrics in sorted(work.rglob("metrics.jsonl")):
        if not _is_run(metrics.parent.name):
            continue
        points = []
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "tau_walk" in record:
                points.append(record)
        curves.setdefault(metrics.parent.name, []).extend(points)
    return curves


def gaps_by_step(curves: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """At each step where a run and its reference both evaluated, the pair's gap (`quality_gaps` rows, one per
    pair and step, each with its `step` and what the pair `differ`s in)."""
    steps = sorted({p["step"] for points in curves.values() for p in points})
    rows = []
    for step in steps:
        runs = [
            {"run": name, "tau_walk": p["tau_walk"]}
            for name, points in curves.items()
            for p in points
            if p["step"] == step
        ]
        rows += [{"step": step, "differ": "codec", **g} for g in codec_gaps(runs)]
        rows += [{"step": step, "differ": "variant", **g} for g in variant_gaps(runs)]
    return rows


def format_curves(curves: dict[str, list[dict[str, Any]]]) -> str:
    if not curves:
        return "no run has evaluated yet\n"
    lines = ["evaluations (decode walk at step):"]
    width = max(map(len, curves))
    for name, points in sorted(curves.items()):
        walks = "  ".join(f"{p['step']}: {p['tau_walk']:.3f}" for p in points) or "-"
        lines.append(f"  {name:<{width}}  {walks}")
    gaps = gaps_by_step(curves)
    if gaps:
        lines.append("against the reference run of the same seed, at the same step:")
        for g in gaps:
            shared = "variant" if g["differ"] == "codec" else "codec"
            lines.append(
                f"  step {g['step']:>5}  {g[g['differ']]} vs {g['reference']} ({g[shared]}), seeds "
                + ", ".join(f"{s} {x:+.1%}" for s, x in zip(g["seeds"], g["per_seed"], strict=True))
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(format_curves(read_curves(Path(sys.argv[1]))), end="")
