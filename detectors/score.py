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
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from detectors.adaptive import AdaptiveThreshold
from detectors.base import Detector
from detectors.best import Best
from detectors.changepoint import CUSUM, PageHinkley
from detectors.combiner import Combiner
from detectors.ewma import EWMA
from detectors.robust import RobustZScore
from detectors.seasonal import Seasonal
from detectors.slope import Slope
from detectors.variance import VarianceChange
from trainsentry.errors import TrainsentryError

__all__ = ["DETECTORS", "ScoreError", "add_cli", "best", "read_nab_csv", "score_series",
           "values_per_day"]


class ScoreError(TrainsentryError):
    """A series file or a detector name given to ``trainsentry score`` is not usable."""


DEFAULT_PERIOD = 288  # values per day at one value every 5 minutes
PERIOD_ROWS = 21  # rows whose timestamps give the period (all inside the 150-row warm-up)


def best(period: int = DEFAULT_PERIOD) -> Best:
    """The recommended single-signal detector (the one tuned on NAB).

    Seven views of one signal, calibrated by their own records, weighted, max'ed, one
    alarm per event: a spike band around a slow EWMA level, a level-shift band on a
    48-value mean, a variance change (flat lines and bursts), a median/MAD band that
    spikes cannot stretch, a CUSUM (sustained small shifts), and the difference to the
    value one ``period`` earlier (raw and 48-value mean: a changed daily pattern).
    ``period`` is the number of values per day (see :func:`values_per_day`). Weights
    were tuned on the NAB subset (docs/detectors.md). It is :class:`~detectors.best.Best`,
    the fused form of :func:`detectors.best.reference` (the same ``Combiner`` of the
    library's detectors, same scores, ~2.5x the cost).
    """
    return Best(period=period)


def best_previous(period: int = DEFAULT_PERIOD) -> Combiner:
    """The first ``best`` (five views, no daily pattern), kept for comparison."""
    slow = 0.0003
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


Factory = Callable[..., Detector]


def _single(factory: Callable[[int], Detector]) -> Factory:
    """A single detector, calibrated by the combiner like ``best`` (comparable scores)."""
    def make(period: int = DEFAULT_PERIOD) -> Detector:
        return Combiner([factory(period)], decay=0.9997, warmup=150, refractory=100)
    return make


DETECTORS: dict[str, Factory] = {
    "best": best,
    "best_previous": best_previous,
    "adaptive": _single(lambda p: AdaptiveThreshold(window=100, k=3.0, nonnegative=False)),
    "robust": _single(lambda p: RobustZScore(window=2000, min_samples=100)),
    "ewma": _single(lambda p: EWMA(alpha=0.0003)),
    "holt": _single(lambda p: EWMA(alpha=0.01, beta=0.01)),
    "level_shift": _single(lambda p: EWMA(alpha=0.0003, smooth=12)),
    "jump": _single(lambda p: EWMA(alpha=0.0003, diff=True)),
    "variance": _single(lambda p: VarianceChange(short=12, alpha=0.0003)),
    "cusum": _single(lambda p: CUSUM(alpha=0.001)),
    "page_hinkley": _single(lambda p: PageHinkley()),
    "slope": _single(lambda p: Slope(window=50)),
    "seasonal": _single(lambda p: Seasonal(period=p, alpha=0.0003)),
    "half_space_trees": _single(lambda p: _hst()),
}
"""Every configuration by name; each factory takes ``period`` (values per day)."""


def _hst() -> Detector:
    from detectors.halfspace import HalfSpaceTrees

    return HalfSpaceTrees()


def values_per_day(timestamps: Sequence[str]) -> int | None:
    """``round(86400 / median interval)`` of ISO timestamps, or None if that is unknowable.

    >>> values_per_day(["2024-01-01 00:00:00", "2024-01-01 00:05:00", "2024-01-01 00:10:00"])
    288
    """
    try:
        secs = [datetime.fromisoformat(t.strip()).timestamp() for t in timestamps]
    except (ValueError, AttributeError, TypeError):
        return None
    gaps = sorted(b - a for a, b in zip(secs, secs[1:], strict=False))
    if not gaps:
        return None
    mid = len(gaps) // 2
    median = gaps[mid] if len(gaps) % 2 else 0.5 * (gaps[mid - 1] + gaps[mid])
    return max(2, round(86400 / median)) if median > 0 else None


