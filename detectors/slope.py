"""Monotone climbs: memory leaks, KL runaways, a loss that only goes one way."""

from __future__ import annotations

import math
from collections import deque

from detectors._stats import SCORE_CAP, finite
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

    def _sums_with(self, x: float) -> tuple[int, float, float, float]:
        """(n, Σy, Σt·y, Σy²) of the window after appending ``x``."""
        n, sy, sty, syy = len(self._values), self._sy, self._sty, self._syy
        if n == self.window:
            old = self._values[0]
            # Dropping the oldest shifts every t down by one: Σt·y -= Σy - old.
            sy -= old
            syy -= old * old
            sty -= sy
            n -= 1
        return n + 1, sy + x, sty + n * x, syy + x * x

    def _t_stat(self, n: int, sy: float, sty: float, syy: float) -> float:
        if n < 3:
            return 0.0
        st = n * (n - 1) / 2.0
        stt = (n - 1) * n * (2 * n - 1) / 6.0
        sxx = stt - st * st / n
        sxy = sty - st * sy / n
        syy_c = syy - sy * sy / n
        if not (math.isfinite(sxy) and math.isfinite(syy_c)):
            return 0.0
        slope = sxy / sxx
        sse = max(0.0, syy_c - slope * sxy)
        se = math.sqrt(sse / (n - 2) / sxx)
        if self.direction == "up" and slope <= 0:
            return 0.0
        floor = 1e-12 * max(1.0, abs(sy / n))
        if slope == 0.0:
            return 0.0
        return min(SCORE_CAP, abs(slope) / max(se, floor))

    def score_one(self, x: float) -> float:
        if not finite(x) or len(self._values) < self.window - 1:
            return 0.0
        return min(SCORE_CAP, self._t_stat(*self._sums_with(x)) / self.k)

    def learn_one(self, x: float) -> None:
        if not finite(x):
            return
        _, self._sy, self._sty, self._syy = self._sums_with(x)
        self._values.append(x)
        self._since_exact += 1
        if self._since_exact >= self.window:
            self._since_exact = 0
            self._sy = math.fsum(self._values)
            self._sty = math.fsum(t * y for t, y in enumerate(self._values))
            self._syy = math.fsum(y * y for y in self._values)
