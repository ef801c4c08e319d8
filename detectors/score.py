"""Score a whole series (NAB-style) and the ``trainsentry score`` command.

:data:`DETECTORS` names every configuration the benchmark knows; ``"best"`` is the
single-signal configuration we recommend (see docs/detectors.md for its NAB scores).
Each configuration is wrapped so that its score lies in [0, 1]: the raw score ``s`` of
a single detector maps to ``s / (1 + s)`` (0.5 at the detector's own alarm level), the
:class:`~detectors.combiner.Combiner` is already calibrated.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TextIO

from detectors.adaptive import AdaptiveThreshold
from detectors.base import Detector
from detectors.changepoint import CUSUM, PageHinkley
from detectors.combiner import Combiner
from detectors.ewma import EWMA
from detectors.robust import RobustZScore
from detectors.slope import Slope
from detectors.variance import VarianceChange
from trainsentry.errors import TrainsentryError

__all__ = ["DETECTORS", "ScoreError", "add_cli", "best", "read_nab_csv", "score_series"]


class ScoreError(TrainsentryError):
    """A series file or a detector name given to ``trainsentry score`` is not usable."""


def best() -> Combiner:
    """The recommended single-signal detector (the one tuned on NAB).

    Five views of one signal, calibrated by their own records, max'ed, one alarm per event:
    a spike band around a slow EWMA level, a level-shift band on the short-term mean, a
    variance change (flat lines and bursts), sudden jumps between consecutive values, and
    a median/MAD band that spikes cannot stretch (tuned on NAB, see docs/detectors.md).
    """
    slow = 0.0003  # long memory: the band is the signal's normal range over days of data
    return Combiner(
        [
            EWMA(alpha=slow),
            EWMA(alpha=slow, smooth=12),
            VarianceChange(short=12, alpha=slow),
            EWMA(alpha=slow, diff=True),
            RobustZScore(window=2000, min_samples=100),
        ],
        decay=0.9999,
        warmup=150,
        refractory=100,
    )


def _single(factory: Callable[[], Detector]) -> Callable[[], Detector]:
    """A single detector, calibrated by the combiner like ``best`` (comparable scores)."""
    return lambda: Combiner([factory()], decay=0.9997, warmup=150, refractory=100)


DETECTORS: dict[str, Callable[[], Detector]] = {
    "best": best,
    "adaptive": _single(lambda: AdaptiveThreshold(window=100, k=3.0, nonnegative=False)),
    "robust": _single(lambda: RobustZScore(window=2000, min_samples=100)),
    "ewma": _single(lambda: EWMA(alpha=0.0003)),
    "holt": _single(lambda: EWMA(alpha=0.01, beta=0.01)),
    "level_shift": _single(lambda: EWMA(alpha=0.0003, smooth=12)),
    "jump": _single(lambda: EWMA(alpha=0.0003, diff=True)),
    "variance": _single(lambda: VarianceChange(short=12, alpha=0.0003)),
    "cusum": _single(lambda: CUSUM(alpha=0.001)),
    "page_hinkley": _single(lambda: PageHinkley()),
    "slope": _single(lambda: Slope(window=50)),
    "half_space_trees": _single(lambda: _hst()),
}


def _hst() -> Detector:
    from detectors.river_models import HalfSpaceTrees

    return HalfSpaceTrees()


def _to_unit(score: float) -> float:
    """Raw scores of plain detectors are >= 0 and unbounded; the combiner's are in [0, 1)."""
    if not math.isfinite(score):
        return 1.0
    return min(1.0, max(0.0, score))


def score_series(values: Iterable[float], *, detector: str = "best") -> list[float]:
    """A score in [0, 1] for each value, each scored before it is learned (past rows only).

    >>> scores = score_series([float(i % 7) for i in range(300)] + [50.0])
    >>> len(scores), scores[-1] > 0.5
    (301, True)
    """
    try:
        model = DETECTORS[detector]()
    except KeyError:
        raise ScoreError(f"unknown detector {detector!r}; valid names: "
                         f"{', '.join(sorted(DETECTORS))}") from None
    out = []
    for x in values:
        out.append(_to_unit(model.score_one(x)))
        model.learn_one(x)
    return out


def read_nab_csv(path: str | Path) -> tuple[list[str], list[float]]:
    """``(timestamps, values)`` of a ``timestamp,value`` CSV with a header row (NAB format)."""
    path = Path(path)
    try:
        with path.open(newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None or [h.strip().lower() for h in header[:2]] != ["timestamp", "value"]:
                raise ScoreError(f"{path}: expected a 'timestamp,value' header, got {header}")
            timestamps, values = [], []
            for lineno, row in enumerate(reader, start=2):
                if not row:
                    continue
                if len(row) < 2:
                    raise ScoreError(f"{path}:{lineno}: expected 'timestamp,value', got {row}")
                try:
                    values.append(float(row[1]))
                except ValueError:
                    raise ScoreError(f"{path}:{lineno}: value {row[1]!r} is not a number") from None
                timestamps.append(row[0])
    except OSError as exc:
        raise ScoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ScoreError(f"{path}: not a CSV text file ({exc})") from exc
    return timestamps, values


def run_score(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Handler of ``trainsentry score``: CSV in, ``timestamp,value,anomaly_score`` out.

    Returns the exit status (0, or 2 for a bad file or detector name, reported on ``err``).
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    try:
        if args.detector not in DETECTORS:
            raise ScoreError(f"unknown detector {args.detector!r}; valid names: "
                             f"{', '.join(sorted(DETECTORS))}")
        timestamps, values = read_nab_csv(args.file)
        scores = score_series(values, detector=args.detector)
    except ScoreError as exc:
        err.write(f"trainsentry score: error: {exc}\n")
        return 2
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["timestamp", "value", "anomaly_score"])
    for ts, value, score in zip(timestamps, values, scores, strict=True):
        writer.writerow([ts, repr(value) if not value.is_integer() else int(value)
                         if abs(value) < 2**53 else repr(value), f"{score:.6f}"])
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``score FILE.csv [--detector NAME]`` to an argparse ``subparsers`` object.

    The parser's ``func`` default is :func:`run_score` (trainsentry/cli.py calls
    ``args.func(args)`` and exits with its return value).
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "score",
        help="score a timestamp,value CSV; write timestamp,value,anomaly_score to stdout",
        description="Score every row of a 'timestamp,value' CSV (NAB format) with an online "
                    "detector that sees only past rows, and write "
                    "'timestamp,value,anomaly_score' (score in [0, 1]) to stdout.",
    )
    parser.add_argument("file", metavar="FILE.csv", help="CSV with a 'timestamp,value' header")
    parser.add_argument("--detector", default="best", metavar="NAME",
                        help=f"detector configuration (default: best); one of: "
                             f"{', '.join(sorted(DETECTORS))}")
    parser.set_defaults(func=run_score)
    return parser
