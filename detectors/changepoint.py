"""Change-point tests: sustained shifts and slow creeps that no single value gives away."""

from __future__ import annotations

from math import isfinite, sqrt

from detectors._stats import SCORE_CAP
from detectors.base import Detector

__all__ = ["CUSUM", "PageHinkley"]


class _Reference(Detector):
    """A slowly adapting EW mean / std that values are standardised against (shared code)."""

    alpha: float
    min_samples: int

    def _init_reference(self) -> None:
        self._n = 0
        self._mean = 0.0
        self._var = 0.0
        self._std = 0.0

    def _z(self, x: float) -> float:
        mean, std = self._mean, self._std
        am = abs(mean)
        if std <= 1e-12 * (am if am > 1.0 else 1.0):
            return 0.0 if x == mean else (SCORE_CAP if x > mean else -SCORE_CAP)
        z = (x - mean) / std
        return SCORE_CAP if z > SCORE_CAP else (-SCORE_CAP if z < -SCORE_CAP else z)

    def _update_reference(self, x: float) -> None:
        n = self._n = self._n + 1
        a = 1.0 / n
        if a < self.alpha:
            a = self.alpha
        d = x - self._mean
        mean = self._mean + a * d
        var = (1.0 - a) * (self._var + a * d * d)
        if not (isfinite(mean) and isfinite(var)):
            mean, var = x, 1e300  # 1e300-scale input overflows the square
        self._mean, self._var, self._std = mean, var, sqrt(var)


class CUSUM(_Reference):
    """Two-sided CUSUM of standardised values against a slowly adapting reference.

    Each value is standardised by a long EW mean and std (weight ``alpha``); the upper sum
    ``S+ = max(0, S+ + z - drift)`` and the lower sum ``S- = max(0, S- - z - drift)``
    accumulate evidence of a shift of more than ``drift`` stds. The score is
    ``max(S+, S-) / h``: above 1 is a detected change. A step of ``d`` stds is found
    after about ``h / (d - drift)`` values; a single spike barely moves the sums. When a
    sum crosses ``h`` it restarts from 0 (the reference meanwhile follows the new level),
    so one shift gives one detection, not a plateau of alarms.

    >>> d = CUSUM(alpha=0.01, drift=0.5, h=5.0)
    >>> for x in [0.0, 1.0] * 100:
    ...     d.learn_one(x)
    >>> for _ in range(3):
    ...     d.learn_one(1.5)
    >>> d.score_one(1.5) > 1.0
    True
    """

    def __init__(self, alpha: float = 0.001, drift: float = 0.5, h: float = 5.0,
                 min_samples: int = 30) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if drift < 0:
            raise ValueError(f"drift must be >= 0, got {drift}")
        if not h > 0:
            raise ValueError(f"h must be > 0, got {h}")
        self.alpha = alpha
        self.drift = drift
        self.h = h
        self.min_samples = min_samples
        self._init_reference()
        self._pos = 0.0
        self._neg = 0.0

    def score_one(self, x: float) -> float:
        if self._n < self.min_samples:
            return 0.0
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        z = self._z(x)
        pos = self._pos + z - self.drift
        neg = self._neg - z - self.drift
        top = pos if pos > neg else neg
        if top <= 0.0:
            return 0.0
        score = top / self.h
        return score if score < SCORE_CAP else SCORE_CAP

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        if self._n >= self.min_samples:
            z = self._z(x)
            pos = self._pos + z - self.drift
            neg = self._neg - z - self.drift
            if pos > self.h or neg > self.h:
                pos = neg = 0.0
            self._pos = pos if pos > 0.0 else 0.0
            self._neg = neg if neg > 0.0 else 0.0
        self._update_reference(x)


class PageHinkley(_Reference):
    """Page-Hinkley test for a sustained rise (or fall) of the mean: slow creeps.

    ``m_t = sum(x_i - mean_i - delta)`` (``mean_i`` the running mean, ``delta`` the
    tolerated change per value in units of the signal's std) and the statistic is
    ``m_t - min(m)`` for a rise (``direction="up"``), ``max(m) - m_t`` for a fall, or
    the larger of both. The score is that statistic over ``threshold`` stds; it restarts
    after a detection. Memory leaks and KL runaways show up here before any single value
    leaves the band.

    Only the distances to the extremes are stored (``m - min(m)`` and ``max(m) - m``),
    so the sums stay bounded forever.
    """

    def __init__(self, delta: float = 0.005, threshold: float = 50.0, direction: str = "both",
                 alpha: float = 0.001, min_samples: int = 30) -> None:
        if direction not in ("up", "down", "both"):
            raise ValueError(f"direction must be 'up', 'down' or 'both', got {direction!r}")
        if not threshold > 0:
            raise ValueError(f"threshold must be > 0, got {threshold}")
        self.delta = delta
        self.threshold = threshold
        self.direction = direction
        self.alpha = alpha
        self.min_samples = min_samples
        self._init_reference()
        self._up = 0.0  # m - min(m) >= 0
        self._down = 0.0  # max(m) - m >= 0 (of the sum with +delta)

    def _statistics(self, x: float) -> tuple[float, float]:
        z = self._z(x)
        up = self._up + z - self.delta
        down = self._down - z - self.delta
        return (up if up > 0.0 else 0.0), (down if down > 0.0 else 0.0)

    def score_one(self, x: float) -> float:
        if self._n < self.min_samples:
            return 0.0
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        up, down = self._statistics(x)
        direction = self.direction
        stat = up if direction == "up" else down if direction == "down" else (
            up if up > down else down)
        score = stat / self.threshold
        return score if score < SCORE_CAP else SCORE_CAP

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        if self._n >= self.min_samples:
            up, down = self._statistics(x)
            direction = self.direction
            stat = up if direction == "up" else down if direction == "down" else (
                up if up > down else down)
            if stat > self.threshold:
                up = down = 0.0
            self._up, self._down = up, down
        self._update_reference(x)
