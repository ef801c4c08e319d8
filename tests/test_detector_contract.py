"""One contract, every detector: the checks river runs over each of its estimators."""

from __future__ import annotations

import math
import pickle
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detectors import (
    CUSUM,
    EWMA,
    AdaptiveThreshold,
    Combiner,
    Detector,
    HalfSpaceTrees,
    NonFinite,
    PageHinkley,
    RobustZScore,
    Seasonal,
    Slope,
    VarianceChange,
)
from detectors.score import DETECTORS

FACTORIES: dict[str, Callable[[], Detector]] = {
    "AdaptiveThreshold": lambda: AdaptiveThreshold(window=20),
    "RobustZScore": lambda: RobustZScore(window=40),
    "EWMA": lambda: EWMA(alpha=0.05),
    "EWMA-holt": lambda: EWMA(alpha=0.05, beta=0.05),
    "EWMA-smooth": lambda: EWMA(alpha=0.05, smooth=5),
    "EWMA-diff": lambda: EWMA(alpha=0.05, diff=True),
    "VarianceChange": lambda: VarianceChange(short=5, alpha=0.05),
    "CUSUM": lambda: CUSUM(alpha=0.05),
    "PageHinkley": lambda: PageHinkley(alpha=0.05),
    "Slope": lambda: Slope(window=10),
    "Seasonal": lambda: Seasonal(period=7, alpha=0.05),
    "Seasonal-smooth": lambda: Seasonal(period=7, alpha=0.05, smooth=5),
    "NonFinite": NonFinite,
    "HalfSpaceTrees": lambda: HalfSpaceTrees(n_trees=3, height=4, window_size=20),
    "Combiner": lambda: Combiner([EWMA(alpha=0.05), RobustZScore(window=30)], warmup=20,
                                 refractory=10),
    "best": DETECTORS["best"],
}

IDS = list(FACTORIES)
NON_FINITE = [math.nan, math.inf, -math.inf]


