"""Median / MAD: a band that a few huge outliers cannot stretch."""

from __future__ import annotations

import bisect
from collections import deque

from detectors._stats import finite, safe_ratio
from detectors.base import Detector

__all__ = ["RobustZScore"]

_MAD_TO_STD = 1.4826  # MAD of a normal distribution is 0.6745 std


class RobustZScore(Detector):
    """``|x - median| / (k · 1.4826 · MAD)`` over the last ``window`` values.

    Mean ± k·std is stretched by the very spikes it should flag (one 1e6 latency widens
    the band for a whole window); the median and the median absolute deviation are not.
    The window is kept twice: in arrival order (to expire the oldest) and sorted (bisect:
    O(log W) comparisons plus a memmove that costs ~100 ns at W ≤ 10⁴), so the median
    is O(1). The MAD is recomputed from the sorted window every ``refresh`` updates
    (default ``window // 8``), O(log W) amortised; between refreshes it is at most that stale,
    which a robust scale tolerates by design. Until ``min_samples`` (default
    ``window // 2``) values are seen the score is 0 (insufficient data, as the baseline).

    When the MAD is 0 (more than half the window identical: counters, a quantised
    signal), the mean absolute deviation from the median stands in, so a signal that is
    mostly constant still has a finite, meaningful band.

    >>> d = RobustZScore(window=20)
    >>> for x in [10.0, 11.0, 9.0, 10.5, 9.5] * 4:
    ...     d.learn_one(x)
    >>> d.score_one(10.2) < 1.0 < d.score_one(1000.0)
    True
    """

    def __init__(self, window: int = 500, k: float = 3.0, refresh: int | None = None,
                 min_samples: int | None = None) -> None:
        if window < 3:
            raise ValueError(f"window must be >= 3, got {window}")
        if not k > 0:
            raise ValueError(f"k must be > 0, got {k}")
        self.window = window
        self.k = k
        self.refresh = refresh
        self.min_samples = min_samples
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self._mad = 0.0
        self._since_mad = 0

    def median(self) -> float:
        s, n = self._sorted, len(self._sorted)
        if n == 0:
            return 0.0
        mid = n // 2
        return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])

    def _compute_mad(self) -> float:
        med = self.median()
        dev = sorted(abs(v - med) for v in self._sorted)
        n = len(dev)
        mad = dev[n // 2] if n % 2 else 0.5 * (dev[n // 2 - 1] + dev[n // 2])
        if mad == 0.0 and n:
            mad = sum(dev) / n / _MAD_TO_STD  # mean abs deviation, in MAD units
        return mad

    def score_one(self, x: float) -> float:
        min_samples = self.min_samples if self.min_samples is not None else self.window // 2
        if not finite(x) or len(self._sorted) < max(1, min_samples):
            return 0.0
        med = self.median()
        return safe_ratio(abs(x - med), self.k * _MAD_TO_STD * self._mad, med)

    def learn_one(self, x: float) -> None:
        if not finite(x):
            return
        if len(self._fifo) == self.window:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._fifo.append(x)
        bisect.insort(self._sorted, x)
        self._since_mad += 1
        refresh = self.refresh if self.refresh is not None else max(1, self.window // 8)
        # Every n/8 values while the window fills (so early scores are sane), then every
        # `refresh` values: O(n log n) work every n/8 values is O(log W) amortised.
        if self._since_mad >= min(refresh, max(1, len(self._fifo) // 8)):
            self._mad = self._compute_mad()
            self._since_mad = 0
