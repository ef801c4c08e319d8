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
    Best,
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
from detectors.best import COMPILED, PyBest, reference
from detectors.river_models import RiverHalfSpaceTrees
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
    "RiverHalfSpaceTrees": lambda: RiverHalfSpaceTrees(n_trees=3, height=4, window_size=20),
    "Combiner": lambda: Combiner([EWMA(alpha=0.05), RobustZScore(window=30)], warmup=20,
                                 refractory=10),
    "best": DETECTORS["best"],
    "best-period-7": lambda: Best(period=7),
    "best-python": lambda: PyBest(period=7),
    "best-reference": lambda: reference(7),
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
    "EWMA-smooth", "HalfSpaceTrees", "RiverHalfSpaceTrees", "Seasonal-smooth")]


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


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_values_near_the_float_limit_never_raise(name: str, sign: float) -> None:
    """Windows full of values whose sums overflow a float (found by the property test
    above: math.fsum raised OverflowError in the exact re-sums), then a return to normal:
    learning never raises and every score is finite."""
    det = FACTORIES[name]()
    huge = sign * 8.98846567431158e+307
    series = [0.0] * 30 + [huge, huge * 0.999] * 300 + [1.0 + 0.01 * (i % 7) for i in range(900)]
    for x in series:
        score = det.score_one(x)
        assert math.isfinite(score) and score >= 0.0, (x, score)
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


@pytest.mark.parametrize("model", [HalfSpaceTrees, RiverHalfSpaceTrees])
def test_half_space_trees_take_a_joint_vector(model: Callable[..., Detector]) -> None:
    """Half-Space Trees are multivariate: a dict of signals in, one score out."""
    det = model(n_trees=5, height=6, window_size=20, seed=1)
    for i in range(200):
        det.learn_one({"latency": float(i % 10), "gpu": float(i % 10)})
    assert det.score_one({"latency": 9.0, "gpu": 0.0}) > det.score_one({"latency": 2.0, "gpu": 2.0})
    assert det.score_one({"latency": math.nan, "gpu": 1.0}) == 0.0


