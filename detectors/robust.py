"""Median / MAD: a band that a few huge outliers cannot stretch."""

from __future__ import annotations

import bisect
from bisect import bisect_left, insort
from collections import deque
from math import isfinite

from detectors._stats import SCORE_CAP, exact_sum
from detectors.base import Detector

__all__ = ["RobustZScore", "mad_of_sorted"]

_MAD_TO_STD = 1.4826  # MAD of a normal distribution is 0.6745 std


class RobustZScore(Detector):
    """``|x - median| / (k · 1.4826 · MAD)`` over the last ``window`` values.

    Mean ± k·std is stretched by the very spikes it should flag (one 1e6 latency widens
    the band for a whole window); the median and the median absolute deviation are not.
    The window is kept twice: in arrival order (to expire the oldest) and sorted (bisect:
    O(log W) comparisons plus a memmove that costs ~100 ns at W ≤ 10⁴), so the median
    is O(1). The MAD is recomputed every ``refresh`` updates (default ``window // 8``)
    by a bisection over the sorted window (O(log W), no sort); between refreshes it is
    at most that stale,
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
        self._refresh = refresh if refresh is not None else max(1, window // 8)
        self._min = max(1, min_samples if min_samples is not None else window // 2)
        self._fifo: deque[float] = deque()
        self._sorted: list[float] = []
        self._mad = 0.0
        self._band = 0.0  # k * 1.4826 * MAD, the denominator of the score
        self._since_mad = 0

    def median(self) -> float:
        s, n = self._sorted, len(self._sorted)
        if n == 0:
            return 0.0
        mid = n // 2
        return s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])

    def _compute_mad(self) -> float:
        return mad_of_sorted(self._sorted)

    def score_one(self, x: float) -> float:
        s = self._sorted
        n = len(s)
        if n < self._min:
            return 0.0
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        mid = n // 2
        med = s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
        dev = abs(x - med)
        if dev == 0.0:
            return 0.0
        floor = 1e-12 * (abs(med) if abs(med) > 1.0 else 1.0)
        band = self._band
        ratio = dev / (band if band > floor else floor)
        return ratio if ratio < SCORE_CAP else SCORE_CAP

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        fifo, s = self._fifo, self._sorted
        if len(fifo) == self.window:
            del s[bisect_left(s, fifo.popleft())]
        fifo.append(x)
        insort(s, x)
        self._since_mad += 1
        # Every n/8 values while the window fills (so early scores are sane), then every
        # `refresh` values.
        n8 = len(s) >> 3
        if self._since_mad >= (self._refresh if self._refresh < n8 else (n8 if n8 > 1 else 1)):
            self._mad = mad = self._compute_mad()
            self._band = self.k * _MAD_TO_STD * mad
            self._since_mad = 0


def mad_of_sorted(s: list[float]) -> float:
    """The median of ``|v - median|`` of a sorted list, by selection: O(log n), no sort.

    The deviations of the values below the median, read from the median outwards, and
    those of the values above it are two sorted runs; the middle of their union is found
    by bisection instead of sorting n deviations. When the MAD is 0 (more than half the
    values identical), the mean absolute deviation from the median stands in (in MAD
    units), O(n) but only while the MAD is 0.
    """
    n = len(s)
    if n == 0:
        return 0.0
    mid = n // 2
    med = s[mid] if n % 2 else 0.5 * (s[mid - 1] + s[mid])
    p = bisect.bisect_left(s, med)  # s[:p] < med <= s[p:]
    na, nb = p, n - p

    def kth(k: int) -> float:
        # k-th smallest (0-based) of A[i] = med - s[p-1-i] and B[j] = s[p+j] - med.
        lo, hi = max(0, k + 1 - nb), min(k + 1, na)
        while lo < hi:  # the number i taken from A: smallest with A[i] >= B[k-i]
            i = (lo + hi) // 2
            if med - s[p - 1 - i] < s[p + k - i] - med:
                lo = i + 1
            else:
                hi = i
        i, j = lo, k + 1 - lo
        a = med - s[p - i] if i > 0 else -1.0
        b = s[p + j - 1] - med if j > 0 else -1.0
        return a if a > b else b

    mad = kth(mid) if n % 2 else 0.5 * (kth(mid - 1) + kth(mid))
    if mad == 0.0:
        total = (exact_sum(s[p:]) - nb * med) + (na * med - exact_sum(s[:p]))
        mad = total / n / _MAD_TO_STD
    return mad
