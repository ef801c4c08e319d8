"""Half-Space Trees, lean: river's algorithm and trees, scored by table look-up."""

from __future__ import annotations

import math
import random
from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from math import isfinite
from typing import Any

import numpy as np

from detectors._stats import check_layout
from detectors.base import Detector

__all__ = ["HalfSpaceTrees"]

try:  # the tree walk compiled (built with detectors/_bestc.c); else the Python loop below
    from detectors._bestc import hst_leaves as _hst_leaves
except ImportError:
    _hst_leaves = None

_PADDING = 0.15  # river's make_padded_tree: splits avoid the outer 15 % of a node's range
_LAYOUT = 1  # version of the pickled state


def _grow(features: list[str], height: int, rng: random.Random) -> tuple[list[int], list[float]]:
    """One tree as river builds it, in heap order: split feature index and threshold.

    The same random draws in the same order as ``river.tree.padded.make_padded_tree``
    (feature by ``rng.choices`` weighted by the width of its current range, threshold
    uniform in the padded range, left subtree first), so a seed gives river's trees.
    """
    feat = [0] * (2 ** height - 1)
    thr = [0.0] * (2 ** height - 1)
    index = {f: i for i, f in enumerate(features)}
    limits = {f: (0.0, 1.0) for f in features}

    def grow(node: int, h: int) -> None:
        if h == 0:
            return
        on = rng.choices(population=list(limits), weights=[b - a for a, b in limits.values()])[0]
        a, b = limits[on]
        at = rng.uniform(a + _PADDING * (b - a), b - _PADDING * (b - a))
        feat[node], thr[node] = index[on], at
        limits[on] = (a, at)
        grow(2 * node + 1, h - 1)
        limits[on] = (at, b)
        grow(2 * node + 2, h - 1)
        limits[on] = (a, b)

    grow(0, height)
    return feat, thr


