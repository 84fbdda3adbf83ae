"""What a finished run's held-out evaluations say: the drafter against prompt lookup, and whether its schedule
was long enough.

No one length fits every target: on the quality benchmark (BENCHMARKS.md) 6 epochs left the hybrid target's
walk still rising at the end (+2.3% over its last ~900 steps; 10 epochs walked 1.51x prompt lookup against
1.35x), while prose's walk peaked at step 2000 and fell 5-6% by the end of 10 epochs (`schedule.default_epochs`
gives such a small dataset 10: the worst target's walk decided). The decode walk is deterministic for given
weights on the fixed held-out rows, so its trend within one run is a reading, not seed noise. `--early-stop`
acts on the same reading as the run goes (`fell_below_best`; `early_end` replays it on a finished curve). Pure:
it reads the evaluation records of `RUN/metrics.jsonl`; `dflash-train` prints its lines when the run ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

TREND = 0.01  # a relative change in the walk that counts as rising or as a peak
LATE = 0.75  # the trend is read from the evaluation nearest this share of the steps to the last one
LONGER = 1.5  # the longer schedule to suggest (the benchmark's hybrid: 6 -> ~9 epochs)


@dataclass(frozen=True, slots=True)
class Evaluation:
    step: int
    walk: float
    lookup: float | None  # prompt lookup's walk on the same rows


def evaluations(records: Iterable[Mapping[str, Any]]) -> list[Evaluation]:
    """The metrics records that carry a decode walk, in step order (a resumed run's repeats: the latest)."""
    by_step: dict[int, Evaluation] = {}
    for r in records:
        walk = r.get("tau_walk")
        if isinstance(walk, (int, float)) and math.isfinite(walk) and isinstance(r.get("step"), int):
            lookup = r.get("tau_walk_lookup")
            known = isinstance(lookup, (int, float)) and not isinstance(lookup, bool)
            by_step[r["step"]] = Evaluation(r["step"], float(walk), float(lookup) if known else None)
    return [by_step[s] for s in sorted(by_step)]


def fell_below_best(walk: float | None, best: float | None, drop: float) -> bool:
    """`--early-stop`'s test: an evaluation's walk more than `drop` (a share) below the run's best so far."""
    return walk is not None and best is not None and walk < best * (1 - drop)


def early_end(evals: list[Evaluation], drop: float) -> Evaluation | None:
    """The evaluation at which `--early-stop drop` ends a run whose evaluations these are (None: it trains to
    the end), read afterwards: the same test, in the same order, as the trainer makes as it goes."""
    best: float | None = None
    for e in evals:
        if drop > 0 and fell_below_best(e.walk, best, drop):
            return e
        best = e.walk if best is None else max(best, e.walk)
    return None


@dataclass(frozen=True, slots=True)
class Trend:
    """The schedule's reading: `rising` (the last evaluation is the best, `change` above `since`, the one
    nearest three quarters of the way) or `peaked` (the best, `since`, is `change` above the last)."""

    kind: str
    since: Evaluation
    last: Evaluation
    change: float


def trend(evals: list[Evaluation]) -> Trend | None:
    """Rising or peaked by more than TREND over the schedule's last quarter; None: flat, or too few points."""
    if len(evals) < 2:
        return None
    best = max(evals, key=lambda e: e.walk)  # the first of equals: RUN/export keeps the first best
    last = evals[-1]
    before = min(evals[:-1], key=lambda e: abs(e.step - LATE * last.step))
    if best is last and last.walk >= before.walk * (1 + TREND):
        return Trend("rising", before, last, last.walk / before.walk - 1)
    if best.step < last.step and best.walk >= last.walk * (1 + TREND):
        return Trend("peaked", best, last, best.walk / last.walk - 1)
    return None


def verdict(evals: list[Evaluation], *, epochs: int, max_steps: int | None) -> list[str]:
    """Lines for the user: the best walk against prompt lookup's; then the schedule's `trend`: still rising
    (a longer schedule may walk further) or peaked before the end. `epochs` and `max_steps` are the run's: the
    one that ended it is the one to lengthen."""
    if not evals:
        return []
    best = max(evals, key=lambda e: e.walk)
    line = f"drafter: held-out decode walk {best.walk:.3f} at step {best.step} (RUN/export)"
    if best.lookup:
        ratio = best.walk / best.lookup
        line += f", {ratio:.2f}x prompt lookup's {best.lookup:.3f}"
        if ratio < 1:
            line += ": prompt lookup (no drafter) walks further on these rows; serve with it, or train longer"
    lines = [line]
    seen = trend(evals)
    if seen is not None and seen.kind == "rising":
        since, last = seen.since, seen.last
        step_limited = max_steps is not None and last.step >= max_steps  # else the epochs ended it
        longer = (
            f"--max-steps {math.ceil(LONGER * max_steps)}"
            if step_limited
            else f"--epochs {math.ceil(LONGER * epochs)}"
        )
        lines.append(
            f"schedule: the walk was still rising at the end ({since.walk:.3f} at step {since.step} -> "
            f"{last.walk:.3f} at {last.step}, +{seen.change:.1%}): a longer schedule may walk further; to go on "
            f"from here, run the same command with --resume {longer}"
        )
    elif seen is not None:
        peak, last = seen.since, seen.last
        lines.append(
            f"schedule: the walk peaked at step {peak.step} of {last.step} ({peak.walk:.3f}, "
            f"{seen.change:.1%} above the end's {last.walk:.3f}); RUN/export holds the peak, and a shorter "
            "schedule would reach it sooner"
        )
    return lines
