"""Monotone climbs: memory leaks, KL runaways, a loss that only goes one way."""

from __future__ import annotations

from collections import deque
from math import isfinite, sqrt

from detectors._stats import SCORE_CAP, exact_sum
from detectors.base import Detector

__all__ = ["Slope"]


class Slope(Detector):
    """Least-squares slope over the last ``window`` values, as a t-statistic, over ``k``.

    Running sums of y and y·t (t the position in the window) give the slope in O(1) per
    value; the residual std comes from the same sums. A steady climb far larger than the
    noise gives a large t-statistic long before the level leaves any band. Scoring ``x``
    asks "with ``x`` appended, is the window trending?"; ``direction="up"`` ignores
    falls (memory, KL), ``"both"`` scores either sign.

    The sums are recomputed exactly once per ``window`` updates (no drift).

    >>> d = Slope(window=20)
    >>> for i in range(20):
    ...     d.learn_one(100.0 + (i % 2))
    >>> flat = d.score_one(100.0)
    >>> for i in range(20):
    ...     d.learn_one(100.0 + 0.5 * i + (i % 2))
    >>> flat < 1.0 < d.score_one(110.5)
    True
    """

    def __init__(self, window: int = 50, k: float = 5.0, direction: str = "up") -> None:
        if window < 3:
            raise ValueError(f"window must be >= 3, got {window}")
        if not k > 0:
            raise ValueError(f"k must be > 0, got {k}")
        if direction not in ("up", "both"):
            raise ValueError(f"direction must be 'up' or 'both', got {direction!r}")
        self.window = window
        self.k = k
        self.direction = direction
        self._values: deque[float] = deque(maxlen=window)
        self._sy = 0.0  # sum of y
        self._sty = 0.0  # sum of t * y, t = 0 .. n-1 (oldest first)
        self._syy = 0.0
        self._since_exact = 0

    def _t_stat(self, x: float) -> float:
        """The t-statistic of the slope of the window with ``x`` appended."""
        values = self._values
        n, sy, sty, syy = len(values), self._sy, self._sty, self._syy
        if n == self.window:
            old = values[0]
            # Dropping the oldest shifts every t down by one: Σt·y -= Σy - old.
            sy -= old
            syy -= old * old
            sty -= sy
            n -= 1
        sty += n * x
        sy += x
        syy += x * x
        n += 1
        if n < 3:
            return 0.0
        st = n * (n - 1) / 2.0
        sxx = (n - 1) * n * (2 * n - 1) / 6.0 - st * st / n
        sxy = sty - st * sy / n
        syy_c = syy - sy * sy / n
        if not (isfinite(sxy) and isfinite(syy_c)):
            return 0.0
        slope = sxy / sxx
        if slope == 0.0 or (slope < 0.0 and self.direction == "up"):
            return 0.0
        sse = syy_c - slope * sxy
        se = sqrt(sse / (n - 2) / sxx) if sse > 0.0 else 0.0
        floor = 1e-12 * abs(sy / n)
        if floor < 1e-12:
            floor = 1e-12
        t = abs(slope) / (se if se > floor else floor)
        return t if t < SCORE_CAP else SCORE_CAP

    def score_one(self, x: float) -> float:
        if len(self._values) < self.window - 1:
            return 0.0
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        score = self._t_stat(x) / self.k
        return score if score < SCORE_CAP else SCORE_CAP

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        values = self._values
        n = len(values)
        if n == self.window:
            old = values[0]
            self._sy -= old
            self._syy -= old * old
            self._sty -= self._sy
            n -= 1
        self._sty += n * x
        self._sy += x
        self._syy += x * x
        values.append(x)
        self._since_exact += 1
        if self._since_exact >= self.window:
            self._since_exact = 0
            self._sy = exact_sum(values)
            self._sty = exact_sum(t * y for t, y in enumerate(values))
            self._syy = exact_sum(y * y for y in values)
