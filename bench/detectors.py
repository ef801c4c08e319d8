"""Per-value cost of every detector against the operators' numpy rolling window.

Run ``python -m bench.detectors`` (or ``python bench/detectors.py``). The reference is
what operators' scripts do today: keep the last W=100 values and recompute ``np.mean`` /
``np.std`` over them for every new value. Each detector's cost is one ``score_one`` plus
one ``learn_one`` per value over the same seeded noisy series with spikes, measured in
CPU time of this thread by default (``--clock wall`` for wall time): on a shared machine
CPU time is what the detector itself costs. ``--repeat`` rounds time the reference and
every detector in turn, and each keeps its fastest round (other jobs' load only adds
time). The table ends with the ratio reference / detector: the target is >= 10x for
every detector.

``best`` is the fused, compiled :class:`~detectors.best.Best`; the same seven views fused
in Python (:class:`~detectors.best.PyBest`, what ``Best`` is without a C compiler) and as
a generic ``Combiner`` (same scores) are listed for comparison. ``HalfSpaceTrees`` is measured on
one signal per value (as ``trainsentry score --detector half_space_trees`` runs it), and
on a joint vector of ``--signals`` signals: cost per vector, and per vector divided by
the number of signals (the cost per signal value it watches).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # `python bench/detectors.py`: bench/ would shadow `detectors`
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from collections import deque  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from detectors import (  # noqa: E402
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
from detectors.best import COMPILED, Best, PyBest, reference  # noqa: E402
from detectors.river_models import RiverHalfSpaceTrees  # noqa: E402

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
    "HalfSpaceTrees, one signal": lambda: HalfSpaceTrees(),
    "best (Best: 7 views fused, compiled)": lambda: Best(period=288),
}
#: For comparison only (not held to the target): the slow equivalents.
COMPARISON: dict[str, Callable[[], Detector]] = {
    "best fused in Python (PyBest: same scores; Best without a C compiler)":
        lambda: PyBest(period=288),
    "best as a generic Combiner of 7 (same scores)": lambda: reference(288),
    "HalfSpaceTrees, river's (same scores)": lambda: RiverHalfSpaceTrees(),
}
SLOW = {"HalfSpaceTrees, river's (same scores)": 3000}  # values (river is slow)
JOINT = "HalfSpaceTrees, joint vector"


def series(n: int, seed: int = 0) -> list[float]:
    """A noisy level with occasional spikes (so spike paths are exercised too)."""
    rng = random.Random(seed)
    return [100.0 + rng.gauss(0, 5) + (80.0 if rng.random() < 0.01 else 0.0) for _ in range(n)]


def vectors(n: int, signals: int, seed: int = 0) -> list[dict[str, float]]:
    """Joint vectors of ``signals`` noisy signals with occasional spikes."""
    rng = random.Random(seed)
    return [{f"signal_{j}": 10.0 * (j + 1) + rng.gauss(0, 1 + j)
             + (30.0 if rng.random() < 0.01 else 0.0) for j in range(signals)} for _ in range(n)]


def numpy_window_cost(values: Sequence[float], window: int = 100,
                      clock: Callable[[], float] = time.thread_time) -> float:
    """Seconds per value of the rolling window recomputed with numpy at every value."""
    recent: deque[float] = deque(maxlen=window)
    start = clock()
    for x in values:
        if len(recent) >= window // 2:
            arr = np.asarray(recent)
            mean, std = np.mean(arr), np.std(arr)
            _ = abs(x - mean) > 3.0 * std
        recent.append(x)
    return (clock() - start) / len(values)


def detector_cost(factory: Callable[[], Detector], values: Sequence[Any],
                  clock: Callable[[], float] = time.thread_time) -> float:
    """Seconds per value (or per vector) of ``score_one`` + ``learn_one``."""
    det = factory()
    score, learn = det.score_one, det.learn_one
    start = clock()
    for x in values:
        score(x)
        learn(x)
    return (clock() - start) / len(values)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("-n", type=int, default=20_000, help="values per run")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; the best is kept")
    parser.add_argument("--signals", type=int, default=8,
                        help="signals in the joint vector of HalfSpaceTrees")
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: this thread's CPU time (default); wall: perf_counter")
    parser.add_argument("--components", action="store_true",
                        help="also time each of best's seven views alone")
    args = parser.parse_args(argv)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    values = series(args.n)
    joint = vectors(min(args.n, 5000), args.signals)
    timed: dict[str, tuple[Callable[[], Detector], Sequence[Any]]] = {
        **{name: (factory, values) for name, factory in CASES.items()},
        **{name: (factory, values[:SLOW.get(name, args.n)])
           for name, factory in COMPARISON.items()},
        JOINT: (HalfSpaceTrees, joint),
    }
    # Rounds of everything, reference included, interleaved; the minimum of each over the
    # rounds is kept: load from other jobs only ever adds time.
    best_of: dict[str, float] = {}
    ref = float("inf")
    for _ in range(args.repeat):
        ref = min(ref, numpy_window_cost(values, clock=clock))
        for name, (factory, data) in timed.items():
            best_of[name] = min(best_of.get(name, float("inf")),
                                detector_cost(factory, data, clock))
    rows = [(name, best_of[name]) for name in CASES]
    comparison = [(name, best_of[name]) for name in COMPARISON]
    per_vector = best_of[JOINT]

    def cost(factory: Callable[[], Detector], data: Sequence[Any]) -> float:
        return min(detector_cost(factory, data, clock) for _ in range(args.repeat))

    out = sys.stdout
    if not COMPILED:
        out.write("\nNOTE: detectors._bestc is not built (no C compiler at install): `best` and "
                  "the joint-vector HalfSpaceTrees run in Python\n")
    out.write(f"\nreference: numpy rolling window W=100, {ref * 1e6:.2f} us per value "
              f"({args.clock} time)\n\n")
    out.write("| detector | us per value | cheaper than numpy window |\n|---|---|---|\n")
    for name, c in rows:
        out.write(f"| {name} | {c * 1e6:.2f} | {ref / c:.1f}x |\n")
    joint_name = f"HalfSpaceTrees, joint vector of {args.signals}: per signal value"
    per_signal = per_vector / args.signals
    out.write(f"| {joint_name} | {per_signal * 1e6:.2f} | {ref / per_signal:.1f}x |\n")
    out.write("\nfor comparison (not held to the target):\n\n"
              "| detector | us per value | cheaper than numpy window |\n|---|---|---|\n")
    for name, c in comparison:
        out.write(f"| {name} | {c * 1e6:.2f} | {ref / c:.1f}x |\n")
    out.write(f"| HalfSpaceTrees, joint vector of {args.signals}: per vector | "
              f"{per_vector * 1e6:.2f} | {ref / per_vector:.1f}x |\n")
    if args.components:
        out.write("\n`best` by view (each detector alone, as in the generic Combiner):\n\n"
                  "| view | us per value | cheaper than numpy window |\n|---|---|---|\n")
        for det in reference(288).detectors:
            c = cost(det.clone, values)
            out.write(f"| {det!r} | {c * 1e6:.2f} | {ref / c:.1f}x |\n")
    held = rows + [(joint_name, per_signal)]
    worst = max(held, key=lambda r: r[1])
    ratio = ref / worst[1]
    out.write(f"\nevery detector >= {ratio:.1f}x cheaper (slowest: {worst[0]}); "
              f"target 10x: {'met' if ratio >= 10 else 'NOT met'}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
