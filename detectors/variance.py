"""Variance change: a signal that goes flat (stuck sensor, dead run) or turns jittery."""

from __future__ import annotations

import math

from detectors._stats import EWStats, finite, safe_ratio
from detectors.base import Detector

__all__ = ["VarianceChange"]


class VarianceChange(Detector):
    """Log of the short-term variance, scored against its own long-term EW mean and std.

    A short EW variance (span ``short``) is tracked; its logarithm is compared with the
    long-run distribution of that logarithm (weight ``alpha``). A collapse of variance
    (a flat line where the signal used to be noisy: a stuck metric, ``pg_loss`` exactly
    0) and an explosion of it (gradient-norm instability) both score high. Level
    detectors miss the first: a flat line at a normal level is inside every band.

    Score above 1: the log-variance is more than ``k`` long-run stds from its mean.

    >>> import random
    >>> rng = random.Random(0)
    >>> d = VarianceChange(short=8, alpha=0.01)
    >>> for _ in range(500):
    ...     d.learn_one(rng.gauss(0, 1))
    >>> for _ in range(20):
    ...     d.learn_one(0.5)
    >>> d.score_one(0.5) > 1.0
    True
    """

    def __init__(self, short: int = 12, alpha: float = 0.001, k: float = 3.0,
                 min_samples: int = 30) -> None:
        if short < 2:
            raise ValueError(f"short must be >= 2, got {short}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not k > 0:
            raise ValueError(f"k must be > 0, got {k}")
        self.short = short
        self.alpha = alpha
        self.k = k
        self.min_samples = min_samples
        self._mean: float | None = None  # short EW mean
        self._var = 0.0  # short EW variance
        self._logvar = EWStats(alpha)
        self._scale = EWStats(alpha)  # long-run |x|, so the variance floor is relative

    def _next(self, x: float) -> tuple[float, float, float]:
        """Short mean, short variance and log-variance after folding in ``x``."""
        assert self._mean is not None
        a = 2.0 / (self.short + 1)
        d = x - self._mean
        mean = self._mean + a * d
        var = (1.0 - a) * (self._var + a * d * d)
        if not math.isfinite(var):
            var = 1e300
        # Exact flat lines give var 0; floor it relative to the signal's magnitude so the
        # log stays finite and "flat" is a large but comparable value (not -inf).
        floor = 1e-12 * max(abs(self._scale.mean), 1e-12)
        return mean, var, math.log(max(var, floor, 1e-300))

    def score_one(self, x: float) -> float:
        if not finite(x) or self._mean is None or self._logvar.n < self.min_samples:
            return 0.0
        _, _, logvar = self._next(x)
        return safe_ratio(abs(logvar - self._logvar.mean), self.k * self._logvar.std, 1.0)

    def learn_one(self, x: float) -> None:
        if not finite(x):
            return
        self._scale.update(abs(x))
        if self._mean is None:
            self._mean = x
            return
        self._mean, self._var, logvar = self._next(x)
        self._logvar.update(logvar)
