"""river's multivariate models, behind our contract (river is imported lazily)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from detectors.base import Detector

__all__ = ["RiverHalfSpaceTrees"]


class RiverHalfSpaceTrees(Detector):
    """river's Half-Space Trees over a joint vector of signals, behind our contract.

    The reference for :class:`detectors.halfspace.HalfSpaceTrees`, which grows the same
    trees and gives the same scores at a fraction of the cost; kept for comparison
    (tests, ``bench/detectors.py``) and for detector states pickled before that existed.

    Unlike the other detectors, ``learn_one`` / ``score_one`` take a ``dict`` of signal
    values (``{"rollout/latency_ms": 812.0, "gpu/utilization_pct": 23.0}``) so a
    combination that is unusual only jointly (latency up while GPU utilisation is down)
    can score, though each signal alone is in its band. A plain float is accepted too and
    treated as ``{"x": x}``. Features are min-max scaled online
    (``river.preprocessing.MinMaxScaler``), as Half-Space Trees expect values in [0, 1].

    The score is river's (in [0, 1], higher is more anomalous), 0.0 until ``window_size``
    values are learned (the trees score from a reference window) and for any input with a
    non-finite value, which is also not learned. Trees have a fixed size: O(1) per value.

    >>> d = RiverHalfSpaceTrees(n_trees=5, height=6, window_size=20, seed=1)
    >>> for i in range(200):
    ...     d.learn_one({"a": float(i % 10), "b": float(i % 10)})
    >>> d.score_one({"a": 2.0, "b": 2.0}) < d.score_one({"a": 9.0, "b": 0.0})
    True
    """

    def __init__(self, n_trees: int = 10, height: int = 8, window_size: int = 250,
                 seed: int | None = 42) -> None:
        self.n_trees = n_trees
        self.height = height
        self.window_size = window_size
        self.seed = seed
        self._model: Any = None  # built lazily: river is an optional dependency
        self._n = 0

    def _build(self) -> Any:
        from river import anomaly, preprocessing

        return preprocessing.MinMaxScaler() | anomaly.HalfSpaceTrees(
            n_trees=self.n_trees, height=self.height, window_size=self.window_size,
            seed=self.seed)

    @staticmethod
    def _features(x: float | Mapping[str, float]) -> dict[str, float] | None:
        feats = dict(x) if isinstance(x, Mapping) else {"x": x}
        try:
            ok = all(math.isfinite(v) for v in feats.values())
        except TypeError:
            ok = False
        return feats if ok and feats else None

    def score_one(self, x: float | Mapping[str, float]) -> float:
        feats = self._features(x)
        if feats is None or self._model is None or self._n < self.window_size:
            return 0.0
        return float(self._model.score_one(feats))

    def learn_one(self, x: float | Mapping[str, float]) -> None:
        feats = self._features(x)
        if feats is None:
            return
        if self._model is None:
            self._model = self._build()
        self._model.learn_one(feats)
        self._n += 1


#: States pickled before the lean :class:`detectors.halfspace.HalfSpaceTrees` existed name
#: this class under its old name; they load (and keep working) through this alias.
HalfSpaceTrees = RiverHalfSpaceTrees
