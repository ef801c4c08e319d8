"""The operators' baseline: a rolling window, anomalous outside mean ± k·std."""

from __future__ import annotations

import math
from collections import deque
from math import isfinite, sqrt

from detectors._stats import exact_sum
from detectors.base import Detector

__all__ = ["AdaptiveThreshold"]

_SCORE_CAP = 1e9


class AdaptiveThreshold(Detector):
    """Rolling mean ± k·std over the last ``window`` values (DOMAIN.md semantics).

    The band is ``[max(0, mean - k·std), mean + k·std]`` when ``nonnegative`` (the
    lower bound is clipped at 0), std is the population std (``numpy.std``, ddof=0).
    Until ``window // 2`` values are seen the detector reports insufficient data
    (``ready`` is False and ``score_one`` returns 0). ``score_one`` returns the distance
    from the mean in units of ``k·std``: a score above 1 means outside the band.

    Running sums make each update O(1); they are recomputed exactly from the window
    once per ``window`` updates so rounding error never accumulates.

    >>> d = AdaptiveThreshold(window=4, k=2.0)
    >>> for x in [1.0, 1.2, 0.8, 1.0]:
    ...     d.learn_one(x)
    >>> d.score_one(1.0) < 1.0 < d.score_one(5.0)
    True
    """

    def __init__(self, window: int = 100, k: float = 3.0, nonnegative: bool = True) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        if not k > 0:
            raise ValueError(f"k must be > 0, got {k}")
        self.window = window
        self.k = k
        self.nonnegative = nonnegative
        self._min = max(1, window // 2)  # insufficient data until half a window
        self._values: deque[float] = deque(maxlen=window)
        self._sum = 0.0
        self._sumsq = 0.0
        self._since_exact = 0

    @property
    def ready(self) -> bool:
        """Whether at least half a window has been seen (before that: insufficient data)."""
        return len(self._values) >= max(1, self.window // 2)

    @property
    def n(self) -> int:
        return len(self._values)

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        values = self._values
        if len(values) == self.window:
            old = values[0]
            self._sum -= old
            self._sumsq -= old * old
        values.append(x)
        self._sum += x
        self._sumsq += x * x
        self._since_exact += 1
        if self._since_exact >= self.window:
            self._sum = exact_sum(values)  # exact re-sum against drift
            self._sumsq = exact_sum(v * v for v in values)
            self._since_exact = 0

    def mean(self) -> float:
        n = len(self._values)
        return self._sum / n if n else 0.0

    def std(self) -> float:
        n = len(self._values)
        if n == 0:
            return 0.0
        mean = self._sum / n
        return math.sqrt(max(0.0, self._sumsq / n - mean * mean))

    def band(self) -> tuple[float, float, float]:
        """(mean, lower, upper) in one pass: what the monitors read on every value."""
        n = len(self._values)
        if not n:
            return 0.0, 0.0, 0.0
        mean = self._sum / n
        var = self._sumsq / n - mean * mean
        spread = self.k * math.sqrt(var) if var > 0.0 else 0.0
        lower = mean - spread
        if self.nonnegative and lower < 0.0:
            lower = 0.0
        return mean, lower, mean + spread

    def bounds(self) -> tuple[float, float]:
        """The healthy band (lower, upper) learned so far."""
        mean, spread = self.mean(), self.k * self.std()
        lower = mean - spread
        if self.nonnegative:
            lower = max(0.0, lower)
        return lower, mean + spread

    def score_one(self, x: float) -> float:
        values = self._values
        n = len(values)
        if n < self._min:
            return 0.0
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        mean = self._sum / n
        var = self._sumsq / n - mean * mean
        spread = self.k * sqrt(var) if var > 0.0 else 0.0
        dev = abs(x - mean)
        if spread > 0.0:
            lower = mean - spread
            if self.nonnegative and lower < 0.0:
                lower = 0.0
            if lower <= x <= mean + spread:
                return dev / spread
        elif x == mean:
            return 0.0
        floor = 1e-12 * (abs(mean) if abs(mean) > 1.0 else 1.0)
        ratio = dev / (spread if spread > floor else floor)
        return ratio if ratio < _SCORE_CAP else _SCORE_CAP

    def is_anomaly(self, x: float) -> bool:
        """Outside the band, with enough data (the baseline's decision rule)."""
        if not math.isfinite(x) or not self.ready:
            return False
        lower, upper = self.bounds()
        return not (lower <= x <= upper)
