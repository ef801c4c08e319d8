"""SignalMonitor: one signal's detector(s) plus the policy that turns scores into findings."""

from __future__ import annotations

import math
from dataclasses import dataclass

from detectors.adaptive import AdaptiveThreshold
from detectors.catalog import SignalPolicy

__all__ = ["Finding", "SignalMonitor"]


@dataclass(frozen=True, slots=True)
class Finding:
    """A value outside its healthy band in the bad direction, with the evidence."""

    key: str
    value: float
    baseline: float
    bound: float
    score: float
    direction: str  # "up" or "down"

    def evidence(self) -> dict[str, float | str]:
        return {"value": _round(self.value), "baseline": _round(self.baseline),
                "bound": _round(self.bound)}


def _round(x: float) -> float | str:
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return float(f"{x:.6g}")


class SignalMonitor:
    """Scores each value against the learned band, then learns it.

    Values judged anomalous are not learned for up to ``window // 4`` steps in a row, so a
    sustained fault does not widen its own band within a few steps; a real level shift
    that lasts longer than that is accepted as the new normal.
    """

    def __init__(self, key: str, policy: SignalPolicy) -> None:
        self.key = key
        self.policy = policy
        self._band = AdaptiveThreshold(window=policy.window, k=policy.k,
                                       nonnegative=policy.nonnegative)
        self._frozen = 0
        self._seen = 0

    @property
    def seen(self) -> int:
        return self._seen

    def baseline(self) -> tuple[float, float, float] | None:
        """(mean, lower, upper) once warm, else None."""
        if self._seen < self.policy.effective_warmup() or not self._band.n:
            return None
        lower, upper = self._band.bounds()
        return self._band.mean(), lower, upper

    def observe(self, x: float) -> Finding | None:
        """Judge ``x`` against what was learned before it, then learn it."""
        if not math.isfinite(x):
            return None
        finding = self._judge(x)
        if finding is None or self._frozen >= max(1, self.policy.window // 4):
            self._band.learn_one(x)
            self._frozen = 0
        else:
            self._frozen += 1
        self._seen += 1
        return finding

    def _judge(self, x: float) -> Finding | None:
        p = self.policy
        if self._seen < p.effective_warmup() or self._band.n < 2:
            return None
        mean = self._band.mean()
        lower, upper = self._band.bounds()
        if x > upper and p.direction in ("up", "both"):
            direction, bound = "up", upper
        elif x < lower and p.direction in ("down", "both"):
            direction, bound = "down", lower
        else:
            return None
        effect = abs(x - mean)
        if effect <= p.min_abs_effect or effect <= p.min_rel_effect * abs(mean):
            return None
        return Finding(self.key, x, mean, bound, self._band.score_one(x), direction)
