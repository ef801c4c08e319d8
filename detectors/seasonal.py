"""Seasonal difference: today's value against the value one period (a day) earlier."""

from __future__ import annotations

from collections import deque
from math import isfinite, sqrt

from detectors._stats import SCORE_CAP
from detectors.base import Detector

__all__ = ["Seasonal"]


class Seasonal(Detector):
    """``y = x - x[t - period]`` scored against its own EW mean and std, over ``k``.

    A daily pattern (traffic, request volumes, a nightly job) makes a level band useless:
    a missing peak or a peak at half height is still inside the day's range. The
    difference to the same time one period ago removes the pattern, so what scores is a
    change *of the pattern*. ``period`` is in values (rows); ``detectors.score`` derives
    it from timestamps (values per day).

    - ``smooth``: if > 1, ``y`` is averaged by an EWMA of span ``smooth`` values first:
      a sustained change of the pattern (a lower plateau, a flat day) instead of a single
      value.
    - ``alpha``: weight of the EW mean / variance of ``y`` (long memory).
    - ``min_samples``: differences to see before scoring (0 until then, and 0 during the
      first ``period`` values, which have no counterpart yet).

    Memory is ``period`` floats (bounded by the constructor argument, as a window).

    >>> d = Seasonal(period=4, alpha=0.05)
    >>> for i in range(200):
    ...     d.learn_one([0.0, 10.0, 20.0, 10.0][i % 4])
    >>> d.score_one(0.0) < 1.0 < d.score_one(20.0)  # 20 where the cycle has a 0
    True
    """

    def __init__(self, period: int = 288, alpha: float = 0.0003, k: float = 3.0, smooth: int = 1,
                 min_samples: int = 30) -> None:
        if period < 1:
            raise ValueError(f"period must be >= 1, got {period}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not k > 0:
            raise ValueError(f"k must be > 0, got {k}")
        if smooth < 1:
            raise ValueError(f"smooth must be >= 1, got {smooth}")
        self.period = period
        self.alpha = alpha
        self.k = k
        self.smooth = smooth
        self.min_samples = min_samples
        self._sa = 2.0 / (smooth + 1) if smooth > 1 else 0.0
        self._min = max(1, min_samples)  # n > 0 also means a full period is stored
        self._past: deque[float] = deque(maxlen=period)
        self._smoothed: float | None = None
        self._n = 0  # differences learned
        self._mean = 0.0
        self._var = 0.0
        self._std = 0.0

    def score_one(self, x: float) -> float:
        if self._n < self._min:
            return 0.0
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        y = x - self._past[0]
        if self._sa:
            sm = self._smoothed
            if sm is not None:
                y = sm + self._sa * (y - sm)
        dev = abs(y - self._mean)
        if dev == 0.0:
            return 0.0
        den = self.k * self._std
        floor = 1e-12 * (abs(self._mean) if abs(self._mean) > 1.0 else 1.0)
        ratio = dev / (den if den > floor else floor)
        return ratio if ratio < SCORE_CAP else SCORE_CAP

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        past = self._past
        if len(past) == self.period:
            y = x - past[0]
            if self._sa:
                sm = self._smoothed
                if sm is not None:
                    y = sm + self._sa * (y - sm)
                self._smoothed = y
            n = self._n = self._n + 1
            a = 1.0 / n
            if a < self.alpha:
                a = self.alpha
            d = y - self._mean
            mean = self._mean + a * d
            var = (1.0 - a) * (self._var + a * d * d)
            if not (isfinite(mean) and isfinite(var)):
                mean, var = (y if isfinite(y) else 0.0), 1e300  # 1e300-scale input
            self._mean, self._var, self._std = mean, var, sqrt(var)
        past.append(x)
