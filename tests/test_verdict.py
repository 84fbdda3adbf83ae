"""The end-of-run verdict: the drafter against prompt lookup, and a schedule too short or longer than needed,
read from the evaluation records (curves below are the quality benchmark's, BENCHMARKS.md)."""

from __future__ import annotations

import math

from dflash.train.verdict import Evaluation, early_end, evaluations, verdict
from hypothesis import given
from hypothesis import strategies as st

from bench import early_stop_replay


def _records(curve: dict[int, float], lookup: float) -> list[dict]:
    return [{"step": s, "tau_walk": w, "tau_walk_lookup": lookup} for s, w in curve.items()]


HYBRID = {1000: 2.664, 2000: 3.285, 3000: 3.643, 3918: 3.726}  # defaults, seed 0: still rising at the end
PROSE = {1000: 1.680, 2000: 1.719, 3000: 1.715, 3767: 1.701}  # defaults, seed 0: peaked mid-schedule


def test_a_walk_still_rising_at_the_end_asks_for_a_longer_schedule() -> None:
    lines = verdict(evaluations(_records(HYBRID, 2.774)), epochs=6, max_steps=None)
    assert lines == [
        "drafter: held-out decode walk 3.726 at step 3918 (RUN/export), 1.34x prompt lookup's 2.774",
        "schedule: the walk was still rising at the end (3.643 at step 3000 -> 3.726 at 3918, +2.3%): a longer "
        "schedule may walk further; to go on from here, run the same command with --resume --epochs 9",
    ]
    # the run ended on its step budget, not its epochs: that is the one to lengthen
    lines = verdict(evaluations(_records(HYBRID, 2.774)), epochs=6, max_steps=3918)
    assert lines[1].endswith("with --resume --max-steps 5877")
    # a step budget the epochs ended first is not the limit
    assert verdict(evaluations(_records(HYBRID, 2.774)), epochs=6, max_steps=8000)[1].endswith(
        "with --resume --epochs 9"
    )


def test_a_walk_that_peaked_before_the_end_says_the_export_holds_the_peak() -> None:
    lines = verdict(evaluations(_records(PROSE, 1.189)), epochs=6, max_steps=None)
    assert (
        lines[0]
        == "drafter: held-out decode walk 1.719 at step 2000 (RUN/export), 1.45x prompt lookup's 1.189"
    )
    assert lines[1] == (
        "schedule: the walk peaked at step 2000 of 3767 (1.719, 1.1% above the end's 1.701); RUN/export holds "
        "the peak, and a shorter schedule would reach it sooner"
    )


def test_a_flat_end_or_a_single_evaluation_says_nothing_of_the_schedule() -> None:
    flat = {1000: 3.0, 2000: 3.5, 3000: 3.60, 4000: 3.62}  # +0.6% over the last quarter: inside TREND
    assert len(verdict(evaluations(_records(flat, 3.0)), epochs=6, max_steps=None)) == 1
    dip = {1000: 3.0, 3000: 3.62, 4000: 3.60}  # the best before the end, but by less than TREND
    assert len(verdict(evaluations(_records(dip, 3.0)), epochs=6, max_steps=None)) == 1
    assert len(verdict(evaluations(_records({500: 2.0}, 1.5)), epochs=6, max_steps=None)) == 1
    assert verdict([], epochs=6, max_steps=None) == []


def test_a_drafter_below_prompt_lookup_is_told_so() -> None:
    line = verdict(evaluations(_records({500: 1.41, 1000: 1.42}, 2.77)), epochs=1, max_steps=None)[0]
    assert "0.51x prompt lookup's 2.770: prompt lookup (no drafter) walks further" in line
    no_lookup = [{"step": 10, "tau_walk": 2.5}]  # an evaluation without the baseline: the walk alone
    assert verdict(evaluations(no_lookup), epochs=1, max_steps=None) == [
        "drafter: held-out decode walk 2.500 at step 10 (RUN/export)"
    ]


def test_evaluations_keep_the_walk_records_in_step_order_and_a_resumes_latest() -> None:
    records = [
        {"step": 100, "loss": 1.0},  # a log record: no walk
        {"step": 500, "tau_walk": 2.0, "tau_walk_lookup": 1.5},
        {"step": 1000, "tau_walk": 2.4, "tau_walk_lookup": 1.5},
        {"step": 500, "tau_walk": 2.1, "tau_walk_lookup": 1.5},  # a resume re-evaluated step 500
        {"step": 1500, "tau_walk": math.nan},
        {"step": "x", "tau_walk": 3.0},
    ]
    got = evaluations(records)
    assert [(e.step, e.walk) for e in got] == [(500, 2.1), (1000, 2.4)]


@given(st.lists(st.floats(0.5, 8.0), min_size=1, max_size=12), st.floats(0.0, 0.5))
def test_early_end_is_the_first_evaluation_below_the_best_before_it(walks: list[float], drop: float) -> None:
    evals = [Evaluation(1000 * (i + 1), w, None) for i, w in enumerate(walks)]
    end = early_end(evals, drop)
    fell = [i for i in range(1, len(walks)) if walks[i] < max(walks[:i]) * (1 - drop)]
    assert end == (evals[fell[0]] if fell and drop > 0 else None)


def test_the_recorded_curves_end_early_only_on_prose_at_ten_epochs(capsys) -> None:
    # BENCHMARKS.md, "--early-stop": 2% ends each ten-epoch prose run at step 4000 of ~6,278 (1.379x / 1.384x /
    # 1.414x prompt lookup there, against 1.350x / 1.352x / 1.384x at the end); no code or hybrid run, nor any
    # six-epoch run, ends before its schedule does (nor the ten-epoch code runs recorded since, with the rule on)
    rows = early_stop_replay.replay(sorted(early_stop_replay.REPORTS.glob("*-full-*.json")), 0.02)
    ended = {(r["report"], r["run"]): (r["end"], round(r["x_lookup"], 3)) for r in rows if r["end"]}
    assert ended == {
        ("prose-full-e10-s0-s2-h100", f"e10-lossless-f1-s{s}"): (4000, x)
        for s, x in ((0, 1.379), (1, 1.384), (2, 1.414))
    }
    assert len(rows) == 38  # 35 curves when the rule was chosen, and code's ten-epoch q4 job's 3
    code_e10 = [r for r in rows if r["report"] == "code-full-defaults-e10-s2-q4delta-h100"]
    assert [(r["run"], r["steps"]) for r in code_e10] == [
        (f"base-{c}-f1-s2", 6530) for c in ("lossless", "q4", "q4delta")
    ]
