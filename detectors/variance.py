"""Variance change: a signal that goes flat (stuck sensor, dead run) or turns jittery."""

from __future__ import annotations

from math import isfinite, log, sqrt

from detectors._stats import SCORE_CAP
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
        self._a = 2.0 / (short + 1)
        self._mean: float | None = None  # short EW mean
        self._var = 0.0  # short EW variance
        # Long-run EW mean / variance of the log-variance (West's update), and of |x| (only
        # its mean: the variance floor is relative to the signal's magnitude).
        self._n = 0
        self._lmean = 0.0
        self._lvar = 0.0
        self._lstd = 0.0
        self._sn = 0
        self._smean = 0.0

    def _logvar(self, x: float, mean: float) -> tuple[float, float, float]:
        """Short mean, short variance and log-variance after folding in ``x``."""
        a = self._a
        d = x - mean
        mean += a * d
        var = (1.0 - a) * (self._var + a * d * d)
        if not isfinite(var):
            var = 1e300
        # Exact flat lines give var 0; floor it relative to the signal's magnitude so the
        # log stays finite and "flat" is a large but comparable value (not -inf).
        scale = abs(self._smean)
        floor = 1e-12 * (scale if scale > 1e-12 else 1e-12)
        return mean, var, log(var if var > floor else floor)

    def score_one(self, x: float) -> float:
        mean = self._mean
        if mean is None or self._n < self.min_samples:
            return 0.0
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        dev = abs(self._logvar(x, mean)[2] - self._lmean)
        if dev == 0.0:
            return 0.0
        den = self.k * self._lstd
        ratio = dev / (den if den > 1e-12 else 1e-12)
        return ratio if ratio < SCORE_CAP else SCORE_CAP

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        sn = self._sn = self._sn + 1
        a = 1.0 / sn
        if a < self.alpha:
            a = self.alpha
        smean = self._smean + a * (abs(x) - self._smean)
        self._smean = smean if isfinite(smean) else abs(x)
        mean = self._mean
        if mean is None:
            self._mean = x
            return
        self._mean, self._var, logvar = self._logvar(x, mean)
        n = self._n = self._n + 1
        a = 1.0 / n
        if a < self.alpha:
            a = self.alpha
        d = logvar - self._lmean
        lmean = self._lmean + a * d
        lvar = (1.0 - a) * (self._lvar + a * d * d)
        self._lmean, self._lvar, self._lstd = lmean, lvar, sqrt(lvar)
