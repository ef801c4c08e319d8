"""Online anomaly detectors with one contract (``learn_one`` / ``score_one``), and the engine.

See docs/detectors.md. Every detector is O(1) per value, pickles, and never mutates
itself in ``score_one``.
"""

from __future__ import annotations

from detectors.adaptive import AdaptiveThreshold
from detectors.base import Detector
from detectors.best import Best
from detectors.changepoint import CUSUM, PageHinkley
from detectors.combiner import Combiner
from detectors.ewma import EWMA
from detectors.halfspace import HalfSpaceTrees
from detectors.nonfinite import NonFinite
from detectors.robust import RobustZScore
from detectors.seasonal import Seasonal
from detectors.slope import Slope
from detectors.variance import VarianceChange

__all__ = [
    "Detector",
    "AdaptiveThreshold",
    "Best",
    "CUSUM",
    "Combiner",
    "EWMA",
    "HalfSpaceTrees",
    "NonFinite",
    "PageHinkley",
    "RobustZScore",
    "Seasonal",
    "Slope",
    "VarianceChange",
]
