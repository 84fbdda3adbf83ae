"""Steps/s and tokens/s per token budget from `bench/pack_sweep.sh`'s DEST: `python bench/pack_sweep_summary.py DEST`.

The steady rate of a budget is taken over its samples past step 50 (after the start-up and the first
recompiles): the step difference over the time difference between the first and the last such sample."""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path


def rates(lines: list[str]) -> dict[int, dict[str, float]]:
    """{budget: {"steps_per_s", "tokens_per_s", "first_step_s", "steps"}} from sweep.txt's sample lines."""
    samples: dict[int, list[tuple[float, int, float]]] = defaultdict(list)
    for line in lines:
        parts = line.split()
        if len(parts) == 4 and all(p.isdigit() for p in parts):
            budget, t, step, tokens = map(int, parts)
            samples[budget].append((t, step, tokens))
    out = {}
    for budget, points in samples.items():
        started = [p for p in points if p[1] > 0]
        steady = [p for p in points if p[1] >= 50]
        row = {
            "steps": float(points[-1][1]),
            "first_step_s": float(started[0][0]) if started else float("nan"),
        }
        if len(steady) >= 2 and steady[-1][0] > steady[0][0]:
            row["steps_per_s"] = (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
            row["tokens_per_s"] = sum(p[2] for p in steady) / len(steady)
        out[budget] = row
    return out


def main() -> None:
    dest = Path(sys.argv[1])
    table = rates((dest / "sweep.txt").read_text().splitlines())
    print("| token budget | steps/s | context tokens/s (logged) | first record at (s) | last step |")
    print("|---|---|---|---|---|")
    for budget, row in sorted(table.items()):
        print(
            f"| {budget} | {row.get('steps_per_s', float('nan')):.2f} | {row.get('tokens_per_s', float('nan')):,.0f} "
            f"| {row['first_step_s']:.0f} | {row['steps']:.0f} |"
        )


if __name__ == "__main__":
    main()
