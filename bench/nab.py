"""NAB scoring, re-implemented, and a benchmark of every detector on the NAB subset.

Run ``python -m bench.nab`` from the repository root. It scores every configuration in
:data:`detectors.score.DETECTORS` plus a faithful port of NAB's *windowed Gaussian*
detector (the validation reference: NAB publishes 50.9 / 31.1 / 59.0 for it on these
34 series) and prints, per profile, the per-category and total normalised scores.

The scorer follows NAB v1.1 (``nab/sweeper.py``, ``nab/scorer.py``, ``nab/optimizer.py``):

- probationary period: ``min(floor(0.15 * n), 0.15 * 5000)`` rows (so at most 750) at the
  start of each file are not scored at all (neither TP, FP nor FN credit);
- each row's "sweep score": inside a window ``scaled_sigmoid(-(right - i + 1) / width) *
  A_TP / scaled_sigmoid(-1)`` (the first row of a window earns exactly ``A_TP``, the last
  about 0); outside a window ``scaled_sigmoid(|i - prev_right| / (prev_width - 1)) *
  A_FP`` after a window (a detection just after a window costs little, one three
  widths later costs the full ``A_FP``) and ``-A_FP`` before the first window;
- with ``scaled_sigmoid(y) = 2 / (1 + exp(5 y)) - 1`` (``-1`` for ``y > 3``);
- a detection is a row whose anomaly score is ``>= threshold``; every detection outside a
  window adds its (negative) sweep score; a window is worth ``-A_FN`` until some row of it
  is detected, then the sweep score of its earliest detected row (the maximum);
- the threshold is optimised per detector and profile over the whole corpus (every
  distinct score is tried), then each file is scored at that threshold;
- normalised score ``100 * (raw - null) / (perfect - null)`` with ``null = -A_FN * W``
  (never fires) and ``perfect = A_TP * W`` (fires on the first row of each of W windows).
  Categories without windows (``artificialNoAnomaly``) have no normalised score; their
  FPs count in the total.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # `python bench/nab.py`: bench/ would shadow `detectors`
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

__all__ = [
    "PROFILES",
    "Profile",
    "NabFile",
    "probation_rows",
    "scaled_sigmoid",
    "sweep_scores",
    "optimise_threshold",
    "score_at_threshold",
    "load_corpus",
    "WindowedGaussian",
    "benchmark",
    "main",
]

DEFAULT_ROOT = Path("/work/shared/eval/nab")
PROBATION_PERCENT = 0.15

# Row labels besides window indices (0, 1, ...).
OUTSIDE = -1
PROBATION = -2


@dataclass(frozen=True)
class Profile:
    """NAB's application profile: the weights of a TP, an FP and an FN."""

    name: str
    tp: float
    fp: float
    fn: float


PROFILES: dict[str, Profile] = {
    "standard": Profile("standard", tp=1.0, fp=0.11, fn=1.0),
    "reward_low_FP_rate": Profile("reward_low_FP_rate", tp=1.0, fp=0.22, fn=1.0),
    "reward_low_FN_rate": Profile("reward_low_FN_rate", tp=1.0, fp=0.11, fn=2.0),
}


def probation_rows(n: int, percent: float = PROBATION_PERCENT) -> int:
    """Rows at the start of an ``n``-row file that NAB never scores (``i < this``)."""
    return math.ceil(min(math.floor(percent * n), percent * 5000))


def scaled_sigmoid(y: float) -> float:
    """NAB's weight of a detection at relative position ``y`` (-1 window start, 0 window end)."""
    if y > 3.0:
        return -1.0
    return 2.0 / (1.0 + math.exp(5.0 * y)) - 1.0


@dataclass
class NabFile:
    """One series: its values and, per row, which window it lies in."""

    name: str  # "<category>/<file>.csv"
    timestamps: list[str]
    values: list[float]
    windows: list[tuple[int, int]]  # inclusive row ranges
    labels: np.ndarray = field(repr=False)  # window index, OUTSIDE or PROBATION per row

    @property
    def category(self) -> str:
        return self.name.split("/", 1)[0]


def _parse_ts(text: str) -> datetime:
    return datetime.fromisoformat(text.strip())


def make_file(name: str, timestamps: list[str], values: list[float],
              windows: Sequence[tuple[int, int]]) -> NabFile:
    """Label rows with their window index (or OUTSIDE / PROBATION)."""
    n = len(values)
    labels = np.full(n, OUTSIDE, dtype=np.int64)
    for w, (lo, hi) in enumerate(windows):
        labels[lo:hi + 1] = w
    labels[:probation_rows(n)] = PROBATION
    return NabFile(name, timestamps, values, list(windows), labels)


