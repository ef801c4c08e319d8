"""Per-value cost of every detector against the operators' numpy rolling window.

Run ``python -m bench.detectors``. The reference is what operators' scripts do today:
keep the last W=100 values and recompute ``np.mean`` / ``np.std`` over them for every
new value. Each detector's cost is one ``score_one`` plus one ``learn_one`` per value
(best of ``--repeat`` runs over the same seeded noisy series with spikes). The table
ends with the ratio reference / detector: the target is >= 10x for every single
detector; the ``best`` combiner runs seven of them (each scored once per value: its
``learn_one`` reuses the sub-scores of ``score_one``), its components are listed after
the table.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from detectors import (
    CUSUM,
    EWMA,
    AdaptiveThreshold,
    Detector,
    HalfSpaceTrees,
    NonFinite,
    PageHinkley,
    RobustZScore,
    Seasonal,
    Slope,
    VarianceChange,
)
from detectors.score import best

__all__ = ["CASES", "numpy_window_cost", "detector_cost", "main"]

CASES: dict[str, Callable[[], Detector]] = {
    "AdaptiveThreshold(100)": lambda: AdaptiveThreshold(window=100),
    "RobustZScore(500)": lambda: RobustZScore(window=500),
    "RobustZScore(1000)": lambda: RobustZScore(window=1000),
    "EWMA": lambda: EWMA(alpha=0.01),
    "EWMA Holt": lambda: EWMA(alpha=0.01, beta=0.01),
    "EWMA smooth=12": lambda: EWMA(alpha=0.01, smooth=12),
    "EWMA diff": lambda: EWMA(alpha=0.01, diff=True),
    "VarianceChange": lambda: VarianceChange(),
    "CUSUM": lambda: CUSUM(),
    "PageHinkley": lambda: PageHinkley(),
    "Slope(50)": lambda: Slope(window=50),
    "Seasonal(288)": lambda: Seasonal(period=288),
    "Seasonal(288, smooth=48)": lambda: Seasonal(period=288, smooth=48),
    "NonFinite": lambda: NonFinite(),
    "HalfSpaceTrees (river)": lambda: HalfSpaceTrees(),
    "best (Combiner of 7)": best,
}


def series(n: int, seed: int = 0) -> list[float]:
    """A noisy level with occasional spikes (so spike paths are exercised too)."""
    rng = random.Random(seed)
    return [100.0 + rng.gauss(0, 5) + (80.0 if rng.random() < 0.01 else 0.0) for _ in range(n)]


def numpy_window_cost(values: Sequence[float], window: int = 100) -> float:
    """Seconds per value of the rolling window recomputed with numpy at every value."""
    recent: deque[float] = deque(maxlen=window)
    start = time.perf_counter()
    for x in values:
        if len(recent) >= window // 2:
            arr = np.asarray(recent)
            mean, std = np.mean(arr), np.std(arr)
            _ = abs(x - mean) > 3.0 * std
        recent.append(x)
    return (time.perf_counter() - start) / len(values)


def detector_cost(factory: Callable[[], Detector], values: Sequence[float]) -> float:
    """Seconds per value of ``score_one`` + ``learn_one``."""
    det = factory()
    score, learn = det.score_one, det.learn_one
    start = time.perf_counter()
    for x in values:
        score(x)
        learn(x)
    return (time.perf_counter() - start) / len(values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("-n", type=int, default=20_000, help="values per run")
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    args = parser.parse_args(argv)
    values = series(args.n)
    ref = min(numpy_window_cost(values) for _ in range(args.repeat))
    rows = []
    for name, factory in CASES.items():
        n = args.n if "HalfSpaceTrees" not in name else min(args.n, 5000)  # river is slow
        cost = min(detector_cost(factory, values[:n]) for _ in range(args.repeat))
        rows.append((name, cost, ref / cost))
    out = sys.stdout
    out.write(f"\nreference: numpy rolling window W=100, {ref * 1e6:.2f} us per value\n\n")
    out.write("| detector | us per value | cheaper than numpy window |\n|---|---|---|\n")
    for name, cost, ratio in rows:
        out.write(f"| {name} | {cost * 1e6:.2f} | {ratio:.1f}x |\n")
    out.write("\n`best` by component (each sub-detector alone; the rest is the combiner's own "
              "calibration and refractory logic):\n\n| component | us per value | cheaper than numpy window |\n|---|---|---|\n")
    total = 0.0
    for det in best().detectors:
        cost = min(detector_cost(det.clone, values) for _ in range(args.repeat))
        total += cost
        out.write(f"| {det!r} | {cost * 1e6:.2f} | {ref / cost:.1f}x |\n")
    out.write(f"| sum of components | {total * 1e6:.2f} | {ref / total:.1f}x |\n")
    single = [r for r in rows if not r[0].startswith(("best", "HalfSpaceTrees"))]
    worst = min(single, key=lambda r: r[2])
    out.write(f"\nsingle detectors: all >= {worst[2]:.1f}x cheaper (slowest: {worst[0]}); "
              f"target 10x: {'met' if worst[2] >= 10 else 'NOT met'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
