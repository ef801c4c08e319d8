"""The baseline against a direct numpy computation of the same rolling window."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors import AdaptiveThreshold


def numpy_band(window: list[float], k: float, nonnegative: bool) -> tuple[float, float]:
    arr = np.asarray(window)
    mean, std = float(np.mean(arr)), float(np.std(arr))
    lower = mean - k * std
    return (max(0.0, lower) if nonnegative else lower), mean + k * std


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(0, 1e4), min_size=1, max_size=150),
       window=st.integers(2, 40), k=st.sampled_from([2.0, 3.0, 4.0]),
       nonnegative=st.booleans())
def test_bounds_match_numpy_window(values: list[float], window: int, k: float,
                                   nonnegative: bool) -> None:
    """After every value, the band equals mean ± k·std of the last W values (lower clipped at 0)."""
    det = AdaptiveThreshold(window=window, k=k, nonnegative=nonnegative)
    for i, x in enumerate(values):
        det.learn_one(x)
        recent = values[max(0, i + 1 - window):i + 1]
        lower, upper = numpy_band(recent, k, nonnegative)
        got_lower, got_upper = det.bounds()
        # Running sums keep the rounding error of a large value until their exact refresh
        # (every W values), so the tolerance scales with the largest of the last 2W values.
        tol = 1e-6 * max(1.0, max(abs(v) for v in values[max(0, i + 1 - 2 * window):i + 1]))
        assert abs(got_lower - lower) <= tol and abs(got_upper - upper) <= tol


@settings(max_examples=40, deadline=None)
@given(values=st.lists(st.floats(0, 100), min_size=1, max_size=120), window=st.integers(2, 30),
       probe=st.floats(0, 200))
def test_decision_matches_numpy_with_insufficient_data_until_half_window(
        values: list[float], window: int, probe: float) -> None:
    """is_anomaly agrees with the numpy band, and is False until W/2 values are seen."""
    det = AdaptiveThreshold(window=window, k=3.0)
    for i, x in enumerate(values):
        det.learn_one(x)
        seen = i + 1
        if seen < max(1, window // 2):
            assert not det.ready and not det.is_anomaly(probe) and det.score_one(probe) == 0.0
            continue
        lower, upper = numpy_band(values[max(0, seen - window):seen], 3.0, True)
        margin = 1e-6 * max(1.0, upper)
        if probe < lower - margin or probe > upper + margin:
            assert det.is_anomaly(probe)
        elif lower + margin < probe < upper - margin:
            assert not det.is_anomaly(probe)


def test_lower_bound_clipped_at_zero_for_nonnegative_signals() -> None:
    """A wide band around a small mean never goes below 0 when the signal is non-negative."""
    det = AdaptiveThreshold(window=4, k=3.0, nonnegative=True)
    for x in [0.0, 10.0, 0.0, 10.0]:
        det.learn_one(x)
    assert det.bounds()[0] == 0.0
    signed = AdaptiveThreshold(window=4, k=3.0, nonnegative=False)
    for x in [0.0, 10.0, 0.0, 10.0]:
        signed.learn_one(x)
    assert signed.bounds()[0] < 0.0


def test_long_stream_does_not_drift_from_numpy() -> None:
    """Running sums are re-synchronised: after 100k values the band still matches numpy.

    The tolerance is 1e-4 std: the baseline's variance is ``Σx²/n - mean²``, which on a
    level of 1e6 with std 1 loses ~1e-5 to cancellation (not drift; known, documented).
    """
    rng = np.random.default_rng(0)
    values = (1e6 + rng.normal(0, 1, 100_000)).tolist()
    det = AdaptiveThreshold(window=100, k=3.0)
    for x in values:
        det.learn_one(x)
    lower, upper = numpy_band(values[-100:], 3.0, True)
    assert np.allclose(det.bounds(), (lower, upper), rtol=0, atol=1e-4)


def test_score_above_one_means_outside_band() -> None:
    """score_one is the distance in units of k·std: > 1 exactly when outside the band."""
    det = AdaptiveThreshold(window=10, k=2.0, nonnegative=False)
    for x in [1.0, 2.0, 3.0, 2.0, 1.0, 2.0, 3.0, 2.0, 1.0, 2.0]:
        det.learn_one(x)
    lower, upper = det.bounds()
    assert det.score_one(upper + 0.01) > 1.0 > det.score_one(upper - 0.01)
    assert det.is_anomaly(lower - 0.01)


def test_values_near_the_float_limit_do_not_crash_the_exact_resum() -> None:
    """Found by the contract's property test: a full window holding two values near
    1.8e308 made math.fsum raise OverflowError inside learn_one (an engine error in the
    service); the running sums overflow to inf instead, and the score stays finite."""
    det = AdaptiveThreshold(window=20)
    for x in [0.0] * 18 + [8.988465674311579e+307, 8.98846567431158e+307]:
        det.learn_one(x)  # the 20th value triggers the exact re-sum
    score = det.score_one(1.0)
    assert math.isfinite(score) and score >= 0
    for _ in range(40):  # the huge values leave the window: sums are finite again
        det.learn_one(1.0)
    assert math.isfinite(det.mean()) and math.isfinite(det.std())
