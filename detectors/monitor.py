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
        self._warmup = policy.effective_warmup()
        self._max_frozen = max(1, policy.window // 4)
        self._last: tuple[float, float, float] | None = None

    @property
    def seen(self) -> int:
        return self._seen

    def baseline(self) -> tuple[float, float, float] | None:
        """(mean, lower, upper) of the band the latest value was judged against; None while warming up."""
        return self._last

    def observe(self, x: float) -> Finding | None:
        """Judge ``x`` against what was learned before it, then learn it."""
        if not math.isfinite(x):
            return None
        band = self._band
        warm = self._seen >= self._warmup and band.n >= 2
        self._last = band.band() if warm else None
        finding = self._judge(x, self._last) if warm else None
        if finding is None or self._frozen >= self._max_frozen:
            band.learn_one(x)
            self._frozen = 0
        else:
            self._frozen += 1
        self._seen += 1
        return finding

    def _judge(self, x: float, stats: tuple[float, float, float] | None) -> Finding | None:
        if stats is None:
            return None
        mean, lower, upper = stats
        p = self.policy
        if x > upper and p.direction != "down":
            direction, bound = "up", upper
        elif x < lower and p.direction != "up":
            direction, bound = "down", lower
        else:
            return None
        effect = abs(x - mean)
        if effect <= p.min_abs_effect or effect <= p.min_rel_effect * abs(mean):
            return None
        spread = upper - mean
        score = effect / spread if spread > 0 else 1e9
        return Finding(self.key, x, mean, bound, score, direction)
