"""Many detectors, one calibrated score in [0, 1] that fires rarely and early."""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Sequence
from math import isfinite
from typing import Any

from detectors._stats import refractory_gate, refractory_push
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
    scores (``k``-std units) remain the tool for absolute checks. ``score_one`` is pure:
    ``learn_one`` re-scores the value before folding it
    into the sub-detectors, unless ``score_one`` just scored the same value (the usual
    score-then-learn loop): then its sub-scores are reused, kept outside the pickled state.

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
        self._w = self.weights if self.weights is not None else (1.0,) * len(self.detectors)
        self._records = [0.0] * len(self.detectors)
        self._n = 0
        self._recent: deque[tuple[int, float]] = deque()  # decreasing scores, for the max
        # (n, x, raw scores, combined score) of the last score_one, so that learn_one of
        # the same value does not score every sub-detector again. Not state: it is left
        # out of the pickle and only used while n (the number learned) is unchanged.
        self._last: tuple[int, float, list[float], float] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_last"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._last = None

    def clone(self) -> Combiner:
        """A fresh combiner over fresh clones of the sub-detectors."""
        return Combiner([d.clone() for d in self.detectors], weights=copy.copy(self.weights),
                        decay=self.decay, warmup=self.warmup, refractory=self.refractory)

    def _combined(self, raws: Sequence[float]) -> float:
        """The calibrated score before the refractory rule."""
        if self._n < self.warmup:
            return 0.0
        best = 0.0
        for raw, record, weight in zip(raws, self._records, self._w, strict=True):
            # A sub-detector without a record yet (still warming up, or a signal that has
            # been constant) has no scale: its first positive score sets the record
            # instead of alarming (tried the other way on NAB: more false alarms).
            if raw > 0.0 and record > 0.0:
                ratio = raw / record * weight
                if ratio > best:
                    best = ratio
        return best / (1.0 + best) if best < math.inf else 1.0

    def _scores(self, x: float) -> tuple[list[float], float]:
        last = self._last
        if last is not None and last[0] == self._n and last[1] == x:
            return last[2], last[3]
        raws = [d.score_one(x) for d in self.detectors]
        return raws, self._combined(raws)

    def score_one(self, x: float) -> float:
        try:
            if not isfinite(x):
                return 0.0
        except TypeError:
            return 0.0
        raws, score = self._scores(x)
        self._last = (self._n, x, raws, score)
        if self.refractory > 0 and self._recent:
            return refractory_gate(self._recent, self._n - self.refractory - 1, score)
        return score

    def learn_one(self, x: float) -> None:
        try:
            if not isfinite(x):
                return
        except TypeError:
            return
        raws, score = self._scores(x)
        self._last = None
        n = self._n
        if self.refractory > 0:
            refractory_push(self._recent, n - self.refractory, n, score)
        if n >= self.warmup:
            decay = self.decay
            self._records = [r if r > m * decay else m * decay
                             for m, r in zip(self._records, raws, strict=True)]
        for d in self.detectors:
            d.learn_one(x)
        self._n = n + 1