def noisy(n: int = 300, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [10.0 + rng.gauss(0, 1) for _ in range(n)]


def trained(name: str, values: list[float] | None = None) -> Detector:
    det = FACTORIES[name]()
    for x in values if values is not None else noisy():
        det.learn_one(x)
    return det


@pytest.fixture(params=IDS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_is_a_detector(name: str) -> None:
    """Every configuration is a Detector with the fixed verbs."""
    assert isinstance(FACTORIES[name](), Detector)


def test_score_before_learning_is_zero(name: str) -> None:
    """A fresh detector scores any finite value 0.0 (nothing learned, nothing surprising)."""
    det = FACTORIES[name]()
    assert det.score_one(5.0) == 0.0
    assert det.score_one(1e300) == 0.0


def test_pickle_round_trip_keeps_scores(name: str) -> None:
    """State survives pickling (Faust tables): same scores and same state afterwards."""
    det = trained(name)
    copy = pickle.loads(pickle.dumps(det))
    probes = [10.0, 13.0, -50.0, 1e6]
    assert [copy.score_one(x) for x in probes] == [det.score_one(x) for x in probes]
    for x in noisy(50, seed=1):
        det.learn_one(x)
        copy.learn_one(x)
    assert [copy.score_one(x) for x in probes] == [det.score_one(x) for x in probes]


def test_score_one_is_pure(name: str) -> None:
    """score_one never changes the detector: its pickle is identical before and after."""
    det = trained(name)
    before = pickle.dumps(det)
    for x in [10.0, 1e6, -1e6, 0.0, math.nan, math.inf]:
        det.score_one(x)
    assert pickle.dumps(det) == before


def test_clone_is_fresh_with_same_params(name: str) -> None:
    """clone() gives an unlearned detector with the same constructor arguments."""
    det = trained(name)
    fresh = det.clone()
    assert repr(fresh) == repr(FACTORIES[name]()) or type(fresh) is type(det)
    assert fresh.score_one(1e6) == 0.0


@pytest.mark.parametrize("bad", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_non_finite_input(name: str, bad: float) -> None:
    """NaN/inf: scored 0.0 and not learned (NonFinite alone scores them 1.0)."""
    det = trained(name)
    before = pickle.dumps(det)
    expected = 1.0 if name == "NonFinite" else 0.0
    assert det.score_one(bad) == expected
    det.learn_one(bad)
    assert pickle.dumps(det) == before


def test_constant_input_is_not_anomalous(name: str) -> None:
    """A constant signal never scores above the alarm level and never divides by zero."""
    det = FACTORIES[name]()
    for _ in range(400):
        score = det.score_one(7.0)
        assert math.isfinite(score)
        assert score < 0.5
        det.learn_one(7.0)


def test_change_after_constant_scores_finite(name: str) -> None:
    """A change after a constant history (zero spread) gives a finite score >= 0."""
    det = trained(name, [7.0] * 300)
    for x in [7.5, -3.0, 1e12]:
        score = det.score_one(x)
        assert math.isfinite(score) and score >= 0.0


def test_huge_values(name: str) -> None:
    """1e300-sized values neither raise nor produce non-finite scores."""
    det = trained(name)
    for x in [1e300, -1e300, 1e300, 10.0, 1e300]:
        score = det.score_one(x)
        assert math.isfinite(score) and score >= 0.0
        det.learn_one(x)
    assert math.isfinite(det.score_one(10.0))


def test_state_size_is_bounded(name: str) -> None:
    """Memory is O(1): the pickled state after 20k values is no bigger than after 2k (+10%)."""
    rng = random.Random(3)
    det = FACTORIES[name]()
    values = [rng.gauss(0, 1) * (1 + i % 7) for i in range(20_000)]
    for x in values[:2000]:
        det.learn_one(x)
    small = len(pickle.dumps(det))
    for x in values[2000:]:
        det.learn_one(x)
    assert len(pickle.dumps(det)) <= small * 1.1 + 256


#: Detectors that score single values by level (the others score variance, drift, slope,
#: differences or smoothed windows, where one spike is not what they look for).
LEVEL_DETECTORS = [n for n in IDS if n not in (
    "NonFinite", "VarianceChange", "CUSUM", "PageHinkley", "Slope", "EWMA-diff",
    "EWMA-smooth", "HalfSpaceTrees", "Seasonal-smooth")]


@pytest.mark.parametrize("level_name", LEVEL_DETECTORS)
def test_spike_scores_higher_than_normal(level_name: str) -> None:
    """A large spike scores higher than a typical value (for detectors that look at level)."""
    name = level_name
    det = trained(name)
    assert det.score_one(60.0) > det.score_one(10.0)


@settings(max_examples=25, deadline=None)
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=1,
                       max_size=200),
       name=st.sampled_from(IDS))
def test_any_input_gives_a_finite_non_negative_score(values: list[float], name: str) -> None:
    """Whatever arrives (NaN, inf, extremes), scores are finite, >= 0, and learning never raises."""
    det = FACTORIES[name]()
    for x in values:
        score = det.score_one(x)
        assert math.isfinite(score) and score >= 0.0
        det.learn_one(x)


@settings(max_examples=20, deadline=None)
@given(values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=200),
       name=st.sampled_from(IDS))
def test_score_then_learn_is_deterministic(values: list[float], name: str) -> None:
    """Two detectors fed the same values give the same scores (no hidden randomness)."""
    a, b = FACTORIES[name](), FACTORIES[name]()
    for x in values:
        assert a.score_one(x) == b.score_one(x)
        a.learn_one(x)
        b.learn_one(x)


def test_combined_scores_are_in_unit_interval() -> None:
    """The combiner's score is a calibrated value in [0, 1]."""
    det = DETECTORS["best"]()
    for x in noisy(400) + [1e6, -1e6, 0.0]:
        assert 0.0 <= det.score_one(x) <= 1.0
        det.learn_one(x)