def spiky(n: int, seed: int) -> list[float]:
    """A level with noise, spikes, a level shift, a flat stretch and a daily-ish cycle."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        x = 50.0 + 10.0 * math.sin(i / 7.0) + rng.gauss(0, 2)
        if rng.random() < 0.02:
            x += rng.choice([-1, 1]) * rng.uniform(20, 200)
        if i > n // 2:
            x += 15.0
        if n // 3 < i < n // 3 + 40:
            x = 48.0
        out.append(x)
    return out


BEST_SERIES = {
    "spiky": spiky(3000, 0),
    "spiky-2": spiky(2500, 7),
    "noisy-with-non-finite": [math.nan if i % 97 == 0 else x for i, x in enumerate(noisy(1500))],
    "constant-then-change": [7.0] * 600 + [7.5, -3.0, 1e12] + [7.0] * 300,
    "huge": [1e300 * (-1) ** i if i % 50 == 0 else x for i, x in enumerate(noisy(800))],
    "integers": [float(int(abs(x) * 3) % 11) for x in spiky(1200, 3)],
}


def test_best_is_compiled() -> None:
    """The install built detectors/_bestc.c (else Best is the ~10x slower PyBest)."""
    assert COMPILED, ("detectors._bestc is not built: install a C compiler (gcc) and re-run "
                      "`pip install -e .` (scripts/setup.sh)")
    assert Best is not PyBest and issubclass(Best, Detector)


FUSED = [Best, PyBest]


@pytest.mark.parametrize("fused_cls", FUSED, ids=["compiled", "python"])
@pytest.mark.parametrize("series_name", sorted(BEST_SERIES))
@pytest.mark.parametrize("period", [7, 288])
def test_best_scores_equal_its_reference_combiner(series_name: str, period: int,
                                                  fused_cls: type[Detector]) -> None:
    """The fused Best (compiled and Python) gives bit-identical scores to the Combiner of
    the seven detectors."""
    fused, generic = fused_cls(period=period), reference(period)  # type: ignore[call-arg]
    for x in BEST_SERIES[series_name]:
        assert fused.score_one(x) == generic.score_one(x)
        fused.learn_one(x)
        generic.learn_one(x)


@pytest.mark.parametrize("period", [1, 5, 24])
def test_compiled_and_python_best_share_their_state(period: int) -> None:
    """Compiled and Python Best pickle the same state, and either loads the other's
    mid-stream (a Faust table written before an upgrade stays readable)."""
    values = BEST_SERIES["spiky"] + [math.nan, 1e300, -1e300, 7, True, "x"] + noisy(2500)
    c, p = Best(period=period), PyBest(period=period)
    for i, x in enumerate(values):
        if i % 2:
            assert c.score_one(x) == p.score_one(x)  # type: ignore[arg-type]
        c.learn_one(x)  # type: ignore[arg-type]
        p.learn_one(x)  # type: ignore[arg-type]
        if i in (700, 2100):
            assert pickle.dumps(c.__getstate__()) == pickle.dumps(p.__getstate__())
            c_state, p_state = c.__getstate__(), p.__getstate__()
            c = PyBest.__new__(PyBest)  # now the Python one continues the compiled state
            c.__setstate__(c_state)
            p = Best.__new__(Best)
            p.__setstate__(p_state)
    assert c.state() == p.state()


def test_compiled_best_rejects_a_truncated_state() -> None:
    """A state whose window does not match its count fails saying what to do."""
    det = Best(period=5)
    for x in noisy(400):
        det.learn_one(x)
    state = det.__getstate__()
    state["_sorted"] = state["_sorted"][:-1]
    with pytest.raises(ValueError, match="start a fresh detector"):
        Best.__new__(Best).__setstate__(state)
    with pytest.raises(RuntimeError, match="__setstate__"):
        Best.__new__(Best).learn_one(1.0)


@pytest.mark.parametrize("fused_cls", FUSED, ids=["compiled", "python"])
def test_best_learn_alone_equals_score_then_learn(fused_cls: type[Detector]) -> None:
    """learn_one without a score_one first reaches the same state (the cache is not state)."""
    a, b = fused_cls(period=24), fused_cls(period=24)  # type: ignore[call-arg]
    for x in BEST_SERIES["spiky"][:1500]:
        a.score_one(x)
        a.learn_one(x)
        b.learn_one(x)
    assert pickle.dumps(a) == pickle.dumps(b)
    assert a.state()["robust_band"] > 0.0  # type: ignore[attr-defined]


@pytest.mark.parametrize("fused_cls", FUSED, ids=["compiled", "python"])
def test_best_survives_pickling_mid_stream(fused_cls: type[Detector]) -> None:
    """A Best restored from a pickle continues exactly like the original."""
    det = fused_cls(period=24)  # type: ignore[call-arg]
    values = BEST_SERIES["spiky"]
    for x in values[:1000]:
        det.score_one(x)
        det.learn_one(x)
    copy = pickle.loads(pickle.dumps(det))
    for x in values[1000:]:
        assert copy.score_one(x) == det.score_one(x)
        det.learn_one(x)
        copy.learn_one(x)


@pytest.mark.parametrize("model", [Best, PyBest, HalfSpaceTrees])
def test_state_of_another_layout_is_refused_clearly(model: Callable[[], Detector]) -> None:
    """A pickled state whose layout this version does not know fails with a clear message."""
    det = model()
    for x in noisy(400):
        det.learn_one(x)
    state = det.__getstate__()  # type: ignore[attr-defined]
    state["_layout"] = 0
    with pytest.raises(ValueError, match="state layout 0"):
        type(det).__new__(type(det)).__setstate__(state)  # type: ignore[attr-defined]
    del state["_layout"]  # as a state from before layouts were versioned
    with pytest.raises(ValueError, match="start a fresh one"):
        type(det).__new__(type(det)).__setstate__(state)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kwargs", [{}, {"n_trees": 5, "height": 6, "window_size": 20, "seed": 1}])
def test_half_space_trees_equal_rivers_on_one_signal(kwargs: dict[str, int]) -> None:
    """The lean trees are river's trees: identical scores on a single signal."""
    lean, river = HalfSpaceTrees(**kwargs), RiverHalfSpaceTrees(**kwargs)
    for x in BEST_SERIES["spiky"][:1200] + [1e6, -1e6, 50.0]:
        assert lean.score_one(x) == river.score_one(x)
        lean.learn_one(x)
        river.learn_one(x)


def test_half_space_trees_equal_rivers_on_a_joint_vector() -> None:
    """... and on a joint vector of several signals."""
    rng = random.Random(2)
    lean = HalfSpaceTrees(n_trees=6, height=5, window_size=30, seed=3)
    river = RiverHalfSpaceTrees(n_trees=6, height=5, window_size=30, seed=3)
    for i in range(600):
        x = {"latency": rng.gauss(10, 2), "gpu": rng.gauss(50, 5) - (40 if i % 53 == 0 else 0),
             "kl": rng.random()}
        assert lean.score_one(x) == river.score_one(x)
        lean.learn_one(x)
        river.learn_one(x)


