"""Change-point tests: sustained shifts and slow creeps that no single value gives away."""

from __future__ import annotations

from detectors._stats import SCORE_CAP, EWStats, finite
from detectors.base import Detector

__all__ = ["CUSUM", "PageHinkley"]


def _standardise(ref: EWStats, x: float) -> float:
    std = ref.std
    if std <= 1e-12 * max(1.0, abs(ref.mean)):
        return 0.0 if x == ref.mean else (SCORE_CAP if x > ref.mean else -SCORE_CAP)
    return max(-SCORE_CAP, min(SCORE_CAP, (x - ref.mean) / std))


class CUSUM(Detector):
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
        self._ref = EWStats(alpha)
        self._pos = 0.0
        self._neg = 0.0

    def _sums(self, x: float) -> tuple[float, float]:
        z = _standardise(self._ref, x)
        return max(0.0, self._pos + z - self.drift), max(0.0, self._neg - z - self.drift)

    def score_one(self, x: float) -> float:
        if not finite(x) or self._ref.n < self.min_samples:
            return 0.0
        return min(SCORE_CAP, max(self._sums(x)) / self.h)

    def learn_one(self, x: float) -> None:
        if not finite(x):
            return
        if self._ref.n >= self.min_samples:
            self._pos, self._neg = self._sums(x)
            if max(self._pos, self._neg) > self.h:
                self._pos = self._neg = 0.0
        self._ref.update(x)


class PageHinkley(Detector):
    """Page-Hinkley test for a sustained rise (or fall) of the mean: slow creeps.

    ``m_t = sum(x_i - mean_i - delta)`` (``mean_i`` the running mean, ``delta`` the
    tolerated change per value in units of the signal's std) and the statistic is
    ``m_t - min(m)`` for a rise (``direction="up"``), ``max(m) - m_t`` for a fall, or
    the larger of both. The score is that statistic over ``threshold`` stds; it restarts
    after a detection. Memory leaks and KL runaways show up here before any single value
    leaves the band.
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
        self._ref = EWStats(alpha)
        self._cum_up = 0.0
        self._min_up = 0.0
        self._cum_down = 0.0
        self._max_down = 0.0

    def _stats(self, x: float) -> tuple[float, float, float, float]:
        z = _standardise(self._ref, x)
        up = self._cum_up + z - self.delta
        down = self._cum_down + z + self.delta
        return up, min(self._min_up, up), down, max(self._max_down, down)

    def _statistic(self, x: float) -> float:
        up, min_up, down, max_down = self._stats(x)
        if self.direction == "up":
            return up - min_up
        if self.direction == "down":
            return max_down - down
        return max(up - min_up, max_down - down)

    def score_one(self, x: float) -> float:
        if not finite(x) or self._ref.n < self.min_samples:
            return 0.0
        return min(SCORE_CAP, self._statistic(x) / self.threshold)

    def learn_one(self, x: float) -> None:
        if not finite(x):
            return
        if self._ref.n >= self.min_samples:
            stat = self._statistic(x)
            self._cum_up, self._min_up, self._cum_down, self._max_down = self._stats(x)
            if stat > self.threshold:
                self._cum_up = self._min_up = self._cum_down = self._max_down = 0.0
            # Keep only the distance to the extremes, so the sums stay bounded forever.
            self._cum_up, self._min_up = self._cum_up - self._min_up, 0.0
            self._cum_down, self._max_down = self._cum_down - self._max_down, 0.0
        self._ref.update(x)