class HalfSpaceTrees(Detector):
    """Half-Space Trees (Tan, Ting & Liu 2011) over a joint vector of signals, O(1) per value.

    ``learn_one`` / ``score_one`` take a ``dict`` of signal values (a combination that is
    unusual only jointly can score though each signal alone is in its band) or a plain
    float (``{"x": x}``). The features are those of the first vector learned; a vector
    that lacks one of them, or has a non-finite value, scores 0.0 and is not learned.
    Values are min-max scaled online, as river's ``MinMaxScaler | HalfSpaceTrees``
    pipeline does, and with the same ``seed`` the trees and the scores are river's
    (``detectors.river_models.RiverHalfSpaceTrees``; tests/test_detector_contract.py compares
    them).
    The score is in [0, 1], 0.0 until ``window_size`` vectors are learned.

    Why it is cheap: river walks every tree node by node, twice per value (scoring and
    learning), and moves every node's mass at the end of each window. Here a leaf's
    score depends only on the previous window's masses, so it is computed once per
    window (numpy, over all leaves at once) into a table; a vector only has to find its
    leaf in each tree and count it. With one signal the trees split one axis, so the
    leaves of all trees are the cells between all their thresholds: one ``bisect`` finds
    the cell, whose score is already summed over the trees. With several signals each
    tree is walked (``height`` comparisons per tree).

    >>> d = HalfSpaceTrees(n_trees=5, height=6, window_size=20, seed=1)
    >>> for i in range(200):
    ...     d.learn_one({"a": float(i % 10), "b": float(i % 10)})
    >>> d.score_one({"a": 2.0, "b": 2.0}) < d.score_one({"a": 9.0, "b": 0.0})
    True
    """

    def __init__(self, n_trees: int = 10, height: int = 8, window_size: int = 250,
                 seed: int | None = 42) -> None:
        if n_trees < 1 or height < 1 or window_size < 1:
            raise ValueError(f"n_trees, height and window_size must be >= 1, got "
                             f"{n_trees}, {height}, {window_size}")
        self.n_trees = n_trees
        self.height = height
        self.window_size = window_size
        self.seed = seed
        self._layout = _LAYOUT
        self._features: tuple[str, ...] | None = None  # fixed by the first vector learned
        self._lo: list[float] = []  # running min / max per feature (the scaler)
        self._hi: list[float] = []
        self._feat: list[list[int]] = []  # per tree, internal nodes in heap order
        self._thr: list[list[float]] = []
        # Vectors learned in the current window per unit: cell (one feature) or tree leaf.
        self._counts = array("q")
        self._score = array("q")  # per unit: sum over the trees of mass * 2**depth on its path
        self._n = 0
        # Derived from the above, not state (rebuilt after unpickling): the cuts between
        # cells (one feature), each unit's score, and the node tables of _index().
        self._cuts: list[float] = []  # empty: not built (or several features)
        self._unit_score: Sequence[Any] = []  # empty: not built
        self._index: tuple[Any, Any, Any, Any, Any] | None = None
        # (input, cell) or (values, leaves) of the last score_one, so that learn_one of the
        # same input right after does not search again when the scaling did not move.
        self._last: tuple[Any, Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cuts"], state["_unit_score"] = [], []
        state["_index"] = state["_last"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        check_layout(state, _LAYOUT, "HalfSpaceTrees")
        self.__dict__.update(state)

    def _plant(self, features: tuple[str, ...]) -> None:
        """Grow the trees for these features (river's draws, see :func:`_grow`)."""
        rng = random.Random(self.seed)
        self._features = features
        self._feat, self._thr = [], []
        for _ in range(self.n_trees):
            feat, thr = _grow(list(features), self.height, rng)
            self._feat.append(feat)
            self._thr.append(thr)
        self._lo = [math.inf] * len(features)
        self._hi = [-math.inf] * len(features)
        self._score = array("q", bytes(8 * self._n_units()))
        self._counts = array("q", bytes(8 * self._n_units()))
        self._build()

    def _n_units(self) -> int:
        """Cells (one feature: the intervals between all thresholds) or leaves of all trees."""
        if self._features is not None and len(self._features) == 1:
            return self.n_trees * ((1 << self.height) - 1) + 1
        return self.n_trees << self.height

    def _build(self) -> None:
        """The derived tables: node ranges in units, parents, 2**depth; cuts and scores.

        A node covers a run of units: of leaves (heap order, tree after tree), or with one
        feature of cells. Cell c holds the values with c thresholds (of all trees) <= them;
        in a tree that splits one axis, a node holds the values between two of its
        thresholds, so it is a run of cells too, and each cell lies in one leaf per tree.
        """
        n_trees, height = self.n_trees, self.height
        n_nodes = (2 << height) - 1
        node = np.arange(n_nodes)
        depth = np.array([(i + 1).bit_length() - 1 for i in range(n_nodes)], dtype=np.int64)
        first = ((node + 1) << (height - depth)) - 1 - ((1 << height) - 1)  # first leaf
        last = first + (1 << (height - depth))  # one past the last leaf
        if len(self._features or ()) == 1:
            thresholds = [np.sort(np.asarray(t)) for t in self._thr]
            cuts = np.sort(np.concatenate(thresholds))
            self._cuts = cuts.tolist()
            # leaf p of a tree starts at the cell after its p-th smallest threshold
            bounds = [np.concatenate(([0], np.searchsorted(cuts, t) + 1, [len(cuts) + 1]))
                      for t in thresholds]
            start = np.concatenate([b[first] for b in bounds])
            end = np.concatenate([b[last] for b in bounds])
        else:
            self._cuts = []
            leaves = 1 << height
            start = np.concatenate([first + i * leaves for i in range(n_trees)])
            end = np.concatenate([last + i * leaves for i in range(n_trees)])
        parent = np.concatenate([np.maximum((node - 1) >> 1, 0) + i * n_nodes
                                 for i in range(n_trees)])
        roots = np.arange(n_trees) * n_nodes
        self._index = (start, end, parent, np.tile(np.int64(1) << depth, n_trees), roots)
        self._unit_score = self._scores_of(np.frombuffer(self._score, dtype=np.int64))

    def _scores_of(self, score: Any) -> Sequence[Any]:
        """One feature: each cell's final score; else the leaves' integer path sums."""
        if self._cuts:  # an array, not a list: no float object per cell (~60 us a window)
            return array("d", (1.0 - score / self._max_score()).tobytes())
        values: list[int] = score.tolist()
        return values

    def _max_score(self) -> int:
        return self.n_trees * self.window_size * ((2 << self.height) - 1)

    def _pivot(self) -> None:
        """End of a window: its masses become the reference (river's ``r_mass``).

        river's score walk adds ``mass * 2**depth`` per node and stops after the first
        node whose mass is below ``0.1 * window_size``. Masses only shrink down a path, so
        a node is on the walk iff its parent's mass is not below the limit; each node on
        a walk adds its term to every unit it covers (a difference array, then a sum).
        """
        if self._index is None:
            self._build()
        assert self._index is not None
        start, end, parent, weight, roots = self._index
        cum = np.concatenate(([0], np.cumsum(np.frombuffer(self._counts, dtype=np.int64))))
        mass = cum[end] - cum[start]
        walked = mass[parent] >= 0.1 * self.window_size
        walked[roots] = True
        term = np.where(walked, mass * weight, 0).astype(np.float64)  # < 2**53: exact
        n = len(self._counts)
        diff = np.bincount(start, term, n + 1) - np.bincount(end, term, n + 1)
        score = np.cumsum(diff[:n]).astype(np.int64)
        self._score = array("q", score.tobytes())
        self._unit_score = self._scores_of(score)
        self._counts = array("q", bytes(8 * n))

    # -- the contract --------------------------------------------------------------------

    def _vector(self, x: Mapping[str, float]) -> list[float] | None:
        """A dict's values in feature order, or None (a missing feature, a non-finite value)."""
        features = self._features
        try:
            values = [x[f] for f in (features if features is not None else sorted(x))]
            total = sum(values)  # finite unless a value is not (or the sum overflows)
            ok = bool(values) and (isfinite(total) or all(isfinite(v) for v in values))
        except (KeyError, TypeError):
            return None
        return values if ok else None

    def score_one(self, x: float | Mapping[str, float]) -> float:
        if self._n < self.window_size:
            return 0.0
        if isinstance(x, (float, int)):
            if self._features != ("x",):
                return 0.0
            try:
                if not isfinite(x):
                    return 0.0
            except TypeError:
                return 0.0
        elif isinstance(x, (dict, Mapping)):
            values = self._vector(x)
            if values is None:
                return 0.0
            if len(values) > 1:
                if not self._unit_score:
                    self._build()
                score = self._unit_score
                leaves = self._leaves(self._scaled(values))
                self._last = (values, leaves)
                total = 0
                for leaf in leaves:
                    total += score[leaf]
                return 1.0 - total / self._max_score()
            x = values[0]
        else:
            return 0.0
        if not self._unit_score:
            self._build()
        low = self._lo[0]
        d = self._hi[0] - low
        cell = bisect_right(self._cuts, (x - low) / d if d else 0.0)
        self._last = (x, cell)
        return self._unit_score[cell]  # type: ignore[no-any-return]

    def learn_one(self, x: float | Mapping[str, float]) -> None:
        if isinstance(x, (float, int)):
            if self._features != ("x",) and self._features is not None:
                return
            try:
                if not isfinite(x):
                    return
            except TypeError:
                return
            if self._features is None:
                self._plant(("x",))
            elif not self._unit_score:
                self._build()
            lo, hi = self._lo, self._hi  # the scaler learns first, as in river's pipeline
            low, high = lo[0], hi[0]
            last = self._last
            if low <= x <= high and last is not None and last[0] is x:
                cell = last[1]  # scored just before, with the same scaling
            else:
                if x < low:
                    lo[0] = low = x
                if x > high:
                    hi[0] = high = x
                d = high - low
                cell = bisect_right(self._cuts, (x - low) / d if d else 0.0)
            self._counts[cell] += 1
        elif isinstance(x, (dict, Mapping)):
            values = self._vector(x)
            if values is None:
                return
            if self._features is None:
                self._plant(tuple(sorted(x)))
            lo, hi = self._lo, self._hi
            moved = False
            for i, v in enumerate(values):
                if v < lo[i]:
                    lo[i] = v
                    moved = True
                if v > hi[i]:
                    hi[i] = v
                    moved = True
            if len(values) == 1:
                if not self._unit_score:
                    self._build()
                v = values[0]
                d = hi[0] - lo[0]
                self._counts[bisect_right(self._cuts, (v - lo[0]) / d if d else 0.0)] += 1
            else:
                last = self._last
                if last is not None and not moved and last[0] == values:
                    leaves = last[1]  # scored just before, with the same scaling
                else:
                    leaves = self._leaves(self._scaled(values))
                counts = self._counts
                for leaf in leaves:
                    counts[leaf] += 1
        else:
            return
        self._last = None
        self._n += 1
        if self._n % self.window_size == 0:
            self._pivot()

    def _scaled(self, values: list[float]) -> list[float]:
        return [(v - a) / (b - a) if b - a else 0.0
                for v, a, b in zip(values, self._lo, self._hi, strict=True)]

    def _leaves(self, scaled: list[float]) -> list[int]:
        """The flat leaf index of ``scaled`` in every tree (a walk of ``height`` splits)."""
        height = self.height
        if _hst_leaves is not None:
            return _hst_leaves(scaled, self._feat, self._thr, height)  # type: ignore[no-any-return]
        return self._leaves_py(scaled)

    def _leaves_py(self, scaled: list[float]) -> list[int]:
        """:meth:`_leaves` in Python (used when the C module is not built)."""
        height = self.height
        first_leaf = (1 << height) - 1
        out = []
        base = -first_leaf
        for feat, thr in zip(self._feat, self._thr, strict=True):
            i = 0
            for _ in range(height):
                i = 2 * i + 1 if scaled[feat[i]] < thr[i] else 2 * i + 2
            out.append(base + i)
            base += first_leaf + 1
        return out
