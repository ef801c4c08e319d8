"""Small O(1) running statistics shared by the detectors (private helpers)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

__all__ = ["EWStats", "finite", "exact_sum", "safe_ratio", "refractory_gate", "refractory_push",
           "check_layout"]

# Scores are capped so that 1e300-sized input never overflows into inf.
SCORE_CAP = 1e9


def finite(x: float) -> bool:
    """Whether ``x`` is a finite real number (bools and ints pass)."""
    try:
        return math.isfinite(x)
    except TypeError:
        return False


def exact_sum(values: Any) -> float:
    """``math.fsum``, except where it raises OverflowError (values near the float limit,
    whose exact sum does not fit a float): then the plain float sum, inf or nan, as the
    detectors' running sums give. A detector must never raise on finite input.

    >>> exact_sum([0.1] * 10), exact_sum([1e308, 1e308])
    (1.0, inf)
    """
    values = list(values)
    try:
        return math.fsum(values)
    except OverflowError:
        return sum(values, 0.0)


def refractory_gate(recent: deque[tuple[int, float]], horizon: int, score: float) -> float:
    """``score``, or 0.0 when a score of the last values (index > ``horizon``) was as high.

    ``recent`` holds ``(index, score)`` with decreasing scores (:func:`refractory_push`),
    so the first entry in range is the maximum: NAB counts one detection per window, and a
    combiner that keeps firing on the same episode only adds false positives.
    """
    for idx, past in recent:
        if idx > horizon:
            return 0.0 if score <= past else score
    return score


def refractory_push(recent: deque[tuple[int, float]], horizon: int, n: int,
                    score: float) -> None:
    """Record value ``n``'s ``score``: drop entries at or before ``horizon`` and those it
    outranks, so ``recent`` stays a decreasing window maximum (amortised O(1))."""
    while recent and recent[0][0] <= horizon:
        recent.popleft()
    while recent and recent[-1][1] <= score:
        recent.pop()
    recent.append((n, score))


def check_layout(state: dict[str, Any], layout: int, name: str) -> None:
    """Refuse to unpickle a detector state written with another layout, saying what to do."""
    found = state.get("_layout")
    if found != layout:
        raise ValueError(f"cannot restore a {name} saved with state layout {found!r} "
                         f"(this version reads {layout}); start a fresh one")


def safe_ratio(num: float, den: float, scale: float) -> float:
    """``num / den`` capped at :data:`SCORE_CAP`; ``den`` is floored relative to ``scale``.

    A zero spread (constant history) makes any change infinitely surprising; the floor
    and the cap keep the score finite and ordered instead.
    """
    floor = 1e-12 * max(1.0, abs(scale))
    if num == 0.0:
        return 0.0
    ratio = num / max(den, floor)
    return min(SCORE_CAP, ratio) if math.isfinite(ratio) else SCORE_CAP


class EWStats:
    """Exponentially weighted mean and variance (West's update), O(1) and picklable.

    The weight is ``max(alpha, 1 / n)`` so the first values give an ordinary running mean
    instead of a start biased towards the first value.
    """

    __slots__ = ("alpha", "mean", "var", "n")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.mean = 0.0
        self.var = 0.0
        self.n = 0

    def update(self, x: float) -> None:
        self.n += 1
        a = max(self.alpha, 1.0 / self.n)
        d = x - self.mean
        self.mean += a * d
        self.var = (1.0 - a) * (self.var + a * d * d)
        if not math.isfinite(self.mean) or not math.isfinite(self.var):
            # 1e300-scale input overflows the square; keep a usable, huge spread.
            self.mean = x
            self.var = 1e300

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def __getstate__(self) -> tuple[float, float, float, int]:
        return (self.alpha, self.mean, self.var, self.n)

    def __setstate__(self, state: tuple[float, float, float, int]) -> None:
        self.alpha, self.mean, self.var, self.n = state