def test_half_space_trees_ignore_a_vector_missing_a_signal() -> None:
    """A vector without one of the model's signals scores 0.0 and is not learned."""
    det = HalfSpaceTrees(n_trees=3, height=4, window_size=20)
    for i in range(100):
        det.learn_one({"a": float(i % 7), "b": float(i % 5)})
    before = pickle.dumps(det)
    assert det.score_one({"a": 1.0}) == 0.0
    det.learn_one({"a": 1.0})
    det.learn_one(3.0)  # a plain float is {"x": ...}: not one of the model's signals
    assert pickle.dumps(det) == before


def test_half_space_trees_pickled_under_the_old_name_still_load() -> None:
    """States pickled as detectors.river_models.HalfSpaceTrees (before the lean class) load."""
    det = RiverHalfSpaceTrees(n_trees=3, height=4, window_size=20)
    for x in noisy(100):
        det.learn_one(x)
    data = pickle.dumps(det, protocol=0)  # text protocol: the class is named by a line
    old = data.replace(b"\nRiverHalfSpaceTrees\n", b"\nHalfSpaceTrees\n")
    assert old != data
    restored = pickle.loads(old)
    assert isinstance(restored, RiverHalfSpaceTrees)
    assert restored.score_one(13.0) == det.score_one(13.0) > 0.0


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


def test_compiled_tree_walk_equals_the_python_walk() -> None:
    """HalfSpaceTrees' compiled walk (detectors._bestc.hst_leaves) finds the same leaves."""
    rng = random.Random(4)
    det = HalfSpaceTrees(n_trees=7, height=6, window_size=40, seed=5)
    for i in range(900):
        vec = {f"s{j}": rng.gauss(0, 1 + j) + (25.0 if i % 97 == 0 else 0.0) for j in range(5)}
        det.learn_one(vec)
        scaled = det._scaled([vec[f] for f in sorted(vec)])
        assert det._leaves(scaled) == det._leaves_py(scaled)
    assert det.score_one({f"s{j}": 100.0 for j in range(5)}) > 0.0


def test_without_the_compiled_module_best_falls_back_to_python() -> None:
    """An install without a C compiler still works: Best is PyBest, the walk is Python."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['detectors._bestc'] = None\n"  # as if it was never built
        "from detectors import best, halfspace\n"
        "assert best.Best is best.PyBest and not best.COMPILED\n"
        "assert halfspace._hst_leaves is None\n"
        "d = best.Best(period=7)\n"
        "for i in range(400): d.learn_one(float(i % 7))\n"
        "assert d.score_one(3.0) < 0.5 < d.score_one(1e6)\n"
        "h = halfspace.HalfSpaceTrees(n_trees=3, height=4, window_size=20)\n"
        "for i in range(100): h.learn_one({'a': float(i % 5), 'b': float(i % 3)})\n"
        "print(h.score_one({'a': 9.0, 'b': -4.0}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 0.0 <= float(out.stdout) <= 1.0


def test_compiled_best_refuses_corrupted_states_without_crashing() -> None:
    """Bad states raise (and leave the detector unusable, saying why), never corrupt memory."""
    det = Best(period=5)
    for x in noisy(2500):
        det.learn_one(x)
    good = det.__getstate__()
    bad = dict(good, _n=-3)
    fresh = Best.__new__(Best)
    with pytest.raises(ValueError, match="_n = -3"):
        fresh.__setstate__(bad)
    with pytest.raises(RuntimeError, match="no state"):
        fresh.__getstate__()
    shuffled = dict(good, _sorted=sorted(good["_sorted"], reverse=True))  # not sorted any more
    broken = Best.__new__(Best)
    broken.__setstate__(shuffled)
    with pytest.raises(ValueError, match="inconsistent"):
        for x in noisy(3000, seed=5):
            broken.learn_one(x)


@pytest.mark.parametrize("attr, mangle, says", [
    ("FIELDS", "tuple(reversed(m.FIELDS))", "state layout"),
    ("CONSTANTS", "m.CONSTANTS[:-1] + (0.5,)", "constants differ"),
    ("FIELDS", None, "state layout"),  # a .so built before FIELDS existed: stale
])
def test_a_compiled_module_out_of_step_with_best_py_is_refused(attr: str, mangle: str | None,
                                                               says: str) -> None:
    """The C file writes the layout and constants out; a build that drifted from best.py
    fails at import saying what to do, instead of computing with the wrong fields."""
    import subprocess
    import sys

    change = f"m.{attr} = {mangle}" if mangle else f"del m.{attr}"
    code = (  # detectors/__init__ imports best: change the module, then run best.py again
        "import importlib, detectors.best, detectors._bestc as m\n"
        f"{change}\n"
        "try:\n"
        "    importlib.reload(detectors.best)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert says in out.stdout and "rebuild (pip install -e .)" in out.stdout, out.stdout
