"""NAB's scoring rules, checked on tiny hand-made series."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.nab import (
    PROFILES,
    WindowedGaussian,
    make_file,
    normalise,
    optimise_threshold,
    probation_rows,
    scaled_sigmoid,
    score_at_threshold,
    sweep_scores,
)

STANDARD = PROFILES["standard"]


def series(n: int, windows: list[tuple[int, int]]):  # noqa: ANN201 - test factory
    return make_file("cat/x.csv", [str(i) for i in range(n)], [0.0] * n, windows)


def raw(f, fires: list[int], profile=STANDARD) -> float:  # noqa: ANN001
    scores = np.zeros(len(f.values))
    scores[fires] = 1.0
    return score_at_threshold([(f, scores)], profile, 0.5)[f.name]


def test_probation_is_15_percent_capped_at_750_rows() -> None:
    """NAB leaves min(floor(0.15 n), 750) rows unscored."""
    assert probation_rows(1000) == 150
    assert probation_rows(4032) == 604
    assert probation_rows(15902) == 750


def test_scaled_sigmoid_shape() -> None:
    """Full credit early in a window, about 0 at its end, -1 far after it."""
    assert scaled_sigmoid(-1.0) == pytest.approx(0.9866, abs=1e-4)
    assert scaled_sigmoid(0.0) == 0.0
    assert scaled_sigmoid(3.5) == -1.0


def test_detection_at_window_start_earns_full_tp_credit() -> None:
    """The first row of a window is worth exactly A_TP."""
    f = series(1000, [(500, 599)])
    assert raw(f, [500]) == pytest.approx(1.0)


def test_only_the_earliest_detection_in_a_window_counts() -> None:
    """More detections inside the window add nothing; a later one earns less."""
    f = series(1000, [(500, 599)])
    assert raw(f, [500, 550, 599]) == pytest.approx(1.0)
    late = raw(f, [590])
    assert 0.0 < late < 0.5


def test_missed_window_costs_a_fn() -> None:
    """A window with no detection is worth -A_FN (2 in reward_low_FN_rate)."""
    f = series(1000, [(500, 599)])
    assert raw(f, []) == pytest.approx(-1.0)
    assert raw(f, [], PROFILES["reward_low_FN_rate"]) == pytest.approx(-2.0)


def test_false_positive_before_any_window_costs_a_fp() -> None:
    """A detection outside windows with no window before it costs A_FP."""
    f = series(1000, [(500, 599)])
    assert raw(f, [300, 500]) == pytest.approx(1.0 - 0.11)
    assert raw(f, [300, 500], PROFILES["reward_low_FP_rate"]) == pytest.approx(1.0 - 0.22)


def test_false_positive_just_after_a_window_costs_little() -> None:
    """FPs are weighted by distance after the previous window: near it ~0, far -A_FP."""
    f = series(2000, [(500, 599)])
    near = raw(f, [500, 601]) - 1.0
    far = raw(f, [500, 1500]) - 1.0
    assert -0.11 < near < 0.0
    assert far == pytest.approx(-0.11)


def test_probationary_rows_are_ignored() -> None:
    """Detections in the first 15% of the file cost nothing."""
    f = series(1000, [(500, 599)])
    assert raw(f, [0, 10, 149, 500]) == pytest.approx(1.0)
    assert raw(f, [150, 500]) == pytest.approx(1.0 - 0.11)


def test_sweep_scores_inside_window_fall_with_position() -> None:
    """Earlier rows of a window are worth more."""
    f = series(1000, [(500, 599)])
    sw = sweep_scores(f, STANDARD)
    assert sw[500] > sw[520] > sw[580] > sw[599] > 0.0


def test_threshold_optimisation_finds_the_separating_threshold() -> None:
    """With a clean detector the best corpus threshold gives a perfect score."""
    f = series(1000, [(500, 599)])
    scores = np.full(1000, 0.2)
    scores[500] = 0.9
    threshold, best = optimise_threshold([(f, scores)], STANDARD)
    assert threshold == pytest.approx(0.9)
    assert normalise(best, 1, STANDARD) == pytest.approx(100.0)


def test_null_detector_normalises_to_zero() -> None:
    """Never firing scores -A_FN per window, i.e. 0 after normalisation."""
    f = series(1000, [(300, 349), (700, 749)])
    threshold, best = optimise_threshold([(f, np.zeros(1000))], STANDARD)
    assert normalise(best, 2, STANDARD) == pytest.approx(0.0)
    assert math.isnan(normalise(0.0, 0, STANDARD))


def test_windowed_gaussian_first_score_is_zero_and_scores_in_unit_interval() -> None:
    """The ported NAB reference detector emits [0, 1] scores, 0 on the first row."""
    rng = np.random.default_rng(0)
    values = rng.normal(0, 1, 500).tolist() + [50.0]
    scores = WindowedGaussian(window=200, step=10).run(values)
    assert scores[0] == 0.0
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert scores[-1] > 0.999