def sweep_scores(f: NabFile, profile: Profile) -> np.ndarray:
    """Each row's NAB sweep score if it were a detection (``nab.sweeper.calcSweepScore``)."""
    n = len(f.values)
    out = np.empty(n)
    max_tp = scaled_sigmoid(-1.0)
    starts = {lo: (lo, hi) for lo, hi in f.windows}
    cur: tuple[int, int] | None = None
    prev: tuple[int, int] | None = None
    for i in range(n):
        if cur is None and i in starts:
            cur = starts[i]
        if cur is not None:
            width = cur[1] - cur[0] + 1
            out[i] = scaled_sigmoid(-(cur[1] - i + 1) / width) * profile.tp / max_tp
        elif prev is None:
            out[i] = -1.0 * profile.fp
        else:
            prev_width = prev[1] - prev[0] + 1
            out[i] = scaled_sigmoid(abs(prev[1] - i) / (prev_width - 1)) * profile.fp
        if cur is not None and i == cur[1]:
            prev, cur = cur, None
    return out


@dataclass(frozen=True)
class Result:
    """A detector's score on the corpus for one profile."""

    threshold: float
    raw: float
    per_file: dict[str, float]
    windows: int


def _score_rows(scores: np.ndarray, sweeps: np.ndarray, labels: np.ndarray, threshold: float,
                fn_weight: float) -> float:
    """Raw NAB score of one file's rows at one threshold."""
    hit = scores >= threshold
    total = float(sweeps[hit & (labels == OUTSIDE)].sum())
    n_windows = int(labels.max()) + 1 if labels.size and labels.max() >= 0 else 0
    for w in range(n_windows):
        rows = np.flatnonzero(hit & (labels == w))
        total += float(sweeps[rows[0]]) if rows.size else -fn_weight
    return total


def optimise_threshold(scored: Sequence[tuple[NabFile, np.ndarray]], profile: Profile) -> tuple[float, float]:
    """The corpus-wide threshold with the best raw score (``nab.optimizer.optimizeThreshold``).

    Every distinct anomaly score is a candidate threshold (rows ``>=`` it are detections);
    returns ``(threshold, raw score)``. Sweeps all rows once, sorted by score descending.
    """
    all_scores, all_sweeps, all_windows = [], [], []
    n_windows = 0
    for f, scores in scored:
        lab = f.labels
        keep = lab != PROBATION
        all_scores.append(scores[keep])
        all_sweeps.append(sweep_scores(f, profile)[keep])
        lab_k = lab[keep]
        all_windows.append(np.where(lab_k >= 0, lab_k + n_windows, -1))
        n_windows += len(f.windows)
    s = np.concatenate(all_scores)
    sw = np.concatenate(all_sweeps)
    wi = np.concatenate(all_windows)
    order = np.argsort(-s, kind="stable")
    s, sw, wi = s[order], sw[order], wi[order]

    window_val = np.full(n_windows, -profile.fn)
    total = float(window_val.sum())
    best_t, best = 1.1 + float(s.max(initial=0.0)), total  # a threshold nothing reaches
    i, n = 0, len(s)
    while i < n:
        t = s[i]
        j = i
        while j < n and s[j] == t:
            if wi[j] < 0:
                total += sw[j]
            else:
                w = wi[j]
                if sw[j] > window_val[w]:
                    total += sw[j] - window_val[w]
                    window_val[w] = sw[j]
            j += 1
        if total > best:
            best, best_t = total, float(t)
        i = j
    return best_t, best


def score_at_threshold(scored: Sequence[tuple[NabFile, np.ndarray]], profile: Profile,
                       threshold: float) -> dict[str, float]:
    """Raw NAB score of each file at one threshold."""
    return {f.name: _score_rows(scores, sweep_scores(f, profile), f.labels, threshold, profile.fn)
            for f, scores in scored}


def normalise(raw: float, windows: int, profile: Profile) -> float:
    """``100 * (raw - null) / (perfect - null)``; NaN when there is no window."""
    null, perfect = -profile.fn * windows, profile.tp * windows
    return math.nan if windows == 0 else 100.0 * (raw - null) / (perfect - null)


def load_corpus(root: Path = DEFAULT_ROOT) -> list[NabFile]:
    """Every series under ``root/data`` with its windows from ``combined_windows.json``."""
    from detectors.score import read_nab_csv

    windows = json.loads((root / "labels" / "combined_windows.json").read_text())
    files = []
    for name in sorted(windows):
        timestamps, values = read_nab_csv(root / "data" / name)
        times = [_parse_ts(t) for t in timestamps]
        rows = []
        for lo_text, hi_text in windows[name]:
            lo_t, hi_t = _parse_ts(lo_text), _parse_ts(hi_text)
            inside = [i for i, t in enumerate(times) if lo_t <= t <= hi_t]
            if times[inside[0]] != lo_t or times[inside[-1]] != hi_t:
                raise ValueError(f"{name}: window {lo_text}..{hi_text} does not start/end on a row")
            rows.append((inside[0], inside[-1]))
        files.append(make_file(name, timestamps, values, rows))
    return files


