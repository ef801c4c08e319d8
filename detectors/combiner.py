"""Many detectors, one calibrated score in [0, 1] that fires rarely and early."""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Sequence

from detectors._stats import finite
from detectors.base import Detector

__all__ = ["Combiner"]


class Combiner(Detector):
    """Max of record-calibrated sub-scores, mapped to [0, 1), with a refractory period.

    Raw scores of different detectors live on different scales (a z-score, a CUSUM sum,
    a t-statistic) and have different tails on different signals, so one threshold
    cannot serve them all. Each raw score is therefore calibrated by its own *record*:
    ``r = raw / M`` where ``M`` is the largest raw score this sub-detector has produced
    so far, decaying by ``decay`` per value (half-life ``ln 2 / (1 - decay)`` values).
    ``r > 1`` means "more surprising than anything seen lately", which means the same on
    every signal. The combined ratio is the weighted max over sub-detectors and the score
    is ``r / (1 + r)`` (0.5 at the record).

    ``refractory``: a combined score that does not exceed every score of the previous
    ``refractory`` values is reported as 0: one event gives one alarm at its onset, not
    an alarm per value while the event lasts, and an alarm again only if it escalates.

    Nothing is scored until ``warmup`` values have been learned (the records need a
    history), and a sub-detector contributes only once it has a record (> 0): after a
    constant stretch, the first change only sets the scale. The sub-detectors' own raw
    scores (``k``-std units) remain the tool for absolute checks. ``score_one`` is pure: ``learn_one`` re-scores the value before folding it
    into the sub-detectors.

    >>> from detectors.ewma import EWMA
    >>> c = Combiner([EWMA(alpha=0.05)], warmup=20, refractory=0)
    >>> for i in range(200):
    ...     c.learn_one(float(i % 5))
    >>> 0.0 <= c.score_one(2.0) < 0.5 < c.score_one(50.0) < 1.0
    True
    """

    def __init__(self, detectors: Sequence[Detector], weights: Sequence[float] | None = None,
                 decay: float = 0.9997, warmup: int = 150, refractory: int = 100) -> None:
        if not detectors:
            raise ValueError("detectors must not be empty")
        if weights is not None and len(weights) != len(detectors):
            raise ValueError(f"{len(weights)} weights for {len(detectors)} detectors")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.detectors = list(detectors)
        self.weights = None if weights is None else tuple(float(w) for w in weights)
        self.decay = decay
        self.warmup = warmup
        self.refractory = refractory
        self._records = [0.0] * len(self.detectors)
        self._n = 0
        self._recent: deque[tuple[int, float]] = deque()  # decreasing scores, for the max

    def clone(self) -> Combiner:
        """A fresh combiner over fresh clones of the sub-detectors."""
        return Combiner([d.clone() for d in self.detectors], weights=copy.copy(self.weights),
                        decay=self.decay, warmup=self.warmup, refractory=self.refractory)

    def _raw_scores(self, x: float) -> list[float]:
        return [d.score_one(x) for d in self.detectors]

    def _combined(self, raws: Sequence[float]) -> float:
        """The calibrated score before the refractory rule."""
        if self._n < self.warmup:
            return 0.0
        best = 0.0
        for i, (raw, record) in enumerate(zip(raws, self._records, strict=True)):
            # A sub-detector without a record yet (still warming up, or a signal that has
            # been constant) has no scale: its first positive score sets the record
            # instead of alarming (tried the other way on NAB: more false alarms).
            if raw > 0.0 and record > 0.0:
                best = max(best, raw / record * (self.weights[i] if self.weights else 1.0))
        return best / (1.0 + best) if math.isfinite(best) else 1.0

    def _recent_max(self) -> float:
        horizon = self._n - self.refractory
        for idx, score in self._recent:
            if idx >= horizon:
                return score
        return -1.0

    def score_one(self, x: float) -> float:
        if not finite(x):
            return 0.0
        score = self._combined(self._raw_scores(x))
        if self.refractory > 0 and score <= self._recent_max():
            return 0.0
        return score

    def learn_one(self, x: float) -> None:
        if not finite(x):
            return
        raws = self._raw_scores(x)
        if self.refractory > 0:
            score = self._combined(raws)
            recent = self._recent
            while recent and recent[0][0] <= self._n - self.refractory:
                recent.popleft()
            while recent and recent[-1][1] <= score:
                recent.pop()
            recent.append((self._n, score))
        if self._n >= self.warmup:
            self._records = [max(rec * self.decay, raw) for rec, raw in
                             zip(self._records, raws, strict=True)]
        for d in self.detectors:
            d.learn_one(x)
        self._n += 1
