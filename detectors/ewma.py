"""EWMA / Holt: follow the level (and trend) of a signal, score the one-step residual."""

from __future__ import annotations

from math import isfinite, sqrt

from detectors._stats import SCORE_CAP
from detectors.base import Detector

__all__ = ["EWMA"]


class EWMA(Detector):
    """Residual of an exponentially smoothed forecast, in units of ``k`` residual stds.

    The forecast is Holt's level + trend (``beta=0`` gives a plain EWMA level, which is
    what a spike detector wants; ``beta > 0`` follows ramps such as a learning-rate warmup
    so only departures from the ramp score). The residual ``x - forecast`` is scored
    against an exponentially weighted variance of past residuals (weight ``var_alpha``,
    default ``alpha``), so the band widens on noisy signals and narrows on quiet ones.

    - ``smooth``: if > 1, the input is first averaged by an EWMA of span ``smooth``
      values; this trades a little delay for sensitivity to small sustained level shifts.
    - ``diff``: score the first difference ``x - previous`` instead of ``x``: sudden jumps
      on signals whose level wanders too much for a level band.
    - ``min_samples``: values to see before scoring (score 0 until then).

    Score above 1: outside the ``k``-std band. O(1) time and memory. The hot path is
    written out by hand (no helper calls, no properties): this runs once per value per
    signal in the stream engine.

    >>> d = EWMA(alpha=0.1)
    >>> for x in [1.0, 1.1, 0.9, 1.0] * 10:
    ...     d.learn_one(x)
    >>> d.score_one(1.0) < 1.0 < d.score_one(3.0)
    True
    """

    def __init__(self, alpha: float = 0.01, beta: float = 0.0, k: float = 3.0,
                 var_alpha: float | None = None, smooth: int = 1, diff: bool = False,
                 min_samples: int = 10) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if not k > 0:
            raise ValueError(f"k must be > 0, got {k}")
        if smooth < 1:
            raise ValueError(f"smooth must be >= 1, got {smooth}")
        self.alpha = alpha
        self.beta = beta
        self.k = k
        self.var_alpha = var_alpha
        self.smooth = smooth
        self.diff = diff
        self.min_samples = min_samples
        self._sa = 2.0 / (smooth + 1) if smooth > 1 else 0.0  # weight of the input smoother
        self._va = var_alpha if var_alpha is not None else alpha
        self._prev: float | None = None  # last raw value (for diff)
        self._smoothed: float | None = None  # EWMA of span `smooth` of the input
        self._level: float | None = None
        self._trend = 0.0
        self._n = 0
        # Exponentially weighted mean / variance of past residuals (West's update).
        self._rmean = 0.0
        self._rvar = 0.0
        self._rstd = 0.0
        self._rn = 0

    def score_one(self, x: float) -> float:
        level = self._level
        if level is None or self._n < self.min_samples:
            return 0.0
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        if self.diff:
            x = x - self._prev  # type: ignore[operator]  # set once level is
        if self._sa:
            sm = self._smoothed
            if sm is not None:
                x = sm + self._sa * (x - sm)
        resid = abs(x - level - self._trend)
        if resid == 0.0:
            return 0.0
        den = self.k * self._rstd
        floor = 1e-12 * (abs(level) if abs(level) > 1.0 else 1.0)
        ratio = resid / (den if den > floor else floor)
        return ratio if ratio < SCORE_CAP else SCORE_CAP

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        y = x
        if self.diff:
            prev = self._prev
            self._prev = x
            if prev is None:
                return
            y = x - prev
        if self._sa:
            sm = self._smoothed
            if sm is not None:
                y = sm + self._sa * (y - sm)
            self._smoothed = y
        level = self._level
        if level is None:
            self._level = y
            self._n = 1
            return
        n = self._n = self._n + 1
        # A fast start (1/n) until the smoothing weight takes over, as in EWStats.
        a = 1.0 / n
        if a < self.alpha:
            a = self.alpha
        forecast = level + self._trend
        resid = y - forecast
        rn = self._rn = self._rn + 1
        ra = 1.0 / rn
        if ra < self._va:
            ra = self._va
        d = resid - self._rmean
        rmean = self._rmean + ra * d
        rvar = (1.0 - ra) * (self._rvar + ra * d * d)
        if not (isfinite(rmean) and isfinite(rvar)):
            # 1e300-scale input overflows the square; keep a usable, huge spread.
            rmean, rvar = resid, 1e300
        self._rmean, self._rvar, self._rstd = rmean, rvar, sqrt(rvar)
        new_level = forecast + a * resid
        if self.beta > 0:
            self._trend += self.beta * (new_level - level - self._trend)
        self._level = new_level
