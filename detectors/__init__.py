"""Online anomaly detectors with one contract (``learn_one`` / ``score_one``), and the engine.

See docs/detectors.md. Every detector is O(1) per value, pickles, and never mutates
itself in ``score_one``.
"""

from __future__ import annotations

from detectors.adaptive import AdaptiveThreshold
from detectors.base import Detector

__all__ = ["Detector", "AdaptiveThreshold"]
