"""EWMA / Holt: follow the level (and trend) of a signal, score the one-step residual."""

from __future__ import annotations

from detectors._stats import EWStats, finite, safe_ratio
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

    Score above 1: outside the ``k``-std band. O(1) time and memory.

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
        self._prev: float | None = None  # last raw value (for diff)
        self._smoothed: float | None = None  # EWMA of span `smooth` of the input
        self._level: float | None = None
        self._trend = 0.0
        self._n = 0
        self._resid = EWStats(var_alpha if var_alpha is not None else alpha)

    def _input(self, x: float) -> float | None:
        """The value the model sees for raw ``x`` (differenced, smoothed), or None."""
        if self.diff:
            if self._prev is None:
                return None
            x = x - self._prev
        if self.smooth > 1 and self._smoothed is not None:
            x = self._smoothed + 2.0 / (self.smooth + 1) * (x - self._smoothed)
        return x

    def _forecast(self) -> float:
        assert self._level is not None
        return self._level + self._trend

    def score_one(self, x: float) -> float:
        if not finite(x) or self._level is None or self._n < self.min_samples:
            return 0.0
        y = self._input(x)
        if y is None:
            return 0.0
        resid = abs(y - self._forecast())
        return safe_ratio(resid, self.k * self._resid.std, self._level)

    def learn_one(self, x: float) -> None:
        if not finite(x):
            return
        y = self._input(x)
        self._prev = x
        if y is None:
            return
        if self.smooth > 1:
            self._smoothed = y
        if self._level is None:
            self._level = y
            self._n = 1
            return
        self._n += 1
        # A fast start (1/n) until the smoothing weight takes over, as in EWStats.
        a = max(self.alpha, 1.0 / self._n)
        resid = y - self._forecast()
        self._resid.update(resid)
        new_level = self._forecast() + a * resid
        if self.beta > 0:
            self._trend += self.beta * (new_level - self._level - self._trend)
        self._level = new_level