class WindowedGaussian:
    """NAB's ``windowedGaussian`` detector, ported as-is (the scorer's validation reference).

    Fills a window of 6400 values, then slides it in steps of 100; the score is
    ``1 - Q(|x - mean| / std)`` against the window's mean and population std (std 0 is
    replaced by 1e-6); the very first row scores 0. Not an O(1) production detector.
    """

    def __init__(self, window: int = 6400, step: int = 100) -> None:
        self.window = window
        self.step = step

    def run(self, values: Iterable[float]) -> list[float]:
        # The window lives in a numpy buffer (NAB keeps a list and calls numpy on it: same
        # numbers, without converting 6400 floats at every step of the fill phase).
        buf = np.empty(self.window + self.step)
        filled = 0
        pending = 0
        mean, std = 0.0, 1.0
        out = []
        for x in values:
            score = 0.0
            if filled:
                z = abs(x - mean) / std
                score = 1.0 - 0.5 * math.erfc(z / math.sqrt(2.0))
            out.append(score)
            update = False
            if filled < self.window:
                buf[filled] = x
                filled += 1
                update = True
            else:
                buf[self.window + pending] = x
                pending += 1
                if pending == self.step:
                    buf[:self.window] = buf[self.step:self.window + self.step].copy()
                    pending = 0
                    update = True
            if update:
                data = buf[:filled]
                mean = float(np.mean(data))
                std = float(np.std(data)) or 0.000001
        return out


def _run_detector(args: tuple[str, list[tuple[list[float], list[str]]]]
                  ) -> tuple[str, list[np.ndarray], float]:
    name, series = args
    start = time.perf_counter()
    if name == "nab_windowed_gaussian":
        out = [np.asarray(WindowedGaussian().run(v)) for v, _ in series]
    else:
        from detectors.score import score_series

        # Timestamps give the daily period (values per day), as in `trainsentry score`.
        out = [np.asarray(score_series(v, detector=name, timestamps=t)) for v, t in series]
    return name, out, time.perf_counter() - start


@dataclass(frozen=True)
class Row:
    detector: str
    profile: str
    threshold: float
    total: float
    per_category: dict[str, float]
    seconds: float


def evaluate(files: Sequence[NabFile], scores: Sequence[np.ndarray], name: str,
             seconds: float = 0.0) -> list[Row]:
    """Optimise the threshold and score the corpus under every profile."""
    scored = list(zip(files, scores, strict=True))
    rows = []
    categories = sorted({f.category for f in files})
    for profile in PROFILES.values():
        threshold, raw = optimise_threshold(scored, profile)
        per_file = score_at_threshold(scored, profile, threshold)
        total_windows = sum(len(f.windows) for f in files)
        per_cat = {}
        for cat in categories:
            fs = [f for f in files if f.category == cat]
            per_cat[cat] = normalise(sum(per_file[f.name] for f in fs),
                                     sum(len(f.windows) for f in fs), profile)
        rows.append(Row(name, profile.name, threshold, normalise(raw, total_windows, profile),
                        per_cat, seconds))
    return rows


def benchmark(names: Sequence[str], root: Path = DEFAULT_ROOT, workers: int = 2) -> list[Row]:
    """Score every named detector (plus ``nab_windowed_gaussian``) on the corpus."""
    files = load_corpus(root)
    series = [(f.values, f.timestamps) for f in files]
    rows: list[Row] = []
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for name, scores, secs in pool.map(_run_detector, [(n, series) for n in names]):
            rows.extend(evaluate(files, scores, name, secs))
    return rows


_SHORT = {"artificialNoAnomaly": "artNoAn", "artificialWithAnomaly": "artWith",
          "realAdExchange": "adExch", "realTraffic": "traffic", "realTweets": "tweets"}


def format_table(rows: Sequence[Row]) -> str:
    """One table per profile: detector, total, per category, threshold, seconds."""
    lines = []
    cats = sorted({c for r in rows for c in r.per_category if c != "artificialNoAnomaly"})
    for profile in PROFILES:
        lines.append(f"\n## NAB profile: {profile}\n")
        head = ["detector", "total"] + [_SHORT.get(c, c) for c in cats] + ["threshold", "secs"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in sorted((r for r in rows if r.profile == profile), key=lambda r: -r.total):
            cells = [r.detector, f"{r.total:.1f}"] + [f"{r.per_category[c]:.1f}" for c in cats]
            cells += [f"{r.threshold:.4f}", f"{r.seconds:.1f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, out: Callable[[str], object] = sys.stdout.write) -> int:
    from detectors.score import DETECTORS

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="NAB subset folder")
    parser.add_argument("--detector", action="append", choices=sorted(DETECTORS),
                        help="score only these (repeatable); default: all")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    names = list(args.detector or DETECTORS) + ["nab_windowed_gaussian"]
    start = time.perf_counter()
    rows = benchmark(names, args.root, args.workers)
    out(format_table(rows) + "\n")
    best = {r.profile: r for r in rows if r.detector == "best"}
    wg = {r.profile: r for r in rows if r.detector == "nab_windowed_gaussian"}
    fmt = " / ".join
    if best:
        out(f"\nbest ({best['standard'].detector}): standard / low FP / low FN = "
            f"{fmt(f'{best[p].total:.1f}' for p in PROFILES)}\n")
    out(f"nab_windowed_gaussian (published 50.9 / 31.1 / 59.0): "
        f"{fmt(f'{wg[p].total:.1f}' for p in PROFILES)}\n")
    out(f"elapsed {time.perf_counter() - start:.0f} s\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
