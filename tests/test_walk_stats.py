"""walk_stats: the decode walk's error over held-out rows, checked against resampling the rows themselves."""

import numpy as np
import pytest
from dflash.train.walk_stats import paired_gap, row_walk, walk_se
from hypothesis import given, settings
from hypothesis import strategies as st

rows_st = st.dictionaries(
    st.integers(0, 10_000), st.tuples(st.integers(1, 400), st.integers(1, 100)), min_size=2, max_size=40
).map(lambda d: {r: (max(t, s), s) for r, (t, s) in d.items()})  # a step yields >= 1 token


def _population(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of a held-out population: steps per row, and two drafters' tokens on them. Rows differ in how far
    both walk (a shared difficulty), and drafter b walks ~5% further with its own per-row noise."""
    steps = rng.integers(20, 80, n)
    difficulty = rng.gamma(4.0, 0.9, n) + 1.0
    a = np.round(steps * difficulty).astype(int)
    b = np.round(steps * difficulty * 1.05 * rng.normal(1.0, 0.05, n)).clip(min=steps).astype(int)
    return steps, a, b


def test_the_standard_errors_match_the_spread_of_resampled_held_out_sets() -> None:
    rng = np.random.default_rng(7)
    steps, a, b = _population(rng, 20_000)
    n, taus, gaps, ses, gap_ses = 256, [], [], [], []
    for _ in range(1500):
        pick = rng.choice(len(steps), n, replace=False)
        rows_a = {int(r): (int(a[r]), int(steps[r])) for r in pick}
        rows_b = {int(r): (int(b[r]), int(steps[r])) for r in pick}
        taus.append(a[pick].sum() / steps[pick].sum())
        ses.append(walk_se(rows_a))
        gap, se = paired_gap(rows_b, rows_a)
        gaps.append(gap)
        gap_ses.append(se)
    assert np.mean(ses) == pytest.approx(np.std(taus), rel=0.08)
    assert np.mean(gap_ses) == pytest.approx(np.std(gaps), rel=0.08)
    # pairing is the point: the gap's error is a fraction of either walk's own
    assert np.mean(gap_ses) < 0.25 * np.mean(ses) / np.mean(taus)


@settings(max_examples=60, deadline=None)
@given(rows=rows_st, scale=st.integers(2, 5))
def test_a_drafter_against_itself_or_a_uniform_rescale_has_no_row_error(rows, scale) -> None:
    assert paired_gap(rows, rows) == (0.0, 0.0)
    scaled = {r: (t * scale, s) for r, (t, s) in rows.items()}  # every row walks `scale` times as far
    gap, se = paired_gap(scaled, rows)
    assert gap == pytest.approx(scale - 1) and se == pytest.approx(0.0, abs=1e-9)
    assert walk_se(rows) >= 0.0


@settings(max_examples=60, deadline=None)
@given(rows=rows_st)
def test_rows_of_one_ratio_have_no_error_and_other_row_sets_do_not_pair(rows) -> None:
    same = {r: (3 * s, s) for r, (_, s) in rows.items()}
    assert walk_se(same) == pytest.approx(0.0, abs=1e-9)
    fewer = dict(list(rows.items())[:-1])
    assert paired_gap(rows, fewer) is None


def test_one_row_has_no_spread_and_a_row_walk_counts_the_bonus_token() -> None:
    assert np.isnan(walk_se({3: (10, 4)}))
    assert row_walk([0, 3, 14]) == (20, 3)