def _to_unit(score: float) -> float:
    """Raw scores of plain detectors are >= 0 and unbounded; the combiner's are in [0, 1)."""
    if not math.isfinite(score):
        return 1.0
    return min(1.0, max(0.0, score))


def score_series(values: Iterable[float], *, detector: str = "best",
                 timestamps: Sequence[str] | None = None) -> list[float]:
    """A score in [0, 1] for each value, each scored before it is learned (past rows only).

    With ``timestamps``, the daily period (values per day) is estimated from the first
    :data:`PERIOD_ROWS` rows and the detector is built then: those rows are scored 0 (every
    configuration warms up for 150 rows anyway) and replayed into it, so no score
    depends on a later row. Without, the period is :data:`DEFAULT_PERIOD`.

    >>> scores = score_series([float(i % 7) for i in range(300)] + [50.0])
    >>> len(scores), scores[-1] > 0.5
    (301, True)
    """
    try:
        factory = DETECTORS[detector]
    except KeyError:
        raise ScoreError(f"unknown detector {detector!r}; valid names: "
                         f"{', '.join(sorted(DETECTORS))}") from None
    model = factory() if timestamps is None else None
    stamps = list(timestamps[:PERIOD_ROWS]) if timestamps is not None else []
    head: list[float] = []
    out = []
    for i, x in enumerate(values):
        if model is None:
            if i < PERIOD_ROWS:
                head.append(x)
                out.append(0.0)
                continue
            model = factory(values_per_day(stamps) or DEFAULT_PERIOD)
            for y in head:
                model.learn_one(y)
        out.append(_to_unit(model.score_one(x)))
        model.learn_one(x)
    return out


def read_nab_csv(path: str | Path) -> tuple[list[str], list[float]]:
    """``(timestamps, values)`` of a ``timestamp,value`` CSV with a header row (NAB format)."""
    timestamps, _texts, values = read_nab_rows(path)
    return timestamps, values


def read_nab_rows(path: str | Path) -> tuple[list[str], list[str], list[float]]:
    """``(timestamps, value texts as written, values)``; an empty value is a missing sample
    (NaN, as pandas writes one)."""
    path = Path(path)
    if path.is_dir():
        raise ScoreError(f"{path} is a directory; pass a 'timestamp,value' CSV file")
    try:
        with path.open(newline="") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None or [h.strip().lower() for h in header[:2]] != ["timestamp", "value"]:
                raise ScoreError(f"{path}: expected a 'timestamp,value' header, got {header}")
            timestamps: list[str] = []
            texts: list[str] = []
            values: list[float] = []
            for lineno, row in enumerate(reader, start=2):
                if not row:
                    continue
                if len(row) < 2:
                    raise ScoreError(f"{path}:{lineno}: expected 'timestamp,value', got {row}")
                try:
                    values.append(float(row[1]) if row[1].strip() else math.nan)
                except ValueError:
                    raise ScoreError(f"{path}:{lineno}: value {row[1]!r} is not a number "
                                     "(leave it empty or write nan for a missing sample)") from None
                timestamps.append(row[0])
                texts.append(row[1])
    except OSError as exc:
        raise ScoreError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, csv.Error) as exc:
        raise ScoreError(f"{path}: not a CSV text file ({exc})") from exc
    return timestamps, texts, values


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
        timestamps, texts, values = read_nab_rows(args.file)
        scores = score_series(values, detector=args.detector, timestamps=timestamps)
    except ScoreError as exc:
        err.write(f"trainsentry score: error: {exc}\n")
        return 2
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["timestamp", "value", "anomaly_score"])
    for ts, text, score in zip(timestamps, texts, scores, strict=True):
        writer.writerow([ts, text, f"{score:.6f}"])  # the value as the input wrote it
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