def test_half_space_trees_take_a_joint_vector() -> None:
    """The river model is multivariate: a dict of signals in, one score out."""
    det = HalfSpaceTrees(n_trees=5, height=6, window_size=20, seed=1)
    for i in range(200):
        det.learn_one({"latency": float(i % 10), "gpu": float(i % 10)})
    assert det.score_one({"latency": 9.0, "gpu": 0.0}) > det.score_one({"latency": 2.0, "gpu": 2.0})
    assert det.score_one({"latency": math.nan, "gpu": 1.0}) == 0.0


def test_slope_fires_on_a_steady_climb() -> None:
    """A leak-like climb scores above 1 while flat noise stays below."""
    rng = random.Random(0)
    det = Slope(window=50)
    for _ in range(50):
        det.learn_one(100 + rng.gauss(0, 1))
    flat = det.score_one(100.0)
    for i in range(50):
        det.learn_one(100 + 0.5 * i + rng.gauss(0, 1))
    assert flat < 1.0 < det.score_one(125.0)


def test_cusum_catches_a_small_sustained_shift() -> None:
    """A one-std shift that no single value flags is found by the cumulative sum."""
    rng = random.Random(0)
    det, band = CUSUM(alpha=0.001, drift=0.5, h=5.0), AdaptiveThreshold(window=100, k=3.0)
    for _ in range(500):
        x = rng.gauss(0, 1)
        det.learn_one(x)
        band.learn_one(x)
    fired = False
    for _ in range(40):
        x = 1.0 + rng.gauss(0, 0.2)
        fired = fired or det.score_one(x) > 1.0
        det.learn_one(x)
    assert fired and not band.is_anomaly(1.0)


def test_variance_change_flags_a_flat_line() -> None:
    """A noisy signal that goes flat at a normal level scores high (stuck metric)."""
    rng = random.Random(0)
    det = VarianceChange(short=8, alpha=0.01)
    for _ in range(500):
        det.learn_one(rng.gauss(0, 1))
    for _ in range(20):
        det.learn_one(0.2)
    assert det.score_one(0.2) > 1.0


def test_robust_band_is_not_stretched_by_spikes() -> None:
    """A few huge outliers in the window do not hide the next moderate anomaly."""
    rng = random.Random(0)
    robust, band = RobustZScore(window=100), AdaptiveThreshold(window=100, k=3.0)
    for i in range(100):
        x = 1e6 if i % 25 == 0 else 10 + rng.gauss(0, 1)
        robust.learn_one(x)
        band.learn_one(x)
    assert robust.score_one(20.0) > 1.0 and not band.is_anomaly(20.0)


def test_page_hinkley_detects_a_creep() -> None:
    """A slow upward creep eventually scores above 1."""
    rng = random.Random(1)
    det = PageHinkley(alpha=0.001)
    for _ in range(300):
        det.learn_one(rng.gauss(0, 1))
    best = 0.0
    for i in range(600):
        x = 0.01 * i + rng.gauss(0, 1)
        best = max(best, det.score_one(x))
        det.learn_one(x)
    assert best > 1.0


def test_seasonal_flags_a_missing_daily_peak() -> None:
    """A peak that does not come, though the value is inside the day's range, scores high."""
    rng = random.Random(0)
    day = [20.0] * 12 + [80.0] * 12
    det = Seasonal(period=24, alpha=0.01)
    for i in range(24 * 20):
        det.learn_one(day[i % 24] + rng.gauss(0, 1))
    assert det.score_one(20.0) < 1.0  # midnight, as usual
    for _ in range(12):
        det.learn_one(20.0 + rng.gauss(0, 1))
    assert det.score_one(20.0) > 1.0  # noon, and the peak does not come


def test_combiner_learn_reuses_scores_without_changing_results() -> None:
    """learn_one after score_one of the same value gives the same state as learn_one alone."""
    a, b = DETECTORS["best"](), DETECTORS["best"]()
    for x in noisy(600) + [40.0, 10.0, -5.0]:
        a.score_one(x)
        a.learn_one(x)
        b.learn_one(x)
    assert pickle.dumps(a) == pickle.dumps(b)
