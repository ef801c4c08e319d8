"""NaN / inf values: the one check that needs no history (a NaN loss is always news)."""

from __future__ import annotations

import math

from detectors.base import Detector

__all__ = ["NonFinite"]


class NonFinite(Detector):
    """Scores 1.0 for NaN or ±inf and 0.0 for any finite value; learns nothing.

    The only detector that scores non-finite input (the others return 0.0 for it), so a
    NaN gradient norm is reported even before any history exists.

    >>> NonFinite().score_one(float("nan")), NonFinite().score_one(1.0)
    (1.0, 0.0)
    """

    def learn_one(self, x: float) -> None:
        return None

    def score_one(self, x: float) -> float:
        return 0.0 if math.isfinite(x) else 1.0
